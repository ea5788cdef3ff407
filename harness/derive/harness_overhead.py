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
verdicts say so.

Its interval: the exact distribution-free one for a ratio (Moses; Hollander & Wolfe, Nonparametric Statistical Methods,
the Mann-Whitney test inverted), the set of overheads r for which the two-sided exact Mann-Whitney test of the plain
launches against the bare ones scaled by (1 + r) does not reject at 5% (harness.derive.mann_whitney, the test the
regression gate uses). With the n * m ratios plain_i / bare_j sorted, and c the largest count with P(U <= c) <= 2.5%,
it runs from the (c + 1)-th to the (n m - c)-th, less 1, at confidence 1 - 2 P(U <= c): 5 launches a side give the 3rd
and the 23rd of 25 at 96.8%; 4 a side the 1st and the 16th of 16 at 97.1%; 3 a side none (one ordering in 20 is
already 5%). The verdict reads the interval alone: within OVERHEAD_LIMIT where its upper end is under it, over it
where its lower end is above it, and otherwise inconclusive, saying what more launches would do.

Torch-free.
"""

from __future__ import annotations

import enum
from math import comb
from statistics import fmean, median
from typing import Any, Iterable, Mapping, Sequence

from harness.derive.intervals import median_interval
from harness.derive.mann_whitney import orderings_by_pairs

BARE_STRATEGY = "bare"
OVERHEAD_LIMIT = 0.03
CONFIDENCE = 0.95
# The fewest launches a side whose ratio interval reaches CONFIDENCE (module docstring): 3 a side cannot.
LAUNCHES_FOR_AN_INTERVAL = 4


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
    low, high, confidence = overhead_interval(plain_steps, bare_steps) or (None, None, None)
    figures.update({"harness_overhead_low": low, "harness_overhead_high": high,
                    "harness_overhead_confidence": confidence})
    return figures


def overhead_interval(plain_steps: Sequence[float], bare_steps: Sequence[float],
                      confidence: float = CONFIDENCE) -> tuple[float, float, float] | None:
    """(low, high, its confidence) of the overhead plain / bare - 1 (module docstring: the Mann-Whitney test
    inverted); None where the launches are too few for `confidence`."""
    n, m = len(plain_steps), len(bare_steps)
    if not n or not m:
        return None
    counts, orderings = orderings_by_pairs(n, m), comb(n + m, n)
    below, c = 0, -1            # P(U <= c) * orderings, and the largest c with P(U <= c) <= (1 - confidence) / 2
    for u, count in enumerate(counts):
        if (below + count) / orderings > (1 - confidence) / 2:
            break
        below, c = below + count, u
    if c < 0:
        return None
    ratios = sorted(p / b for p in plain_steps for b in bare_steps)
    return ratios[c] - 1, ratios[n * m - c - 1] - 1, 1 - 2 * below / orderings


class Verdict(enum.Enum):
    WITHIN = "within"
    OVER = "over"
    INCONCLUSIVE = "inconclusive"


def overhead_verdict(figures: Mapping[str, Any]) -> tuple[Verdict, str]:
    """What the interval shows of the overhead against OVERHEAD_LIMIT, and a clause saying it (module docstring)."""
    low, high, confidence = (figures.get(f"harness_overhead_{end}") for end in ("low", "high", "confidence"))
    if not _present(low):
        return Verdict.INCONCLUSIVE, (f"inconclusive: {int(figures.get('harness_plain_launches') or 0)} plain and "
                                      f"{int(figures.get('harness_bare_launches') or 0)} bare launches give no "
                                      f"{CONFIDENCE:.0%} interval (it needs {LAUNCHES_FOR_AN_INTERVAL} a side: "
                                      "--repeats 5)")
    interval = f"{float(confidence):.1%} interval {float(low):+.1%} to {float(high):+.1%}"
    if float(high) < OVERHEAD_LIMIT:
        return Verdict.WITHIN, f"within the {OVERHEAD_LIMIT:.0%} limit ({interval})"
    if float(low) > OVERHEAD_LIMIT:
        return Verdict.OVER, (f"OVER the {OVERHEAD_LIMIT:.0%} limit ({interval}): every step time here carries "
                              "that much of the harness's own cost")
    return Verdict.INCONCLUSIVE, (f"inconclusive: its {interval} reaches both sides of the {OVERHEAD_LIMIT:.0%} "
                                  "limit (more launches narrow it: --repeats)")


def _present(value: Any) -> bool:
    return value is not None and value == value         # NaN: a cell table's missing value
