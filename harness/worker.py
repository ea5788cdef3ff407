"""The per-rank program every launcher starts: build, wrap, warm up, time, report.

    torchrun --nproc-per-node 2 -m harness.worker --spec CELL/spec.json --out CELL

Every rank builds the workload from the spec's seed (identical weights everywhere), lets the strategy wrap
it, runs the warm-up steps and then the timed steps, each over this rank's slice of a deterministic
global batch. Data for a step is made before its clock starts, and ranks meet at a barrier there, so a
step's time is training alone. After the last step the ranks exchange their losses and times (outside
any timed region) and rank 0 writes `measurements.json` into the cell folder. A rank that fails writes
`rank<N>.error.json` there instead, with its status (`oom` or `failed`), and exits non-zero; the harness
turns either file into the cell's row.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from harness.spec import RunSpec, Status
from harness.stats import summarize
from harness.strategies import Strategy, Trainer, get_strategy
from harness.strategies.base import RankContext
from harness.timing import StepTimer
from workloads import Workload, count_parameters, get_workload

MEASUREMENTS_FILE = "measurements.json"
ERROR_FILE = "rank{rank}.error.json"
THREADS_ENV = "PARBENCH_THREADS_PER_RANK"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, type=Path, help="the cell's spec.json")
    parser.add_argument("--out", required=True, type=Path, help="the cell's folder for measurements.json")
    args = parser.parse_args(argv)

    spec = RunSpec.from_dict(json.loads(args.spec.read_text()))
    strategy = get_strategy(spec.strategy)
    if os.environ.get(THREADS_ENV):
        torch.set_num_threads(int(os.environ[THREADS_ENV]))
    rank = int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", 0)))
    try:
        context = strategy.start(spec)
        rank = context.rank
        measurements = run_cell(spec, strategy, context)
        if context.rank == 0:
            _write_json(args.out / MEASUREMENTS_FILE, measurements)
        return 0
    except BaseException as error:  # every failure becomes a status the harness can record
        status = Status.OOM if _is_out_of_memory(error) else Status.FAILED
        message = f"rank {rank}: {type(error).__name__}: {error}".splitlines()[0][:500]
        _write_json(args.out / ERROR_FILE.format(rank=rank),
                    {"status": status.value, "message": message, "traceback": traceback.format_exc()})
        traceback.print_exc()
        return 3 if status is Status.OOM else 1


def run_cell(spec: RunSpec, strategy: Strategy, context: RankContext) -> dict[str, Any]:
    workload = get_workload(spec.workload)
    layout = strategy.layout(spec)
    torch.manual_seed(spec.seed)
    layers = workload.build_layers()                  # on CPU from the seed: identical on every rank
    parameters = count_parameters(torch.nn.Sequential(*layers))
    if context.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(context.device)
    trainer = strategy.wrap(spec, context, workload, layers)

    timer = StepTimer(context.device)
    losses: list[torch.Tensor] = []
    for step in range(spec.warmup_steps + spec.timed_steps):
        micro_batches = [workload.batch(spec.seed, step, strategy.sample_indices(spec, context, index),
                                        context.device)
                         for index in range(layout.micro_batches)]
        trainer.barrier()
        with timer.measure(record=step >= spec.warmup_steps):
            losses.append(trainer.train_step(micro_batches))

    global_losses = trainer.global_losses(torch.stack(losses).float()).tolist()
    by_rank = trainer.gather({"times": timer.seconds, "wall": timer.wall_seconds,
                              "memory": _memory_figures(context), "host": socket.gethostname()})
    measurements = _measurements(spec, workload, layout, context, trainer, parameters, global_losses, by_rank)
    trainer.close()
    return measurements


def _measurements(spec: RunSpec, workload: Workload, layout, context: RankContext, trainer: Trainer,
                  parameters: int, losses: list[float], by_rank: list[dict[str, Any]]) -> dict[str, Any]:
    times_by_rank = [r["times"] for r in by_rank]
    memory_by_rank = [r["memory"] for r in by_rank]
    # A synchronous step ends when its slowest rank ends.
    step_time = [max(per_rank) for per_rank in zip(*times_by_rank)]
    step_stats = summarize(step_time)
    devices = spec.world_size
    samples_per_s = spec.global_batch / step_stats["median"]
    tokens = workload.tokens_per_sample
    peak_rss = [m[0] for m in memory_by_rank]
    figures: dict[str, Any] = {
        "loss_per_step": losses,
        "step_time_s": step_time,
        "step_time_s_by_rank": times_by_rank,
        "step_wall_time_s_by_rank": [r["wall"] for r in by_rank],
        "step_time_median_s": step_stats["median"],
        "step_time_iqr_s": step_stats["iqr"],
        "step_time_p90_s": step_stats["p90"],
        "samples_per_s": samples_per_s,
        "samples_per_s_per_device": samples_per_s / devices,
        "tokens_per_s": samples_per_s * tokens if tokens else None,
        "tokens_per_s_per_device": samples_per_s * tokens / devices if tokens else None,
        "peak_rss_bytes_by_rank": peak_rss,
        "peak_rss_bytes_max": max(peak_rss),
        "peak_rss_bytes_min": min(peak_rss),
        "parameters": parameters,
        "train_flops_per_sample": workload.train_flops_per_sample,
        "data_parallel": layout.data_parallel,
        "pipeline_stages": layout.pipeline_stages,
        "micro_batches_per_step": layout.micro_batches,
        "precision_recipe": trainer.precision_recipe.value,
        "strategy_config": trainer.config,
        "backend": context.backend,
        "shared_device": context.shared_device,
        "device_name": _device_name(context.device),
        "threads_per_rank": torch.get_num_threads(),
        "hosts": sorted({r["host"] for r in by_rank}),
    }
    if context.device.type == "cuda":
        figures["peak_allocated_bytes_by_rank"] = [m[1] for m in memory_by_rank]
        figures["peak_reserved_bytes_by_rank"] = [m[2] for m in memory_by_rank]
        figures["peak_allocated_bytes_max"] = max(figures["peak_allocated_bytes_by_rank"])
        figures["peak_allocated_bytes_min"] = min(figures["peak_allocated_bytes_by_rank"])
        figures["peak_reserved_bytes_max"] = max(figures["peak_reserved_bytes_by_rank"])
    return figures


def _memory_figures(context: RankContext) -> list[float]:
    """[peak RSS, peak CUDA allocated, peak CUDA reserved] of this process, in bytes."""
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    if context.device.type != "cuda":
        return [float(peak_rss), 0.0, 0.0]
    return [float(peak_rss), float(torch.cuda.max_memory_allocated(context.device)),
            float(torch.cuda.max_memory_reserved(context.device))]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return "out of memory" in text.lower() or "CUDA_ERROR_OUT_OF_MEMORY" in text


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)  # readers never see half a file


if __name__ == "__main__":
    sys.exit(main())
