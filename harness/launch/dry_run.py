"""A run's plan, printed instead of run: every cell and the exact command each of its nodes would run.

    python -m harness run --matrix scaling --dry-run --device cuda --gpus-per-node 8 --nnodes 4
    python -m harness run --matrix full --dry-run --hostfile hosts --remote-shell "ssh -p 2222 {host}"
    python -m harness run --matrix full --dry-run --slurm --nnodes 2

It goes through the same planning as a launch (harness.launch.plan.plan_launch) but launches nothing and
writes nothing: the files a launch would write (DeepSpeed's hostfile, Slurm's job script) are printed with
the commands. What is only chosen at launch shows as a placeholder the output names: the rendezvous port
(`<port>`; under Slurm the job script's own variable) and the launch's marker (`<token>`).

A placement whose plan is its files (Kubernetes manifests, which the user submits) is the exception:
`plan_files` gives every launch's files, which `run` writes, and the plan lists them by path.

    python -m harness run --matrix scaling --dry-run --nnodes 4 --placement k8s --out k8s/scaling

A plan for nodes described by the flags (--gpus-per-node, --cpus-per-node, --nnodes above 1: the `target`) is
judged against them, not this host: the cells they would skip (`left_out_on`) are left out of the plan, its
counts and its files, and named once at its end; a GPU plan's header gives its projected wall time and GPU-hours
on a described cluster (`projected_lines`). A plan of this host's cells alone keeps this host's skips, counted
at the end.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from harness.environment import host_type
from harness.machine import Machine
from harness.launch.cell import launch_dir
from harness.launch.placement import Placement
from harness.launch.placement.base import PORT_AT_LAUNCH
from harness.launch.plan import CELL_TOKEN_ENV, launch_environment, launcher_of, plan_launch
from harness.memory_fit import skip_reason
from harness.project.cluster import Cluster
from harness.project.cells import cell_step
from harness.spec import RunSpec
from harness.strategies import get_strategy
from workloads import get_workload
from workloads.base import memory_format_name

TOKEN_AT_LAUNCH = "<token>"
FILE_LINE = "    | "      # prefix of each line of a file the launch would write


def planned_environment(placement: Placement) -> dict:
    """What a run here would record of its conditions (harness.derive.identity), which name its folders."""
    return {**host_type(), **placement.recorded()}


def plan_files(specs: Sequence[RunSpec], placement: Placement, *, results: Path,
               timeout_s: float) -> list[list[tuple[Path, str]]]:
    """The files of every launch of every cell, cell by cell and repeat by repeat (each repeat has its own
    folder, so its own files): what a dry run writes for a placement whose plan is its files."""
    environment = planned_environment(placement)
    port = placement.planned_port()
    return [[file for repeat in range(spec.repeats) for file in plan_launch(
                spec, placement, cell_dir=launch_dir(results, spec, repeat, environment=environment),
                port=port if launcher_of(spec).uses_port else "", timeout_s=timeout_s,
                environment=launch_environment(spec, TOKEN_AT_LAUNCH)).files]
            for spec in specs]


def left_out_on(specs: Sequence[RunSpec], target: Machine) -> tuple[list[RunSpec], list[tuple[RunSpec, str]]]:
    """(the cells `target` would run, [(cell, why it would skip it)]): each strategy's own skip rule
    (`Strategy.skip_reason`) judged on the target's devices, not this host's."""
    kept, left = [], []
    for spec in specs:
        reason = get_strategy(spec.strategy).skip_reason(spec, target)
        if reason:
            left.append((spec, reason))
        else:
            kept.append(spec)
    return kept, left


def describe_target(target: Machine) -> str:
    what = "GPUs" if target.device.value == "cuda" else "CPU cores"
    return f"{target.nodes} node(s) x {target.devices_per_node} {what}"


# ---- projected wall time --------------------------------------------------------------------------------------

# A launch's start-up: `harness.ab.LAUNCH_SECONDS`, each strategy's whole launch of gpt-tiny measured on the 2-core
# CPU VM (launcher, ranks, 42 steps of a model too small to matter). Measured on CPU, so a floor on a GPU node,
# where CUDA's context and NCCL's rendezvous across nodes add to it; a strategy it has not measured takes
# UNMEASURED_LAUNCH_S, as the slowest.


@dataclass(frozen=True)
class CellProjection:
    spec: RunSpec
    start_s: float                  # one launch's start-up
    step_s: float | None            # one optimizer step; None: unknown, for `unknown`
    unknown: str = ""
    compute_from: str = ""          # where its compute MFU came from

    @property
    def wall_s(self) -> float | None:
        """repeats x (start-up + (warm-up + timed steps) x step): every launch runs every step of the cell."""
        if self.step_s is None:
            return None
        return self.spec.repeats * (self.start_s + (self.spec.warmup_steps + self.spec.timed_steps) * self.step_s)

    @property
    def gpu_hours(self) -> float | None:
        """Its wall time x its GPUs (one a rank: the world size), in hours."""
        return None if self.wall_s is None else self.wall_s * self.spec.world_size / 3600


def project_cells(specs: Sequence[RunSpec], cluster: Cluster, mfu: float | None = None) -> list[CellProjection]:
    """Every cell's projected launches on `cluster` (harness.project.cells.cell_step: compute from the workload's
    FLOPs, PaLM's 6N + 12 L h s a token for the GPTs, at the compute MFU parbench's plain loop measured on a GPU or
    the one fitted on published runs, or `mfu` where given, plus its strategy's collectives priced on the cluster's
    links), or unknown with the reason."""
    from harness.ab import LAUNCH_SECONDS, UNMEASURED_LAUNCH_S

    projected = []
    for spec in specs:
        step = cell_step(spec, cluster, mfu=mfu)
        projected.append(CellProjection(spec=spec, start_s=LAUNCH_SECONDS.get(spec.strategy, UNMEASURED_LAUNCH_S),
                                        step_s=step.step_s, unknown=step.unknown, compute_from=step.compute_from))
    return projected


def projected_lines(projected: Sequence[CellProjection], cluster: Cluster, cluster_source: str,
                    nodes: int = 1) -> list[str]:
    """The header's projected wall time and GPU-hours of the planned cells (each cell's own GPUs, and the
    reservation's: `nodes` x the cluster's GPUs a node for the whole wall time, what holding the nodes costs), what
    they assume, and the cells they leave out as unknown."""
    known = [cell for cell in projected if cell.wall_s is not None]
    wall = sum(cell.wall_s for cell in known)
    hours = sum(cell.gpu_hours for cell in known)
    reserved = nodes * cluster.gpus_per_node * wall / 3600
    unknown = Counter(cell.unknown for cell in projected if cell.wall_s is None)
    sources = Counter(cell.compute_from for cell in known)
    lines = [f"projected, not measured: {wall / 3600:.3g} h of launches one after another; {hours:.3g} GPU-hours in "
             f"the cells (each its own GPUs), {reserved:.3g} GPU-hours reserved ({nodes} node(s) x "
             f"{cluster.gpus_per_node} GPUs x the wall time), for {len(known)} of the {len(projected)} cells"
             + (f" (the other {sum(unknown.values())} unknown, not in these totals)" if unknown else "")]
    lines += [f"  unknown: {count} cell(s): {reason}" for reason, count in unknown.items()]
    lines.append(f"  assumed: cluster {cluster.name} ({cluster_source}): {cluster.gpu}, {cluster.gpus_per_node} a "
                 f"node; a cell = repeats x (start-up + (warm-up + timed steps) x step); step = compute (the "
                 "workload's FLOPs over the datasheet peak x a compute MFU) + its strategy's collectives on the "
                 "cluster's links, all exposed; start-up: each strategy's launch measured on CPU (harness.ab), a floor")
    lines += [f"  compute MFU of {count} cell(s): {source}" for source, count in sources.items()]
    return lines


def describe_plan(specs: Sequence[RunSpec], placement: Placement, *, results: Path, timeout_s: float,
                  written: Sequence[Sequence[Path]] | None = None, target: Machine | None = None,
                  left_out: Sequence[tuple[RunSpec, str]] = (), cluster: Cluster | None = None,
                  cluster_source: str = "", repeats: Sequence[Sequence[int]] | None = None) -> str:
    """The plan of every cell of a run (specs as `placement.place` left them), for rows going to `results`.
    `written`: the files of each cell's launches, written already (`plan_files`), listed instead of printed.
    `target`: the nodes the plan is for where they are not this host; `left_out`: the cells it would skip
    (`left_out_on`), named at the end; `cluster`: where the cells' wall time is projected (GPU plans);
    `repeats`: each cell's launches by repeat where not all from r0 (a resume's, harness.runner.resume_plan), whose
    folders the commands name."""
    launches = sum(spec.repeats for spec in specs)
    port = placement.planned_port()
    if written is None:
        lines = [f"parbench dry run: {len(specs)} cells, {launches} launches; nothing is launched or written"]
    else:
        files = sum(len(paths) for paths in written)
        lines = [f"parbench dry run: {len(specs)} cells, {launches} launches; nothing is launched; {files} files "
                 "written, each launch's listed under its cell, for you to submit"]
    if target is not None:
        lines.append(f"planned for {describe_target(target)}, not this host: cells judged against those nodes"
                     + (f"; {len(left_out)} more they would skip are left out (listed at the end)" if left_out else ""))
    projected = project_cells(specs, cluster) if cluster is not None else None
    if projected is not None:
        nodes = target.nodes if target is not None else max(spec.nnodes for spec in specs)
        lines += projected_lines(projected, cluster, cluster_source, nodes=nodes)
    lines.append(f"placement: {placement.describe()}")
    if port == PORT_AT_LAUNCH:
        lines.append(f"{PORT_AT_LAUNCH}: a free TCP port, chosen at launch on the cell's first host")
    if written is None:
        folders = ("(-r0, -r1, ...)" if repeats is None
                   else "(-rN for launch rN: each cell lists the launches left to run and shows its first one's)")
        lines.append(f"{TOKEN_AT_LAUNCH}: the launch's marker ({CELL_TOKEN_ENV}), new at every launch; a cell's "
                     f"repeats run the same commands, each in its own folder {folders}")
        lines.append("clean-up: when a launch ends, every process here that carries its marker is killed, then its "
                     "clean-up commands run")
    else:
        lines.append("each cell's commands are its first launch's (-r0); its other launches' are the same with "
                     "their own files (-r1, -r2, ...)")
    skipped: Counter[str] = Counter()
    environment = planned_environment(placement)
    for index, spec in enumerate(specs):
        launcher = launcher_of(spec)
        launches_of = list(range(spec.repeats)) if repeats is None else list(repeats[index])
        cell_dir = launch_dir(results, spec, launches_of[0], environment=environment)
        plan = plan_launch(spec, placement, cell_dir=cell_dir, port=port if launcher.uses_port else "",
                           environment=launch_environment(spec, TOKEN_AT_LAUNCH), timeout_s=timeout_s)
        which = "" if repeats is None else f" (launches {', '.join(f'r{repeat}' for repeat in launches_of)})"
        lines += ["", f"{spec.label} x{spec.repeats}{which}: {launcher.name}, {spec.nnodes} node(s) x "
                      f"{spec.ranks_per_node} rank(s)"]
        if projected is not None:
            cell = projected[index]
            lines.append(f"  projected: unknown ({cell.unknown})" if cell.wall_s is None else
                         f"  projected: {spec.repeats} x ({cell.start_s:g} s + {spec.warmup_steps + spec.timed_steps} "
                         f"steps x {cell.step_s:.3g} s) = {cell.wall_s:.0f} s, {cell.gpu_hours:.3g} GPU-hours")
        layout = get_workload(spec.workload).input_memory_format(spec.device.value)
        if layout != torch.contiguous_format:       # what the worker will build its inputs as (workloads.base)
            lines.append(f"  inputs: {memory_format_name(layout)}")
        lines += [f"  {target}: {shlex.join(command)}" for target, command in zip(plan.targets, plan.commands)]
        lines += [f"  clean-up on {target}: {shlex.join(command)}"
                  for target, command in zip(plan.cleanup_targets, plan.cleanup)]
        if written is not None:
            lines += [f"  wrote {path}" for path in written[index]]
        for path, text in ([] if written is not None else plan.files):
            lines.append(f"  file {path}:")
            lines += [f"{FILE_LINE}{line}" for line in text.splitlines()]
        # A planned target's skips are left out already; a plan of this host's cells says what it would skip.
        reason = skip_reason(spec) if target is None else None
        if reason:
            skipped[reason] += 1
    if skipped:
        lines.append("")
        lines += [f"on this machine {count} of these cells would be skipped: {reason}"
                  for reason, count in skipped.items()]
    if left_out:
        by_reason: dict[str, list[str]] = {}
        for spec, reason in left_out:
            by_reason.setdefault(reason, []).append(spec.label)
        lines += ["", f"left out: {len(left_out)} cells the cluster ({describe_target(target)}) would skip"
                  if target is not None else f"left out: {len(left_out)} cells the cluster would skip"]
        lines += [f"  {reason} ({len(labels)}): {', '.join(labels)}" for reason, labels in by_reason.items()]
    return "\n".join(lines)
