"""Summary statistics of one launch's steps (the worker). Intervals across launches: harness/derive/intervals.py.

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

