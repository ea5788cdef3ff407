"""Loss parity: does a strategy train the same way as the plain single-device loop?

Every cell records its per-step losses of the whole global batch. A cell is compared with the `plain`
reference cell of the same workload, global batch, micro-batch, precision, seed, device and step count:
the same model, data and arithmetic, only distributed differently.

Tolerance. Step 0 is the loss before any update and must agree to rounding; each later step shows the
effect of one more optimizer step. Strategies legitimately differ in the order of floating-point sums
(all-reduce trees, bucketing, sharded optimizer math), so the two trajectories separate slowly: Adam's
first updates are close to lr * sign(gradient), which turns a rounding-level difference in a near-zero
gradient into a full lr-sized step of that weight. We therefore compare the first PARITY_STEPS losses
(the initial loss and three updates), where that drift is still far below what a real error produces: a
gradient that is not averaged across ranks, a missed accumulation step or a different batch moves the
loss after the first update by 1e-3 or more, while reordered fp32 sums stay below 1e-5. Smaller
departures depend on the model: a 1e-5 rescale of every initial weight moved ResNet-20's fourth loss by
3.6e-4 (its BatchNorm amplifies it) but gpt-tiny's by only 2e-6, so the verdict is only as sensitive as
the workload it is given. bf16 autocast
rounds every matmul to 8 bits of mantissa (relative error up to 2**-8 = 0.4%) and some strategies reduce
gradients in bf16, hence the wider bf16 tolerance.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from harness.spec import Precision, RunSpec

PARITY_STEPS = 4
RELATIVE_TOLERANCE = {Precision.FP32: 1e-4, Precision.BF16: 2e-2}


class Verdict(enum.StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"
    NO_REFERENCE = "no-reference"     # no ok plain row with the same batch, data and precision
    REFERENCE = "reference"           # this row is the reference itself


@dataclass(frozen=True)
class Parity:
    verdict: Verdict
    steps_compared: int = 0
    max_abs_diff: float | None = None          # over the compared steps
    max_abs_diff_all_steps: float | None = None
    relative_tolerance: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"parity_verdict": self.verdict.value, "parity_steps_compared": self.steps_compared,
                "parity_max_abs_diff": self.max_abs_diff,
                "parity_max_abs_diff_all_steps": self.max_abs_diff_all_steps,
                "parity_relative_tolerance": self.relative_tolerance}


def reference_key(spec: RunSpec) -> tuple:
    """What must be equal for two cells to train on identical arithmetic."""
    return (spec.workload, spec.global_batch, spec.micro_batch, spec.precision.value, spec.seed,
            spec.device.value, spec.warmup_steps + spec.timed_steps)


def compare_losses(losses: Sequence[float], reference: Sequence[float], precision: Precision) -> Parity:
    tolerance = RELATIVE_TOLERANCE[precision]
    count = min(PARITY_STEPS, len(losses), len(reference))
    if count == 0:
        return Parity(Verdict.NO_REFERENCE)
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    compared = diffs[:count]
    finite = all(math.isfinite(x) for x in [*losses[:count], *reference[:count]])
    ok = finite and all(d <= tolerance * max(abs(r), 1e-12) for d, r in zip(compared, reference))
    return Parity(Verdict.MATCH if ok else Verdict.MISMATCH, steps_compared=count,
                  max_abs_diff=max(compared), max_abs_diff_all_steps=max(diffs), relative_tolerance=tolerance)


def parity_for(spec: RunSpec, losses: Sequence[float],
               references: Mapping[tuple, Sequence[float]]) -> Parity:
    if spec.strategy == "plain":
        return Parity(Verdict.REFERENCE)
    reference = references.get(reference_key(spec))
    if reference is None:
        return Parity(Verdict.NO_REFERENCE)
    return compare_losses(losses, reference, spec.precision)
