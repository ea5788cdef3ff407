"""Each compared step's loss deviation from the reference, in units of its parity tolerance: what
harness.derive.parity judged, step by step, for the report's loss plot.

    python -c "from harness.derive.loss_deviation import deviations_in_tolerances as d; from harness.derive.rows
import load_rows; rows = load_rows(['results/reference/ci-cpu/full.jsonl']); print(d(rows[1], rows[0]))"

Parity (harness.derive.parity `deviations`) compares the losses of steps 0 .. PARITY_STEPS - 1:

    step 0:   |l_0 - r_0| / |r_0|                                    against TOLERANCE[...][FIRST_LOSS]
    step k:   |l_k - r_k| / max over j < PARITY_STEPS - 1 of |r_(j+1) - r_j|   against TOLERANCE[...][LATER_LOSSES]

and judges the largest of the later steps. Here each step keeps its own deviation, divided by its
tolerance, so 1 is the tolerance at every step and a row matches on its losses while every point is at
most 1. Later steps are not judged (Adam turns rounding-level differences into whole steps of single
weights, so trajectories drift apart slowly even when both are right): none is given.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from harness.derive.parity import PARITY_STEPS, REFERENCE_STRATEGY, TOLERANCE, Quantity, arithmetic, reference_key


def loss_deviations(row: Mapping[str, Any], reference: Mapping[str, Any]) -> list[float]:
    """Each compared step's deviation as parity measures it (module docstring); inf where not finite."""
    losses, expected = row["measurements"]["loss_per_step"], reference["measurements"]["loss_per_step"]
    count = min(PARITY_STEPS, len(losses), len(expected))
    if count == 0:
        return []
    found = [_ratio(abs(losses[0] - expected[0]), abs(expected[0]))]
    if count >= 2:
        move = max(abs(b - a) for a, b in zip(expected[:count - 1], expected[1:count]))
        found += [_ratio(abs(a - b), move) for a, b in zip(losses[1:count], expected[1:count])]
    return found


def deviations_in_tolerances(row: Mapping[str, Any], reference: Mapping[str, Any]) -> list[float]:
    """loss_deviations over the tolerance the row is held to at each step: at most 1 where it matches."""
    tolerance = TOLERANCE[arithmetic(row)]
    return [deviation / tolerance[Quantity.FIRST_LOSS if step == 0 else Quantity.LATER_LOSSES]
            for step, deviation in enumerate(loss_deviations(row, reference))]


def references(rows: Sequence[Mapping[str, Any]]) -> dict[tuple, Mapping[str, Any]]:
    """{reference key: the plain row each row of that key is held against}: the earliest ok plain launch
    with losses, as harness.derive.parity.judge chooses it."""
    plain = [row for row in rows if row.get("status") == "ok" and row["spec"]["strategy"] == REFERENCE_STRATEGY
             and row.get("measurements", {}).get("loss_per_step")]
    found: dict[tuple, Mapping[str, Any]] = {}
    for row in sorted(plain, key=lambda r: (r.get("started_at", ""), r.get("run_id", ""))):
        found.setdefault(reference_key(row["spec"]), row)
    return found


def _ratio(gap: float, scale: float) -> float:
    if not (math.isfinite(gap) and math.isfinite(scale)):
        return math.inf
    if scale == 0:
        return 0.0 if gap == 0 else math.inf
    return gap / scale
