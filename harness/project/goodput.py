"""A projected job's checkpoint time and goodput: the save time from the checkpoint's bytes and the target's
storage, the checkpoint interval and the share of wall time left for useful work from the GPUs' failure rate.

    python -m harness project --params 1.5B --compute-ms 120 --cluster dgx-h100-ib --storage-GBps 100 \\
        --mtbf-hours 50000

At N GPUs (docs/clusters.md, "Checkpoint time and goodput"):

    C       = checkpoint bytes / (G x 1e9 B/s)      the save: the whole checkpoint through the storage's
                                                    aggregate write bandwidth G GB/s, the save blocking the step
    M       = H x 3600 s / N                        the job's MTBF: N GPUs failing independently, each with a
                                                    mean time between failures of H hours
    tau     = sqrt(2 C M)                           the interval between saves that minimises the waste
                                                    (Young 1974; Daly 2006's first-order term)
    waste   = C / tau + tau / (2 M) + R / M         first order: a save every tau, half an interval of work
                                                    redone after each failure, and a restart of R seconds
    goodput = max(0, 1 - waste)                     useful, non-repeated work over wall time

Young, J. W. (1974), "A first order approximation to the optimum checkpoint interval", Communications of the
ACM 17(9); Daly, J. T. (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22(3), whose first-order estimate is Young's. The first-order model assumes
at most one failure in an interval (tau << M); where tau >= M (2 C >= M) the job expects a failure before
each save lands and the model says nothing: the point is marked "no progress" instead of given a goodput.

The checkpoint's bytes come from the basis: a measured save where its rows hold one (harness.derive.checkpoint),
else the strategy's own figure (`Strategy.checkpoint_contents`). Torch-free; this module prices, it does not
project (harness.project.projection attaches a `CheckpointCost` to each point).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from harness.spec import SpecError

SECONDS_PER_HOUR = 3600.0
BYTES_PER_GB = 1e9          # storage bandwidth in GB/s of 1e9 bytes, as vendors give it
NO_PROGRESS = "no progress"

ASSUMPTION = ("save C = checkpoint bytes / storage GB/s, the save blocking the step; job MTBF M = per-GPU MTBF / N "
              "(independent failures); interval tau = sqrt(2 C M) (Young 1974; Daly 2006, first order); waste = "
              "C / tau + tau / (2 M) + R / M; goodput = max(0, 1 - waste), no progress where tau >= M")


def _positive_finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointTarget:
    """The target's storage and failure rate. Each check is a one-line SpecError naming the flag."""

    storage_GBps: float                     # aggregate write bandwidth, GB/s (1e9 B/s)
    mtbf_hours_per_gpu: float | None = None  # one GPU's mean time between failures, hours
    restart_s: float = 0.0                  # seconds from a failure until training runs again

    def __post_init__(self) -> None:
        if not _positive_finite(self.storage_GBps):
            raise SpecError(f"--storage-GBps must be a positive, finite GB/s (1e9 bytes/s), got {self.storage_GBps!r}")
        if self.mtbf_hours_per_gpu is not None and not _positive_finite(self.mtbf_hours_per_gpu):
            raise SpecError(f"--mtbf-hours must be a positive, finite number of hours (one GPU's mean time between "
                            f"failures), got {self.mtbf_hours_per_gpu!r}")
        if isinstance(self.restart_s, bool) or not isinstance(self.restart_s, (int, float)) or not (
                math.isfinite(self.restart_s) and self.restart_s >= 0):
            raise SpecError(f"--restart-s must be a finite number of seconds >= 0, got {self.restart_s!r}")
        if self.restart_s and self.mtbf_hours_per_gpu is None:
            raise SpecError("--restart-s is paid once per failure: give --mtbf-hours with it")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointCost:
    """One projected point's checkpoint figures (the module docstring's formulas)."""

    bytes: float                        # one checkpoint, held once over the job
    bytes_per_parameter: float
    parameters: int
    bytes_source: str                   # where bytes_per_parameter comes from
    storage_GBps: float
    save_s: float                       # C
    mtbf_hours_per_gpu: float | None = None
    job_mtbf_s: float | None = None     # M
    restart_s: float = 0.0              # R
    interval_s: float | None = None     # tau
    waste_fraction: float | None = None  # None where no progress (or no MTBF given)
    goodput: float | None = None        # None where no progress (or no MTBF given)
    no_progress: bool = False           # tau >= M: the first-order model does not hold


def save_seconds(checkpoint_bytes: float, storage_GBps: float) -> float:
    """C = bytes / (G x 1e9 B/s)."""
    return checkpoint_bytes / (storage_GBps * BYTES_PER_GB)


def job_mtbf_seconds(mtbf_hours_per_gpu: float, gpus: int) -> float:
    """M = H x 3600 / N: N independent GPUs, each failing at 1 / H an hour, fail at N / H an hour together."""
    return mtbf_hours_per_gpu * SECONDS_PER_HOUR / gpus


def young_daly_interval_s(save_s: float, job_mtbf_s: float) -> float:
    """tau = sqrt(2 C M) (Young 1974; Daly 2006's first-order estimate)."""
    return math.sqrt(2.0 * save_s * job_mtbf_s)


def first_order_waste(save_s: float, interval_s: float, job_mtbf_s: float, restart_s: float = 0.0) -> float:
    """C / tau (saving) + tau / (2 M) (half an interval redone per failure) + R / M (restarting per failure)."""
    return save_s / interval_s + interval_s / (2.0 * job_mtbf_s) + restart_s / job_mtbf_s


def checkpoint_cost(*, bytes_per_parameter: float, parameters: int, bytes_source: str, world_size: int,
                    target: CheckpointTarget) -> CheckpointCost:
    """The figures of a job of `parameters` at `world_size` GPUs on `target`."""
    checkpoint_bytes = bytes_per_parameter * parameters
    save = save_seconds(checkpoint_bytes, target.storage_GBps)
    cost = CheckpointCost(bytes=checkpoint_bytes, bytes_per_parameter=bytes_per_parameter, parameters=parameters,
                          bytes_source=bytes_source, storage_GBps=target.storage_GBps, save_s=save,
                          restart_s=target.restart_s)
    if target.mtbf_hours_per_gpu is None:
        return cost
    mtbf = job_mtbf_seconds(target.mtbf_hours_per_gpu, world_size)
    interval = young_daly_interval_s(save, mtbf)
    figures: dict[str, Any] = dict(mtbf_hours_per_gpu=target.mtbf_hours_per_gpu, job_mtbf_s=mtbf, interval_s=interval)
    if interval >= mtbf:
        return replace(cost, **figures, no_progress=True)
    waste = first_order_waste(save, interval, mtbf, target.restart_s)
    return replace(cost, **figures, waste_fraction=waste, goodput=max(0.0, 1.0 - waste))


# ---- printing and recording ------------------------------------------------------------------------------


def duration_text(seconds: float) -> str:
    """Seconds below 2 minutes, minutes below 2 hours, hours above."""
    if seconds < 120:
        return f"{_figure(seconds)} s"
    if seconds < 2 * SECONDS_PER_HOUR:
        return f"{_figure(seconds / 60)} min"
    return f"{_figure(seconds / SECONDS_PER_HOUR)} h"


def _figure(value: float) -> str:
    """Three significant figures, whole numbers from 100 on (6,250 rather than 6.25e+03)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def goodput_text(cost: CheckpointCost) -> str:
    if cost.no_progress:
        return f"{NO_PROGRESS} (tau >= M: the first-order model does not hold)"
    return f"{cost.goodput:.2%}"


def checkpoint_lines(costs: Sequence[tuple[int, CheckpointCost]]) -> list[str]:
    """The table's checkpoint section of one basis: (world size, cost) pairs, a line per world size."""
    first = costs[0][1]
    lines = [f"checkpoint: {first.bytes / BYTES_PER_GB:.4g} GB a save = {first.parameters:,} parameters x "
             f"{first.bytes_per_parameter:.4g} B, written at {first.storage_GBps:g} GB/s: save C = "
             f"{duration_text(first.save_s)}", f"  bytes a parameter: {first.bytes_source}"]
    if first.mtbf_hours_per_gpu is None:
        return lines
    lines.append(f"failures: MTBF {first.mtbf_hours_per_gpu:g} h per GPU, GPUs failing independently: job MTBF M = "
                 f"{first.mtbf_hours_per_gpu:g} h / N; restart R = {first.restart_s:g} s; interval tau = sqrt(2 C M) "
                 "(Young 1974, Daly 2006); waste = C/tau + tau/(2M) + R/M")
    header = f"{'N':>7} {'job MTBF':>10} {'save C':>9} {'interval tau':>13} {'waste':>8}  goodput"
    lines += [header, "-" * len(header)]
    seen = set()
    for n, cost in costs:
        if n in seen:       # weak and strong scaling at one N: the same model and GPUs, the same figures
            continue
        seen.add(n)
        waste = "-" if cost.waste_fraction is None else f"{cost.waste_fraction:.3%}"
        lines.append(f"{n:>7} {duration_text(cost.job_mtbf_s):>10} {duration_text(cost.save_s):>9} "
                     f"{duration_text(cost.interval_s):>13} {waste:>8}  {goodput_text(cost)}")
    return lines


def checkpoint_fields(cost: CheckpointCost) -> dict[str, Any]:
    """A projected row's fields for `cost`, units in their names."""
    return {"checkpoint_bytes": cost.bytes, "checkpoint_bytes_per_parameter": cost.bytes_per_parameter,
            "checkpoint_bytes_source": cost.bytes_source, "storage_write_GBps": cost.storage_GBps,
            "checkpoint_save_s": cost.save_s, "mtbf_hours_per_gpu": cost.mtbf_hours_per_gpu,
            "job_mtbf_s": cost.job_mtbf_s, "restart_s": cost.restart_s, "checkpoint_interval_s": cost.interval_s,
            "checkpoint_waste_fraction": cost.waste_fraction, "goodput_fraction": cost.goodput,
            "goodput_no_progress": cost.no_progress}
