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

from typing import Any, Mapping

from harness.derive.parity import TOLERANCE, Quantity, arithmetic, loss_deviations


def deviations_in_tolerances(row: Mapping[str, Any], reference: Mapping[str, Any]) -> list[float]:
    """Each compared step's loss deviation (harness.derive.parity.loss_deviations) over the tolerance the row
    is held to at that step: at most 1 where it matches."""
    tolerance = TOLERANCE[arithmetic(row)]
    return [deviation / tolerance[Quantity.FIRST_LOSS if step == 0 else Quantity.LATER_LOSSES]
            for step, deviation in enumerate(loss_deviations(row, reference))]
