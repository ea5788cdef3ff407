"""Summary statistics shared by the worker (per launch) and the reports (across launches).

Quantiles use numpy's default (linear interpolation, type 7 of Hyndman & Fan), the same as pandas.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, interquartile range, 90th percentile, mean, min and max of a sample."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("summarize needs at least one value")
    q25, q50, q75, q90 = np.percentile(data, [25, 50, 75, 90])
    return {"median": float(q50), "iqr": float(q75 - q25), "p90": float(q90), "mean": float(data.mean()),
            "min": float(data.min()), "max": float(data.max())}


def bootstrap_median_ci(values: Sequence[float], confidence: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the median (Efron & Tibshirani 1993, ch. 13)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("bootstrap needs at least one value")
    if data.size == 1:
        return float(data[0]), float(data[0])
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(data, size=(resamples, data.size), replace=True), axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(medians, [alpha, 1.0 - alpha])
    return float(low), float(high)
