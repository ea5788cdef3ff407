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
"""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path
from typing import Sequence

import torch

from harness.environment import host_type
from harness.launch.cell import launch_dir
from harness.launch.placement import Placement
from harness.launch.placement.base import PORT_AT_LAUNCH
from harness.launch.plan import CELL_TOKEN_ENV, launch_environment, launcher_of, plan_launch
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


def describe_plan(specs: Sequence[RunSpec], placement: Placement, *, results: Path, timeout_s: float,
                  written: Sequence[Sequence[Path]] | None = None) -> str:
    """The plan of every cell of a run (specs as `placement.place` left them), for rows going to `results`.
    `written`: the files of each cell's launches, written already (`plan_files`), listed instead of printed."""
    launches = sum(spec.repeats for spec in specs)
    port = placement.planned_port()
    if written is None:
        lines = [f"parbench dry run: {len(specs)} cells, {launches} launches; nothing is launched or written"]
    else:
        files = sum(len(paths) for paths in written)
        lines = [f"parbench dry run: {len(specs)} cells, {launches} launches; nothing is launched; {files} files "
                 "written, each launch's listed under its cell, for you to submit"]
    lines.append(f"placement: {placement.describe()}")
    if port == PORT_AT_LAUNCH:
        lines.append(f"{PORT_AT_LAUNCH}: a free TCP port, chosen at launch on the cell's first host")
    if written is None:
        lines.append(f"{TOKEN_AT_LAUNCH}: the launch's marker ({CELL_TOKEN_ENV}), new at every launch; a cell's "
                     "repeats run the same commands, each in its own folder (-r0, -r1, ...)")
        lines.append("clean-up: when a launch ends, every process here that carries its marker is killed, then its "
                     "clean-up commands run")
    else:
        lines.append("each cell's commands are its first launch's (-r0); its other launches' are the same with "
                     "their own files (-r1, -r2, ...)")
    skipped: Counter[str] = Counter()
    environment = planned_environment(placement)
    for index, spec in enumerate(specs):
        launcher = launcher_of(spec)
        cell_dir = launch_dir(results, spec, 0, environment=environment)
        plan = plan_launch(spec, placement, cell_dir=cell_dir, port=port if launcher.uses_port else "",
                           environment=launch_environment(spec, TOKEN_AT_LAUNCH), timeout_s=timeout_s)
        lines += ["", f"{spec.label} x{spec.repeats}: {launcher.name}, {spec.nnodes} node(s) x "
                      f"{spec.ranks_per_node} rank(s)"]
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
        reason = get_strategy(spec.strategy).skip_reason(spec)
        if reason:
            skipped[reason] += 1
    if skipped:
        lines.append("")
        lines += [f"on this machine {count} of these cells would be skipped: {reason}"
                  for reason, count in skipped.items()]
    return "\n".join(lines)
