"""Loss parity, judged when rows are read: does a strategy train the same way as the plain single-device loop?

    python -m harness report results/full-*.jsonl --out report/     # the cell summary's `parity` column

TOLERANCE_NOTES_GO_HERE
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

PARITY_STEPS = 4          # losses compared: the initial one and three updates
REFERENCE_STRATEGY = "plain"


class Verdict(enum.StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"
    NO_REFERENCE = "no-reference"     # no ok plain row with the same reference key among the rows given
    REFERENCE = "reference"           # an ok plain row: what the others are held against
    NOT_JUDGED = "not-judged"         # not an ok row, or an ok row without losses


class Quantity(enum.StrEnum):
    """What is compared with the reference; each has its own tolerance per precision."""

    FIRST_LOSS = "loss_first_step"                       # loss of the initial weights (step 0)
    LATER_LOSSES = "loss_later_steps"                    # steps 1 .. PARITY_STEPS - 1, after 1..3 updates
    GRADIENT_NORM = "gradient_norm_first_step"
    PARAMETER_NORM = "parameter_norm_after_first_step"
    UPDATE_NORM = "update_norm_first_step"


NORMS = (Quantity.GRADIENT_NORM, Quantity.PARAMETER_NORM, Quantity.UPDATE_NORM)
# bf16 recipes that compute with bf16 copies of the weights from step 0 on (harness.strategies.base
# PrecisionRecipe), where the plain loop keeps fp32 weights under autocast: a different arithmetic.
BF16_WEIGHT_RECIPES = ("deepspeed-bf16", "fsdp-mp-policy")

# Largest relative difference |x - x_ref| / |x_ref| that still matches, per precision. See the docstring
# for the noise each was set over and the faults each sits under.
TOLERANCE: Mapping[str, Mapping[Quantity, float]] = {
    "fp32": {Quantity.FIRST_LOSS: 1e-6, Quantity.LATER_LOSSES: 1e-3, Quantity.GRADIENT_NORM: 1e-5,
             Quantity.PARAMETER_NORM: 1e-6, Quantity.UPDATE_NORM: 1e-5},
    "bf16": {Quantity.FIRST_LOSS: 1e-5, Quantity.LATER_LOSSES: 0.1, Quantity.GRADIENT_NORM: 3e-3,
             Quantity.PARAMETER_NORM: 1e-5, Quantity.UPDATE_NORM: 1e-2},
    "bf16-weights": {Quantity.FIRST_LOSS: 1e-4, Quantity.LATER_LOSSES: 0.2, Quantity.GRADIENT_NORM: 3e-3,
                     Quantity.PARAMETER_NORM: 2e-4, Quantity.UPDATE_NORM: 0.1},
}


@dataclass(frozen=True)
class Parity:
    """One row's verdict: which quantities failed, the largest relative deviation of each quantity compared,
    the tolerances it was held to, and a note (what was left out and why, or why it was not judged)."""

    verdict: Verdict
    failed: tuple[Quantity, ...] = ()
    deviations: dict[Quantity, float] = field(default_factory=dict)
    tolerances: dict[Quantity, float] = field(default_factory=dict)
    note: str = ""


def reference_key(spec: Mapping[str, Any]) -> tuple:
    """What must be equal for two cells to train on identical arithmetic (a row's `spec` dict)."""
    return (spec["workload"], spec["global_batch"], spec["micro_batch"], spec.get("precision", "fp32"),
            spec.get("seed", 0), spec.get("device", "cpu"), spec["warmup_steps"] + spec["timed_steps"])


def judge(rows: Sequence[Mapping[str, Any]]) -> list[Parity]:
    """A verdict for each row, in the order given, each non-plain ok row held against the ok plain row of
    its reference key found anywhere among `rows`. Verdicts a row stored when it was written are ignored."""
    references: dict[tuple, Mapping[str, Any]] = {}
    for row in sorted((r for r in rows if _is_reference(r)), key=_launch_order):
        references.setdefault(reference_key(row["spec"]), row)    # the earliest launch of a key
    return [_judge_one(row, references) for row in rows]


def arithmetic(row: Mapping[str, Any]) -> str:
    """The key of `TOLERANCE` a row is held to: fp32, bf16 (autocast over fp32 weights, as the plain loop)
    or bf16-weights (a recipe computing with bf16 weights)."""
    if row["spec"].get("precision", "fp32") == "fp32":
        return "fp32"
    return "bf16-weights" if row["measurements"].get("precision_recipe") in BF16_WEIGHT_RECIPES else "bf16"


def deviations(row: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[Quantity, float]:
    """Largest relative difference of each quantity both rows hold (inf where either is not finite)."""
    m, r = row["measurements"], reference["measurements"]
    losses, expected = m["loss_per_step"], r["loss_per_step"]
    count = min(PARITY_STEPS, len(losses), len(expected))
    found: dict[Quantity, float] = {}
    if count >= 1:
        found[Quantity.FIRST_LOSS] = _relative(losses[0], expected[0])
    if count >= 2:
        # As a fraction of the reference's largest move from one compared step to the next, not of the loss
        # itself: how far off the reference's own progress a row is (see the docstring).
        step = max(abs(b - a) for a, b in zip(expected[:count - 1], expected[1:count]))
        gap = max(abs(a - b) for a, b in zip(losses[1:count], expected[1:count]))
        found[Quantity.LATER_LOSSES] = _ratio(gap, step)
    for quantity in NORMS:
        if m.get(quantity) is not None and r.get(quantity) is not None:
            found[quantity] = _relative(m[quantity], r[quantity])
    return found


def _judge_one(row: Mapping[str, Any], references: Mapping[tuple, Mapping[str, Any]]) -> Parity:
    if row.get("status") != "ok" or not row.get("measurements", {}).get("loss_per_step"):
        return Parity(Verdict.NOT_JUDGED, note="not an ok row with losses")
    if _is_reference(row):
        return Parity(Verdict.REFERENCE)
    reference = references.get(reference_key(row["spec"]))
    if reference is None:
        return Parity(Verdict.NO_REFERENCE, note="no ok plain row with the same workload, batch, precision, "
                                                 "seed, device and steps among the rows read")
    tolerance = TOLERANCE[arithmetic(row)]
    found = deviations(row, reference)
    failed = tuple(q for q, deviation in found.items() if not deviation <= tolerance[q])
    return Parity(Verdict.MISMATCH if failed else Verdict.MATCH, failed=failed, deviations=found,
                  tolerances={q: tolerance[q] for q in found}, note=_left_out(row, reference, found))


def _left_out(row: Mapping[str, Any], reference: Mapping[str, Any], found: Mapping[Quantity, float]) -> str:
    """Which quantities were not compared, and why."""
    if all(q in found for q in NORMS):
        return ""
    for side, which in ((row, "this row"), (reference, "the reference")):
        reason = side["measurements"].get("norms_unavailable_because")
        if reason:
            return f"judged on losses alone: {which} has no norms ({reason})"
    for side, which in ((row, "this row"), (reference, "the reference")):
        if not any(q in side["measurements"] for q in NORMS):
            return f"judged on losses alone: {which} was written before rows held norms (schema 1)"
    missing = ", ".join(q.value for q in NORMS if q not in found)
    return f"not compared, absent from one of the rows: {missing}"


def _is_reference(row: Mapping[str, Any]) -> bool:
    return (row.get("status") == "ok" and row["spec"]["strategy"] == REFERENCE_STRATEGY
            and bool(row.get("measurements", {}).get("loss_per_step")))


def _launch_order(row: Mapping[str, Any]) -> tuple[str, str]:
    """Plain repeats of one key are identical arithmetic; the earliest launch is the reference whatever the
    order rows are read in."""
    return (row.get("started_at", ""), row.get("run_id", ""))


def _relative(value: float, reference: float) -> float:
    return _ratio(abs(value - reference), abs(reference))


def _ratio(gap: float, scale: float) -> float:
    """gap / scale, inf where either is not finite or a gap meets a zero scale."""
    if not (math.isfinite(gap) and math.isfinite(scale)):
        return math.inf
    if scale == 0:
        return 0.0 if gap == 0 else math.inf
    return gap / scale


def noise_table(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, Quantity], tuple[float, str]]:
    """{(TOLERANCE key, quantity): (largest deviation from the reference, the row that showed it)} over every
    judged row: how the tolerances were measured, and how to measure them again on other hardware from
    rows of honest runs."""
    rows = list(rows)
    largest: dict[tuple[str, Quantity], tuple[float, str]] = {}
    for row, parity in zip(rows, judge(rows)):
        if parity.verdict not in (Verdict.MATCH, Verdict.MISMATCH):
            continue
        spec = row["spec"]
        label = f"{spec['workload']}/{spec['strategy']}/ws{spec['world_size']}/seed{spec.get('seed', 0)}"
        for quantity, deviation in parity.deviations.items():
            key = (arithmetic(row), quantity)
            if key not in largest or deviation > largest[key][0]:
                largest[key] = (deviation, label)
    return largest
