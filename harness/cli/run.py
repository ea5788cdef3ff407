"""`harness run`: its arguments, the cells they select (`plan_run`), their launch with a progress bar, and the run's
exit status (`run_exit_status`); a dry run's plan and manifests are harness.cli.dry_run's.

    python -m harness run --matrix smoke --strategy ddp --world-sizes 2 --global-batch 32
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tqdm import tqdm

from harness.cli.arguments import (CLUSTER_PRESETS, _csv, _int_csv, _seconds, add_cluster_arguments,
                                   add_device_argument, add_emulation_arguments, add_strategy_options,
                                   add_timeout_argument)
from harness.cli.dry_run import DRY_RUN_CLUSTER, dry_run_cluster, dry_run_target, write_manifests
from harness.emulate.network import EmulatedNetwork
from harness.emulate.session import check_emulation
from harness.launch.placement import NAMED, EmulatedPlacement, KubernetesPlacement, Placement, make_placement
from harness.launch.placement.k8s import DEFAULT_IMAGE, JobKind
from harness.launch.plan import threads_per_rank
from harness.machine import Machine, oversubscription_warning
from harness.matrix import MATRICES, Selection, build_matrix, launch_order
from harness.outputs import check_results_file
from harness.rank.faults import fault_from_environment
from harness.record import read_rows
from harness.spec import RunResult, RunSpec, SpecError, Status

if TYPE_CHECKING:
    from harness.runner import Planned, RunOptions

# `run`'s exit status when a launch ended in one of FAILED_STATUSES: distinct from bad input (2) and a failed
# append (1), so a script driving the harness (the Docker check, CI) can tell that cells failed. `skipped` is
# not a failure: a strategy this environment cannot run says so in its row.
EXIT_CELLS_FAILED = 4
FAILED_STATUSES = frozenset({Status.FAILED, Status.OOM, Status.TIMEOUT})
# `run`'s exit status when a launch ran but its rows failed a check: a parity or a resume mismatch is a wrong
# result, as much a failure of the cell as a crash, and must not pass a script that reads only the status.
EXIT_CHECK_FAILED = 5


def add_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="run a matrix of cells and append their rows")
    run.set_defaults(handler=command_run)
    run.add_argument("--matrix", default="smoke", help=f"one of: {', '.join(MATRICES)}")
    add_device_argument(run)
    run.add_argument("--gpus-per-node", type=int, help="with --device cuda: GPUs of each node to plan for "
                     "(default: those visible here; more than that only with --dry-run)")
    run.add_argument("--cpus-per-node", type=int, help="with --device cpu: cores of each node to plan for, a "
                     "rank per core (default: this host's; more than that only with --dry-run)")
    run.add_argument("--workload", type=_csv, help="comma-separated workloads to keep")
    run.add_argument("--strategy", type=_csv, help="comma-separated strategies to keep")
    run.add_argument("--world-sizes", type=_int_csv, help="comma-separated world sizes")
    run.add_argument("--repeats", type=int, help="launches per cell")
    run.add_argument("--global-batch", type=int, help="samples per optimizer step (overrides the matrix)")
    run.add_argument("--micro-batch", type=int, help="samples per forward pass per rank (overrides)")
    run.add_argument("--precision", help="fp32, bf16 or fp16 (overrides)")
    run.add_argument("--warmup-steps", type=int)
    run.add_argument("--timed-steps", type=int)
    run.add_argument("--seed", type=int)
    add_strategy_options(run, help="strategy option for every selected cell (repeatable)")
    run.add_argument("--out", type=Path, help="results JSONL (default: results/<matrix>-<time>.jsonl); with "
                     "--placement k8s, the folder the manifests are written to")
    add_timeout_argument(run, default=900.0, help="seconds per launch before its ranks are killed")
    run.add_argument("--budget", type=_seconds, help="seconds the whole run may take: no launch starts with under "
                     "30 s of it left, each times out at what is left, and those not started are recorded skipped "
                     "(a lent GPU's or an allocation's time)")
    run.add_argument("--resume", action="store_true", help="with --out: skip launches already recorded ok there, and "
                     "record those whose measurements reached their cell folder without their row")
    run.add_argument("--dry-run", action="store_true", help="print the cells and exit (with --placement k8s, "
                     "also write each launch's manifest to --out DIR)")
    add_cluster_arguments(run, cluster="with --dry-run for GPU nodes (--gpus-per-node): the cluster its wall time "
                          f"and GPU-hours are projected on, a preset ({CLUSTER_PRESETS}) or a .toml file (default "
                          f"{DRY_RUN_CLUSTER}; its GPUs a node are --gpus-per-node)",
                          overrides="with --cluster: override a cluster key for the dry run's projection, e.g. "
                          "inter_node_bandwidth_GBps=100")
    run.add_argument("--allow-failed-cells", action="store_true", help=f"exit 0 even when a launch ended failed, "
                     f"oom or timeout (default: exit {EXIT_CELLS_FAILED} after the whole matrix has run)")
    run.add_argument("--hostfile", type=Path, help="DeepSpeed/MPI hostfile ('HOST slots=N' lines): run the "
                     "cells on these hosts, multi-rank cells spread over --nnodes of them")
    run.add_argument("--nnodes", type=int, help="nodes a multi-rank cell spreads over (default: every host of "
                     "the hostfile; 1 under --slurm)")
    run.add_argument("--remote-shell", help="with --hostfile: how to run a command on a host "
                     "(default 'ssh -o BatchMode=yes {host}'; {host} and {node} are filled in)")
    run.add_argument("--slurm", action="store_true", help="submit each launch as a Slurm job (sbatch --wait)")
    run.add_argument("--slurm-args", help="extra sbatch arguments, e.g. '--partition gpu --account proj'")
    add_emulation_arguments(run, link="run on an emulated cluster on this machine (root): nodes as network "
                            "namespaces whose links tc shapes to RATE, e.g. 100mbit or 1gbit")
    run.add_argument("--placement", choices=NAMED, help="k8s: write each launch as a Kubernetes (Kubeflow) manifest "
                     "for you to submit with kubectl, with --dry-run --out DIR (docs/clusters.md)")
    run.add_argument("--k8s-image", help=f"with --placement k8s: the image every pod runs (default {DEFAULT_IMAGE}, "
                     "the Dockerfile's, pushed where the cluster pulls from)")
    run.add_argument("--k8s-namespace", help="with --placement k8s: the namespace (default default)")
    run.add_argument("--k8s-results-claim", help="with --placement k8s: the PersistentVolumeClaim every pod mounts "
                     "at /parbench/results, where cell folders and rows go (default parbench-results)")
    run.add_argument("--k8s-job", choices=[kind.value for kind in JobKind], help="with --placement k8s: what "
                     "torchrun cells become, a PyTorchJob (default) or a Trainer v2 TrainJob; other cells keep theirs")
    run.add_argument("--k8s-shm", help="with --placement k8s: the size of each pod's /dev/shm (default 16Gi)")
    run.add_argument("--profile-steps", type=int, default=0, help="GPU only: after the timed steps, profile "
                     "this many steps for NCCL kernel time and its overlap with compute")
    run.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s for MFU, used instead of "
                     "the datasheet table (which has no CPUs) and recorded as the user's")


def plan_run(args: argparse.Namespace) -> tuple[list[RunSpec], Placement]:
    """The validated cells a `run` invocation asks for and where they go, planned for the machine it names
    (this one, or with --dry-run one it need not be); raises SpecError before anything launches, and warns
    in one line on stderr where CPU ranks would outnumber a node's cores."""
    emulated = EmulatedNetwork.planned(args.emulate_link, args.emulate_nodes) if args.emulate_link else None
    kubernetes = {field: value for field, value in (("image", args.k8s_image), ("namespace", args.k8s_namespace),
                                                    ("results_claim", args.k8s_results_claim), ("job", args.k8s_job),
                                                    ("shm_size", args.k8s_shm)) if value is not None}
    if args.placement == KubernetesPlacement.name and args.dry_run:
        if args.out is None:
            raise SpecError("--placement k8s --dry-run needs --out DIR: the folder each launch's manifest is "
                            "written to")
        kubernetes["manifests"] = args.out
    placement = make_placement(args.hostfile, args.nnodes, args.remote_shell, args.slurm, args.slurm_args,
                               dry_run=args.dry_run, emulated=emulated, named=args.placement, kubernetes=kubernetes)
    # Under Slurm the nodes are not this host (a login node often has no GPU): their devices are described
    # by the flags, as for a dry run, and the job asks Slurm for them.
    machine = Machine.requested(args.device, gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node,
                                nodes=placement.nnodes, dry_run=args.dry_run or args.slurm)
    overrides = tuple((name, getattr(args, name)) for name in
                      ("global_batch", "micro_batch", "precision", "warmup_steps", "timed_steps", "seed")
                      if getattr(args, name) is not None)
    select = Selection(workloads=args.workload, strategies=args.strategy, world_sizes=args.world_sizes,
                       repeats=args.repeats, overrides=overrides, options=tuple(args.option))
    specs = [placement.place(spec, machine.devices_per_node) for spec in build_matrix(args.matrix, machine, select)]
    if emulated is not None and not args.dry_run:
        check_emulation(emulated, specs)
    warning = oversubscription_warning(specs, machine, threads_per_rank, placement.ranks_sharing_a_machine)
    if warning:
        print(f"parbench: warning: {warning}", file=sys.stderr)
    return specs, placement


def run_placed(specs: list[RunSpec], options: "RunOptions", **callbacks: Any) -> list[RunResult]:
    """harness.runner.run_specs at `options.placement`, inside the emulated cluster it names if it is one
    (built for these launches, torn down after, recorded in each row)."""
    from harness.runner import run_specs

    placement = options.placement
    if not isinstance(placement, EmulatedPlacement):
        return run_specs(specs, options, **callbacks)
    from harness.emulate.session import emulating

    print(f"parbench: on {placement.describe()}", file=sys.stderr)
    with emulating(placement.network, specs) as network:
        return run_specs(specs, replace(options, emulated_network=network), **callbacks)


def command_run(args: argparse.Namespace) -> int:
    from harness.runner import RunOptions, summary_table

    specs, placement = plan_run(args)
    plan: dict[str, Any] = {}       # a dry run's target, the cells it would skip and the cluster it is priced on
    if args.dry_run:
        from harness.launch.dry_run import left_out_on

        plan["target"] = dry_run_target(args, placement)
        if plan["target"] is not None:
            specs, plan["left_out"] = left_out_on(specs, plan["target"])
    plan["cluster"], plan["cluster_source"] = dry_run_cluster(args, plan.get("target"))
    if args.profile_steps < 0:
        raise SpecError(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.resume and args.out is None:
        raise SpecError("--resume needs --out FILE: the results file whose recorded launches to skip")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise SpecError(f"--peak-tflops must be a positive TFLOP/s figure, got {args.peak_tflops:g}")
    try:
        fault_from_environment()
    except ValueError as error:
        raise SpecError(str(error)) from None
    if args.profile_steps:
        os.environ["PARBENCH_PROFILE_STEPS"] = str(args.profile_steps)   # ranks inherit it; rows record it
    if args.dry_run and isinstance(placement, KubernetesPlacement):
        return write_manifests(specs, placement, args.out, args.timeout, **plan)
    if args.dry_run:   # the plan, with every node's command; launches nothing, writes nothing
        from harness.launch.dry_run import describe_plan
        from harness.runner import resume_plan

        planned_out = args.out or Path("results") / f"{args.matrix}-{datetime.now():%Y%m%d-%H%M%S}.jsonl"
        repeats = None      # every repeat of every cell, from r0
        if args.resume:     # what a resume would launch, not the whole matrix, in the folders it would use
            specs, repeats, counts = resume_plan(specs, RunOptions(results=planned_out, placement=placement,
                                                                   resume=True))
            print(f"{run_header(counts, planned_out)} (a dry run of the resume: nothing is launched or written)")
            if not specs:
                return 0
        print(describe_plan(specs, placement, results=planned_out, timeout_s=args.timeout, repeats=repeats, **plan))
        return 0
    out = args.out or Path("results") / f"{args.matrix}-{datetime.now():%Y%m%d-%H%M%S}.jsonl"
    check_results_file(out, "--out" if args.out else "results file")
    from harness.doctor import summary

    print(summary(), file=sys.stderr)
    peak = args.peak_tflops * 1e12 if args.peak_tflops is not None else None
    options = RunOptions(results=out, timeout_s=args.timeout, peak_flops_per_s=peak, resume=args.resume,
                         placement=placement, budget_s=args.budget, launch_order=launch_order(args.matrix))
    # The bar shows the cell being launched and tqdm's ETA (mean time per launch so far x launches left);
    # off when stderr is not a terminal, where the per-launch lines below are the log.
    with tqdm(total=sum(spec.repeats for spec in specs), unit="launch", file=sys.stderr, disable=None,
              dynamic_ncols=True) as bar:
        def planned(plan: "Planned") -> None:
            bar.write(run_header(plan, out), file=sys.stderr)
            bar.total = plan.launches + plan.recovered
            bar.refresh()

        def started(spec: RunSpec, repeat: int) -> None:
            bar.set_description(f"{spec.label} r{repeat}")

        def finished(result: RunResult) -> None:
            bar.write(f"  {result.status.value:<8} {result.spec.label} r{result.repeat} "
                      f"({result.wall_time_s:.0f} s){'  ' + result.message[:100] if result.message else ''}",
                      file=sys.stderr)
            bar.update(1)

        results = run_placed(specs, options, on_result=finished, on_start=started, on_plan=planned)
    print(summary_table([result.to_dict() for result in results], results_file=out))
    print(f"\nrows appended to {out}")
    return run_exit_status(results, allow_failed=args.allow_failed_cells,
                           checks_failed=failed_checks([result.to_dict() for result in results], out))


def failed_checks(rows: Sequence[dict], results_file: Path | None = None) -> list[str]:
    """"label: what failed" for each of `rows` that is a parity or a resume mismatch, judged as the summary judges
    them: beside every row of `results_file` (a reference recorded earlier counts)."""
    from harness.derive.parity import Verdict, judge
    from harness.derive.resume import resume_check
    from harness.derive.rows import label

    shown = {row.get("run_id") for row in rows}
    earlier = [row for row in read_rows([results_file]) if row.get("run_id") not in shown] \
        if results_file is not None and results_file.exists() else []
    failed = []
    for row, parity in zip(rows, judge(list(rows) + earlier)):
        if parity.verdict is Verdict.MISMATCH:
            failed.append(f"{label(row)}: parity mismatch ({', '.join(parity.failed) or parity.note[:80]})")
        if row.get("status") == "ok" and (row.get("measurements") or {}).get("checkpoint"):
            check = resume_check(row)
            if check["verdict"] == "mismatch":
                failed.append(f"{label(row)}: resume mismatch ({', '.join(check['failed'])})")
    return failed


def run_exit_status(results: Sequence[RunResult], *, allow_failed: bool, checks_failed: Sequence[str] = ()) -> int:
    """0; or EXIT_CELLS_FAILED with one line on stderr naming how many launches failed and how; or, where every
    launch ran, EXIT_CHECK_FAILED with a line per row that failed a check (`failed_checks`)."""
    failed = [result for result in results if result.status in FAILED_STATUSES]
    if not failed and not checks_failed:
        return 0
    status = EXIT_CELLS_FAILED if failed else EXIT_CHECK_FAILED
    lines = []
    if failed:
        kinds = ", ".join(f"{sum(r.status is status for r in failed)} {status.value}"
                          for status in sorted(FAILED_STATUSES) if any(r.status is status for r in failed))
        lines.append(f"{len(failed)} of {len(results)} launches did not end ok ({kinds})")
    if checks_failed:
        lines.append(f"{len(checks_failed)} launches failed a check: " + "; ".join(checks_failed))
    outcome = "; ".join(lines)
    if allow_failed:
        print(f"parbench: {outcome}; exit 0 as --allow-failed-cells asks", file=sys.stderr)
        return 0
    print(f"parbench: {outcome}; exit {status} (--allow-failed-cells: exit 0)", file=sys.stderr)
    return status


def run_header(plan: "Planned", out: Path) -> str:
    """The run's first line: what it will launch, and what a resumed run found already recorded."""
    def launches(count: int) -> str:
        return f"{count} launch{'' if count == 1 else 'es'}"

    text = f"parbench: {plan.cells} cells, {launches(plan.launches)} -> {out}"
    if plan.recorded:
        text += f"; {launches(plan.recorded)} already recorded there, not launched again"
    if plan.recovered:
        text += f"; {launches(plan.recovered)} recorded from their cell folders without launching"
    if plan.seconds is not None and plan.launches:
        text += f"; planned: about {plan.seconds / 60:.1f} min at the 2-core VM's launch times (harness/run_cost.py)"
    return text
