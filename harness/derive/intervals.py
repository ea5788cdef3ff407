"""The interval shown around a median across launches, labelled with what it is.

    python -m harness run --matrix smoke --repeats 3     # its summary's interval column comes from here

Launches are the unit of replication (harness/derive/gate.py says why), so an interval is over one value
per launch. What an interval of N launches can honestly claim depends on N:
- 1 launch: no interval.
- 2 to 4 launches: the range [min, max], labelled "range of N launches". For independent draws from a
  continuous distribution, the median lies below all N values with probability 2^-N and above all with
  2^-N (order statistics; David & Nagaraja 2003, sec. 7.1), so the range covers it with probability
  1 - 2^(1-N): 50% at 2, 75% at 3, 87.5% at 4. It is not a 95% interval and is never called one.
- 5 launches or more: the percentile bootstrap interval of the median (Efron & Tibshirani 1993, ch. 13),
  labelled "95% CI (bootstrap, N launches)". At exactly 5 it equals the range (each end of the range is
  the bootstrap median with probability P(Binomial(5, 1/5) >= 3) = 5.8% > 2.5%), whose coverage is
  1 - 2^-4 = 93.75%: as close to 95% as 5 values allow. The percentile bootstrap of a median is known to
  under-cover at small N, so the label names the method and the count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np

BOOTSTRAP_FROM_LAUNCHES = 5


class IntervalKind(enum.StrEnum):
    RANGE = "range"
    BOOTSTRAP = "bootstrap"


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    kind: IntervalKind
    launches: int
    confidence: float | None = None    # nominal, bootstrap only

    @property
    def label(self) -> str:
        if self.kind is IntervalKind.RANGE:
            return f"range of {self.launches} launches"
        return f"{self.confidence:.0%} CI (bootstrap, {self.launches} launches)"


def median_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = 10_000,
                    seed: int = 0) -> Interval | None:
    """The interval around the median of per-launch `values` that their number supports (module
    docstring); None for a single launch."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("an interval needs at least one value")
    if data.size == 1:
        return None
    if data.size < BOOTSTRAP_FROM_LAUNCHES:
        return Interval(float(data.min()), float(data.max()), IntervalKind.RANGE, int(data.size))
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(data, size=(resamples, data.size), replace=True), axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(medians, [tail, 1.0 - tail])
    return Interval(float(low), float(high), IntervalKind.BOOTSTRAP, int(data.size), confidence)
