"""Collective microbenchmark: time, algbw and busbw per collective and size, as nccl-tests defines them.

    python -m harness comm --world-size 2                       # launched by torchrun like any cell
    torchrun --nproc-per-node 2 -m harness.commbench --out DIR ...   # what that runs in each rank

Each rank allocates every buffer of a collective and size once (fp32, doubling from --min-bytes to
--max-bytes, rounded up to a whole number of elements per rank; all_to_all's output included), runs
`warmup` untimed calls, then times `iters` back-to-back calls on those buffers between two device
synchronisations, as nccl-tests does, and takes the mean time per call. The collective's time is the mean
of the ranks' times, nccl-tests' default (`-a 1`; src/common.cu: `static int average = 1`, reduced with
`Allreduce(args, &deltaSec, average)` before `getBw`), with the slowest rank's time kept beside it
(`time_max_rank_s`) and every rank's (`time_by_rank_s`). Sizes are nccl-tests' "size": the all-reduced or
broadcast tensor, the whole gathered output (all_gather), the whole scattered input (reduce_scatter), the
send buffer (all_to_all). algbw = size / time; busbw = algbw x factor (harness.derive.comm.BUSBW_FACTORS),
from the mean time, and from the slowest rank's time as `busbw_max_rank_bytes_per_s`.

Rows written before the mean was taken have only `time_s`, which was the slowest rank's time; readers
label them with `rank_time_reduction` (MAX_RANK_ONLY).

With `--group-size G` the world is split into W / G groups of G ranks that run each collective at the same
time, each among its own members (`groups_of`): `contiguous` groups hold consecutive ranks (on nodes filled
one after another, a node's ranks: a tensor-parallel group inside a node), `strided` groups hold ranks W / G
apart (one a node: the data-parallel group of a 2-D mesh). That is what a hybrid's groups meet in a step,
the other groups busy beside them; sizes, algbw and busbw are then a group's, of G ranks. The record says
which (`group_size`, `group_stride`).

Stopped by a signal (SIGTERM, SIGINT, SIGHUP: harness.launch.interrupt), the benchmark appends a row of its own, as
`run` does for its launch: `status` interrupted, the signal in its `message`, no measurements (`rows` empty), which
no reader of measurements sees (harness.record.read_rows).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from statistics import fmean
from typing import Any, Callable, Sequence

from harness.rank.parent_death import die_with_launcher
from harness.rank.teardown import exit_without_teardown

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
GROUP_LAYOUTS = ("contiguous", "strided")
RESULTS_FILE = "commbench.json"
MEAN_OVER_RANKS = "mean over ranks (nccl-tests -a 1)"
MAX_RANK_ONLY = "slowest rank only"


def sizes_between(min_bytes: int, max_bytes: int) -> list[int]:
    """Doubling sizes from min_bytes up to max_bytes, both included."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise ValueError(f"sizes must satisfy 4 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


def groups_of(world_size: int, group_size: int, layout: str) -> list[list[int]]:
    """The ranks of each of world_size / group_size groups: consecutive ranks (`contiguous`) or ranks
    world_size / group_size apart (`strided`)."""
    if group_size < 2 or world_size % group_size:
        raise ValueError(f"a group size must be >= 2 and divide the world size {world_size}, got {group_size}")
    if layout not in GROUP_LAYOUTS:
        raise ValueError(f"group layout {layout!r}; allowed: {', '.join(GROUP_LAYOUTS)}")
    count = world_size // group_size
    if layout == "contiguous":
        return [[g * group_size + i for i in range(group_size)] for g in range(count)]
    return [[g + i * count for i in range(group_size)] for g in range(count)]


def group_stride(world_size: int, group_size: int, layout: str) -> int:
    """Ranks between a group's neighbours: 1 in a contiguous group, world_size / group_size in a strided one."""
    return 1 if layout == "contiguous" or group_size == world_size else world_size // group_size


def _operation(name: str, size_bytes: int, ranks: int, device, group=None) -> tuple[Callable[[], Any], int]:
    """A closure issuing one collective among `group` (`ranks` members; None: the world) over buffers
    allocated here, once, and the exact size it moves in bytes: the timed loop calls it over and over and
    must time the collective, not the allocator."""
    import torch
    import torch.distributed as dist

    elements = max(ranks, -(-size_bytes // 4))
    elements += (-elements) % ranks                          # divisible into equal per-rank shards
    full = torch.ones(elements, dtype=torch.float32, device=device)
    shard = torch.ones(elements // ranks, dtype=torch.float32, device=device)
    received = torch.empty_like(full) if name == "all_to_all" else None
    operations = {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
        # The group's first member sends (a global rank: broadcast's src is one).
        "broadcast": lambda: dist.broadcast(full, src=dist.get_global_rank(group, 0) if group else 0, group=group),
        "all_to_all": lambda: dist.all_to_all_single(received, full, group=group),
    }
    return operations[name], elements * 4


def reduce_rank_times(seconds_by_rank: Sequence[float]) -> dict[str, Any]:
    """One collective's time from every rank's mean time per call: the mean over ranks, nccl-tests'
    default (`-a 1`), with the slowest rank's beside it (nccl-tests' `-a 3`) and every rank's."""
    if not seconds_by_rank:
        raise ValueError("no per-rank times to reduce")
    return {"time_s": fmean(seconds_by_rank), "time_max_rank_s": max(seconds_by_rank),
            "time_by_rank_s": list(seconds_by_rank)}


def rank_time_reduction(rows: Sequence[dict[str, Any]]) -> str:
    """How a run's `time_s` was reduced over ranks: rows without `time_max_rank_s` were written when the
    slowest rank's time was the only one kept."""
    return MEAN_OVER_RANKS if rows and all("time_max_rank_s" in row for row in rows) else MAX_RANK_ONLY


def rank_main(argv: list[str] | None = None) -> int:
    die_with_launcher()      # as a cell's rank does (harness.rank.parent_death)
    import torch
    import torch.distributed as dist

    from harness.spec import DeviceKind
    from harness.strategies.base import torchrun_context

    parser = argparse.ArgumentParser(prog="python -m harness.commbench")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=0, help="0: the world")
    parser.add_argument("--group-layout", choices=GROUP_LAYOUTS, default="contiguous")
    args = parser.parse_args(argv)

    context = torchrun_context(DeviceKind(args.device))
    if os.environ.get("PARBENCH_THREADS_PER_RANK"):
        torch.set_num_threads(int(os.environ["PARBENCH_THREADS_PER_RANK"]))

    def synchronize() -> None:
        if context.device.type == "cuda":
            torch.cuda.synchronize(context.device)

    group, members = None, context.world_size
    if args.group_size and args.group_size != context.world_size:
        # Every rank creates every group (torch.distributed.new_group's contract), then uses its own.
        for ranks in groups_of(context.world_size, args.group_size, args.group_layout):
            created = dist.new_group(ranks)
            if context.rank in ranks:
                group, members = created, len(ranks)
    rows = []
    for name in args.collectives.split(","):
        for requested in sizes_between(args.min_bytes, args.max_bytes):
            operation, size = _operation(name, requested, members, context.device, group)
            for _ in range(args.warmup):
                operation()
            synchronize()
            dist.barrier()
            began = time.perf_counter()
            for _ in range(args.iters):
                operation()
            synchronize()
            seconds = (time.perf_counter() - began) / args.iters
            # On the rank's device: NCCL has no CPU tensors.
            mine = torch.tensor([seconds], dtype=torch.float64, device=context.device)
            everyone = [torch.empty_like(mine) for _ in range(context.world_size)]
            dist.all_gather(everyone, mine)
            rows.append({"collective": name, "size_bytes": size,
                         **reduce_rank_times([float(t.item()) for t in everyone])})
    if context.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RESULTS_FILE).write_text(json.dumps({
            "world_size": context.world_size, "backend": context.backend, "rows": rows, "group_size": members,
            "group_stride": group_stride(context.world_size, members, args.group_layout),
            "threads_per_rank": torch.get_num_threads()}))
    dist.destroy_process_group()
    return 0


class BenchmarkFailed(RuntimeError):
    """The benchmark's ranks ended without results; the message says why and where the log is."""


def run(world_size: int, device: str, collectives: Sequence[str], min_bytes: int, max_bytes: int, warmup: int,
        iters: int, out: Path, timeout_s: float, emulated=None, group_size: int = 0,
        group_layout: str = "contiguous") -> list[dict[str, Any]]:
    """Launch the benchmark with torchrun, like a cell, and append its row (with bandwidths) to `out`. With
    `emulated` (a harness.emulate network), one torchrun per node, the ranks spread over every node; with
    `group_size`, concurrent groups of that many ranks (module docstring)."""
    from harness.environment import capture_environment
    from harness.launch.interrupt import Interrupted
    from harness.launch.plan import CELL_TOKEN_ENV, LaunchPlan
    from harness.launch.processes import run_processes, shown_command
    from harness.record import COMMBENCH_KIND, append_line
    from harness.spec import Status

    run_dir = out.with_name(out.stem + "-cells") / f"commbench-ws{world_size}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    program = ["-m", "harness.commbench", "--out", str(run_dir), "--device", device,
               "--collectives", ",".join(collectives), "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes),
               "--warmup", str(warmup), "--iters", str(iters), "--group-size", str(group_size),
               "--group-layout", group_layout]
    # One thread per rank, as cells run (harness.launch.plan.threads_per_rank), unless the user set it.
    threads = os.environ.get("OMP_NUM_THREADS") or "1"
    extra_env = {CELL_TOKEN_ENV: uuid.uuid4().hex, "PARBENCH_THREADS_PER_RANK": threads, "OMP_NUM_THREADS": threads}
    plan = _launch_plan(world_size, program, extra_env, emulated)
    environment = capture_environment(freeze_dir=out.parent)      # before the launch: an interrupted one's row too
    if emulated is not None:
        environment["emulated_network"] = emulated.record()
    began = time.monotonic()
    try:
        returncode, timed_out, wall = run_processes(plan, extra_env, run_dir / "log.txt", timeout_s)
    except Interrupted as stop:      # its processes are stopped by now (harness.launch.processes): record why
        append_line(out, {"kind": COMMBENCH_KIND, "status": Status.INTERRUPTED.value,
                          "message": f"{stop.name} arrived {time.monotonic() - began:.0f} s into the benchmark: its "
                                     f"processes were stopped, and the benchmark with it; see {run_dir / 'log.txt'}",
                          "world_size": world_size, "group_size": group_size or world_size, "device": device,
                          "collectives": list(collectives), "min_bytes": min_bytes, "max_bytes": max_bytes,
                          "warmup": warmup, "iters": iters, "rows": [],
                          "wall_time_s": round(time.monotonic() - began, 3),
                          "launch_command": shown_command(list(plan.commands[0]), extra_env),
                          "environment": environment})
        stop.recorded.append(f"the collective benchmark at world size {world_size} -> {out}")
        raise
    results_path = run_dir / RESULTS_FILE
    if timed_out or returncode != 0 or not results_path.exists():
        why = f"no result within {timeout_s:g} s" if timed_out else f"launcher exited {returncode}"
        raise BenchmarkFailed(f"collective benchmark failed ({why}); see {run_dir / 'log.txt'}")
    measured = json.loads(results_path.read_text())
    members = int(measured.get("group_size") or measured["world_size"])
    rows = with_bandwidth(measured["rows"], members)
    append_line(out, {"kind": COMMBENCH_KIND, "world_size": measured["world_size"], "backend": measured["backend"],
                      "group_size": members, "group_stride": measured["group_stride"],
                      "threads_per_rank": measured["threads_per_rank"], "device": device, "warmup": warmup, "iters": iters,
                      "rank_time_reduction": rank_time_reduction(rows), "rows": rows,
                      "wall_time_s": round(wall, 3), "launch_command": shown_command(list(plan.commands[0]), extra_env),
                      "environment": environment})
    return rows


def _launch_plan(world_size: int, program: list[str], extra_env: dict[str, str], emulated) -> "LaunchPlan":
    """torchrun here, or one torchrun per node of an emulated cluster (ranks spread evenly over its nodes)."""
    from harness.launch.launcher.torchrun import torchrun_argv
    from harness.launch.placement.base import PORT_PROBE, free_port
    from harness.launch.placement.hostfile import node_script
    from harness.launch.plan import LaunchPlan, forwarded_environment

    if emulated is None:
        command = torchrun_argv(1, world_size, f"127.0.0.1:{free_port()}", program)
        return LaunchPlan(commands=(tuple(command),), targets=("this host",))
    nodes = emulated.nodes_for(world_size)
    first = emulated.addresses[0]
    # The port is probed in the first node's namespace, where the rendezvous is served.
    probe = subprocess.run(emulated.shell(0, f"{sys.executable} -c {shlex.quote(PORT_PROBE)}"), capture_output=True,
                           text=True, check=True)
    port = probe.stdout.split()[-1]
    environment = forwarded_environment(extra_env)
    commands = tuple(tuple(emulated.shell(node, node_script(torchrun_argv(
        nodes, world_size // nodes, f"{first}:{port}", program, local_addr=emulated.addresses[node],
        serves_rendezvous=node == 0), environment))) for node in range(nodes))
    return LaunchPlan(commands=commands, targets=tuple(f"node {n} ({emulated.namespaces[n]})" for n in range(nodes)))


def with_bandwidth(rows: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """Rows with algbw and busbw from `time_s` (the mean over ranks; the slowest rank's in rows written
    before), and busbw from the slowest rank's time where the row has it."""
    from harness.derive.comm import bus_bandwidth

    out = []
    for row in rows:
        algbw, busbw = bus_bandwidth(row["collective"], row["size_bytes"], row["time_s"], world_size)
        figures = {"algbw_bytes_per_s": algbw, "busbw_bytes_per_s": busbw}
        if "time_max_rank_s" in row:
            figures["busbw_max_rank_bytes_per_s"] = bus_bandwidth(row["collective"], row["size_bytes"],
                                                                  row["time_max_rank_s"], world_size)[1]
        out.append({**row, **figures})
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    """time, algbw and busbw from the mean over ranks; the slowest rank's time beside them."""
    header = (f"{'collective':<15} {'size':>12} {'time us':>11} {'max-rank us':>12} {'algbw GB/s':>11} "
              f"{'busbw GB/s':>11}")
    lines = [header, "-" * len(header)]
    for row in rows:
        slowest = f"{row['time_max_rank_s'] * 1e6:>12.1f}" if "time_max_rank_s" in row else f"{'-':>12}"
        lines.append(f"{row['collective']:<15} {row['size_bytes']:>12} {row['time_s'] * 1e6:>11.1f} {slowest} "
                     f"{row['algbw_bytes_per_s'] / 1e9:>11.3f} {row['busbw_bytes_per_s'] / 1e9:>11.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    exit_without_teardown(rank_main())
