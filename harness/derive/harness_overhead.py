"""The harness's own cost: how much longer the plain loop's step is under parbench's measurement than the same loop
timed whole, the `bare` reference (harness.strategies.bare, harness.rank.bare_loop).

    python -m harness report results/full-*.jsonl --out report/     # "harness overhead" in the cells and verdicts

    harness overhead = plain step / bare step - 1

- plain step: the mean of a plain launch's timed steps, each timed alone (`step_time_s`: the device synchronised
  before and after, the barrier before it, the collective counter's and the census's contexts around it);
- bare step: a bare launch's whole timed loop over its steps (`loop_time_s` / `loop_steps`: one clock around all of
  them, one synchronisation at the end, nothing of the harness's in between).
Means on both sides, since the bare loop has no step of its own to take a median of; across a cell's launches the
median of each side. What it bounds: what the harness adds inside the steps it times (synchronisations that drain
the device's queue, the probes' hooks), on the figures every strategy's step time is measured with. What it does not
see: the work between steps (data, probes), which no timed figure holds, and a strategy's own instrumentation (the
counter's wrappers around its collectives), which the plain loop does not run. Above OVERHEAD_LIMIT the report's
verdicts say so, and whether that lies beyond the launches' spread (each side's interval, harness.derive.intervals).

Torch-free.
"""

from __future__ import annotations

from statistics import fmean, median
from typing import Any, Iterable, Mapping

from harness.derive.intervals import median_interval

BARE_STRATEGY = "bare"
OVERHEAD_LIMIT = 0.03


def bare_step_s(measurements: Mapping[str, Any]) -> float | None:
    """A bare launch's mean step: its timed loop over its steps (None where the row holds no loop)."""
    loop, steps = measurements.get("loop_time_s"), measurements.get("loop_steps")
    return float(loop) / int(steps) if loop is not None and steps else None


def mean_step_s(measurements: Mapping[str, Any]) -> float | None:
    """A launch's mean timed step: the bare loop's loop over its steps, any other's mean of `step_time_s`."""
    bare = bare_step_s(measurements)
    if bare is not None:
        return bare
    times = measurements.get("step_time_s") or []
    return fmean(float(t) for t in times) if times else None


def harness_overhead(plain: Iterable[Mapping[str, Any]], bare: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """From the ok launches of a plain cell and of the bare cell of the same work: each side's median mean step, and
    the overhead; Nones where a side has no launch with a step."""
    plain_steps = [s for s in (mean_step_s(row["measurements"]) for row in plain) if s is not None]
    bare_steps = [s for s in (bare_step_s(row["measurements"]) for row in bare) if s is not None]
    if not plain_steps or not bare_steps:
        return {"harness_overhead_share": None, "harness_plain_step_s": None, "harness_bare_step_s": None}
    plain_step, bare_step = median(plain_steps), median(bare_steps)
    figures = {"harness_overhead_share": plain_step / bare_step - 1, "harness_plain_step_s": plain_step,
               "harness_bare_step_s": bare_step, "harness_plain_launches": len(plain_steps),
               "harness_bare_launches": len(bare_steps)}
    for side, steps in (("plain", plain_steps), ("bare", bare_steps)):
        interval = median_interval(steps)
        figures[f"harness_{side}_step_low_s"] = interval.low if interval else None
        figures[f"harness_{side}_step_high_s"] = interval.high if interval else None
    return figures


def beyond_spread(figures: Mapping[str, Any]) -> bool | None:
    """Whether the overhead is over OVERHEAD_LIMIT beyond the launches' spread: the plain loop's interval lies more
    than the limit above the bare loop's (low end over high end); None where a side has a single launch and so no
    spread."""
    plain_low, bare_high = figures.get("harness_plain_step_low_s"), figures.get("harness_bare_step_high_s")
    if plain_low is None or bare_high is None or plain_low != plain_low or bare_high != bare_high:
        return None
    return plain_low / bare_high - 1 > OVERHEAD_LIMIT
