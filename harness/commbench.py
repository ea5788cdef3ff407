"""Collective microbenchmark: time, algbw and busbw per collective and size, as nccl-tests defines them.

    python -m harness comm --world-size 2                       # launched by torchrun like any cell
    torchrun --nproc-per-node 2 -m harness.commbench --out DIR ...   # what that runs in each rank

Each rank allocates fp32 buffers of each size (doubling from --min-bytes to --max-bytes, rounded up to a
whole number of elements per rank), runs `warmup` untimed calls, then times `iters` back-to-back calls
between two device synchronisations, as nccl-tests does, and reports the mean time per call. The slowest
rank's time is the collective's time. Sizes are nccl-tests' "size": the all-reduced or broadcast tensor,
the whole gathered output (all_gather), the whole scattered input (reduce_scatter), the send buffer
(all_to_all). algbw = size / time; busbw = algbw x factor (harness.comm_model.BUSBW_FACTORS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
RESULTS_FILE = "commbench.json"


def sizes_between(min_bytes: int, max_bytes: int) -> list[int]:
    """Doubling sizes from min_bytes up to max_bytes, both included."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise ValueError(f"sizes must satisfy 4 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


def _operation(name: str, size_bytes: int, ranks: int, device) -> tuple[Callable[[], Any], int]:
    """A closure issuing one collective over fresh buffers, and the exact size it moves in bytes."""
    import torch
    import torch.distributed as dist

    elements = max(ranks, -(-size_bytes // 4))
    elements += (-elements) % ranks                          # divisible into equal per-rank shards
    full = torch.ones(elements, dtype=torch.float32, device=device)
    shard = torch.ones(elements // ranks, dtype=torch.float32, device=device)
    operations = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
    }
    return operations[name], elements * 4


def rank_main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)

    context = torchrun_context(DeviceKind(args.device))
    if os.environ.get("PARBENCH_THREADS_PER_RANK"):
        torch.set_num_threads(int(os.environ["PARBENCH_THREADS_PER_RANK"]))

    def synchronize() -> None:
        if context.device.type == "cuda":
            torch.cuda.synchronize(context.device)

    rows = []
    for name in args.collectives.split(","):
        for requested in sizes_between(args.min_bytes, args.max_bytes):
            operation, size = _operation(name, requested, context.world_size, context.device)
            for _ in range(args.warmup):
                operation()
            synchronize()
            dist.barrier()
            began = time.perf_counter()
            for _ in range(args.iters):
                operation()
            synchronize()
            seconds = (time.perf_counter() - began) / args.iters
            slowest = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append({"collective": name, "size_bytes": size, "time_s": float(slowest.item())})
    if context.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RESULTS_FILE).write_text(json.dumps({"world_size": context.world_size,
                                                         "backend": context.backend, "rows": rows}))
    dist.destroy_process_group()
    return 0


class BenchmarkFailed(RuntimeError):
    """The benchmark's ranks ended without results; the message says why and where the log is."""


def run(world_size: int, device: str, collectives: Sequence[str], min_bytes: int, max_bytes: int, warmup: int,
        iters: int, out: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Launch the benchmark with torchrun, like a cell, and append its row (with bandwidths) to `out`."""
    from harness.environment import capture_environment
    from harness.launch import CELL_TOKEN_ENV, Launch, free_port, run_launcher, shown_command, torchrun_command
    from harness.record import COMMBENCH_KIND, append_line

    run_dir = out.with_name(out.stem + "-cells") / f"commbench-ws{world_size}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    program = ["-m", "harness.commbench", "--out", str(run_dir), "--device", device,
               "--collectives", ",".join(collectives), "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes),
               "--warmup", str(warmup), "--iters", str(iters)]
    threads = str(max(1, (os.cpu_count() or 1) // world_size))
    extra_env = {CELL_TOKEN_ENV: uuid.uuid4().hex, "PARBENCH_THREADS_PER_RANK": threads, "OMP_NUM_THREADS": threads}
    command = torchrun_command(1, world_size, f"127.0.0.1:{free_port()}", program)
    returncode, timed_out, wall = run_launcher(Launch(commands=(tuple(command),)), extra_env, run_dir / "log.txt",
                                               timeout_s)
    results_path = run_dir / RESULTS_FILE
    if timed_out or returncode != 0 or not results_path.exists():
        why = f"no result within {timeout_s:g} s" if timed_out else f"launcher exited {returncode}"
        raise BenchmarkFailed(f"collective benchmark failed ({why}); see {run_dir / 'log.txt'}")
    measured = json.loads(results_path.read_text())
    rows = with_bandwidth(measured["rows"], measured["world_size"])
    append_line(out, {"kind": COMMBENCH_KIND, "world_size": measured["world_size"], "backend": measured["backend"],
                      "device": device, "warmup": warmup, "iters": iters, "rows": rows,
                      "wall_time_s": round(wall, 3), "launch_command": shown_command(command, extra_env),
                      "environment": capture_environment(freeze_dir=out.parent)})
    return rows


def with_bandwidth(rows: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    from harness.derive.comm import bus_bandwidth

    out = []
    for row in rows:
        algbw, busbw = bus_bandwidth(row["collective"], row["size_bytes"], row["time_s"], world_size)
        out.append({**row, "algbw_bytes_per_s": algbw, "busbw_bytes_per_s": busbw})
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'collective':<15} {'size':>12} {'time us':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{row['collective']:<15} {row['size_bytes']:>12} {row['time_s'] * 1e6:>11.1f} "
                     f"{row['algbw_bytes_per_s'] / 1e9:>11.3f} {row['busbw_bytes_per_s'] / 1e9:>11.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(rank_main())
