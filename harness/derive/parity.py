"""Loss parity, judged when rows are read: does a strategy train the same way as the plain single-device loop?

    python -m harness report results/full-*.jsonl --out report/     # the cell summary's `parity` column

Every ok row is held against the ok `plain` row with the same workload, global batch, micro-batch,
precision, seed, device and step count (on a GPU, the same GPU model: `held_key`) found anywhere among the rows read
(`judge`), whatever their order:
the same model, data and arithmetic, only distributed differently. Verdicts are computed here each time;
the `parity_*` fields old rows stored when they were written are ignored. Compared:
- the loss of step 0, from the initial weights on the same micro-batches, where only the order of the sum
  over ranks differs: relative to the reference's;
- the losses of steps 1-3, after one, two and three updates, as a fraction of the reference's largest
  move from one of these steps to the next: how far a row is off the reference's own progress. Relative
  to the loss itself the same tolerance would mean different things on different workloads: ResNet-20's
  loss moves 0.35 a step here and gpt-tiny's 0.019, so a relative tolerance above ResNet-20's bf16 noise
  (1.6e-3 of the loss) would sit within a factor of 2 of a gpt-tiny run one update behind (3.1e-3);
- the global norm of the first step's gradient (reduced, before the update), of the parameters after that
  step, and of the step's update theta_1 - theta_0 (`harness.rank.worker.FirstStepNorms`), each relative to the
  reference's. AdamW's first update is lr * g / (|g| + eps), nearly blind to a gradient's scale: gradients
  summed instead of averaged, or a micro-batch lost from the accumulation, move the losses of a few steps
  by a fraction of a step's progress but the gradient norm by 15-100%;
- the same gradient's and update's norms tensor by tensor ({parameter name: norm}, named as in the
  unwrapped model), on the tensor furthest off the reference's: max_t |n_t - r_t| / |r_t|, inf for a tensor
  only one row names. A global norm sees an error only along g (an error e moves it by g.e / |g|^2 to first
  order), so one confined to some tensors hides in it: on gpt-tiny in bf16 every c_attn.weight gradient
  halved (21% of the parameters) moves it by 1.4e-3, every LayerNorm gradient doubled by 2.4e-4, a 2% random
  error orthogonal to g by 2.0e-4; tensor by tensor they are 0.5, 1 and 0.19 off (tests/test_derive_parity.py
  works them out by hand). Adam ignores each element's scale, so such errors barely reach the update;
  tensor by tensor the update shows a tensor that never moves (1);
- on an MoE model, the router's choices: each expert's tokens in each block in each of those steps, equal, unless
  no more choices moved than were near-ties (`ROUTING_NEAR_TIE`; harness.rank.routing).
Rows without norms (schema-1 rows; the pipeline, whose `train_batch` has no point between reduction and
update) are judged on the losses alone, rows without the norms by tensor (written before rows held them)
on the global norms, and the verdict's note says which.

Why tolerances at all: strategies legitimately sum in different orders (all-reduce trees, buckets, sharded
optimizer maths), and Adam's first updates, close to lr * sign(gradient), turn a rounding-level difference in
a near-zero gradient into a whole lr-sized step of that weight, so trajectories separate slowly even when
both are right. A departure smaller than the tolerances can show on one workload and not another: Horovod's
weight decay before the first step (fixed in 6ee7646) moved ResNet-20's fourth loss by 3.6e-4 and
gpt-tiny's by 2e-6; it also scaled every initial weight by 1 - 1e-5, which the parameter norm catches on
both. A verdict is only as sensitive as the workload it is given.

Tolerances, from measured reordering noise, by the arithmetic a row ran (`arithmetic`): fp32; bf16 with every
gradient reduced in fp32 (DDP, Horovod, FSDP2's default, the pipeline's torch_autocast: `gradient_reduce_dtypes`
["float32"], recorded by the strategy, harness.strategies.base.Strategy.gradient_reduce_dtypes); bf16 with some
gradients communicated in bf16 (`bf16-comm`: DeepSpeed ZeRO's `torch_autocast` section, which reduces the
gradients of Linear and Conv modules in bf16, deepspeed/runtime/torch_autocast.py, LOWER_PRECISION_SAFE_MODULES;
also any bf16 row that does not record `gradient_reduce_dtypes`, written before rows did, and the note says
so). Runs (2026-11-25, CPU, gloo, a loaded 2-core VM, torch 2.13, DeepSpeed 0.19.8, Horovod 0.28.1):
`python -m harness run --matrix full --workload W --precision P --warmup-steps 1 --timed-steps 3
--world-sizes 1,2 --out F` for both tiny workloads in fp32 and bf16 with seed 0, and bf16 again with seed 1
(every strategy at world sizes 1 and 2, default recipes). Below, the largest deviation from the plain loop
over all those rows (`noise_table`; a * marks a larger figure seen by the same commands earlier, before rows
held norms by tensor), the planted error nearest to the tolerance (those by tensor planted on gpt-tiny's real
norms, tests/test_derive_parity.py), and the tolerance:

  quantity                  arithmetic  noise (row)                            nearest planted error          tolerance
  loss, step 0              fp32        7.6e-8 (1 ulp; gpt-tiny DDP ws 2)      +0.1 offset: 1.6e-2            1e-6
                            bf16, -comm 7.6e-8 (the same)                      +0.1 offset: 1.6e-2            1e-5
  losses, steps 1-3         fp32        8.2e-5* (ResNet-20 DDP ws 2)           one update behind: 1           1e-3
    (x largest step move)   bf16        8.4e-3 (ResNet-20 DDP ws 2)            one update behind: 1           0.1
                            bf16-comm   9.5e-3* (ResNet-20 ZeRO-1 ws 2)        one update behind: 1           0.1
  gradient norm, step 0     fp32        7.4e-8 (gpt-tiny ZeRO-1 ws 1)          a micro-batch of 4 lost: 0.15  1e-5
                            bf16        1.3e-7 (gpt-tiny FSDP2 ws 2)           2% orthogonal error: 2.0e-4    1e-5
                            bf16-comm   1.6e-4 (ResNet-20 ZeRO-3 ws 2)         a micro-batch of 4 lost: 0.15  3e-3
  parameter norm after it   fp32        1.2e-8 (gpt-tiny FSDP2 ws 2)           Horovod's weight decay: 1e-5   1e-6
                            bf16        3.9e-8 (ResNet-20 FSDP2 ws 2)          Horovod's weight decay: 1e-5   1e-6
                            bf16-comm   1.2e-6* (ResNet-20 ZeRO-1 ws 2)        weights never change: 4.0e-5   1e-5
  update norm, step 0       fp32        6.7e-8* (ResNet-20 ZeRO-3 ws 2)        weights never change: 1        1e-5
                            bf16        1.1e-7 (ResNet-20 FSDP2 ws 2)          weights never change: 1        1e-5
                            bf16-comm   4.2e-4* (ResNet-20 ZeRO-1 ws 2)        weights never change: 1        1e-2
  gradient norm by tensor   fp32        5.0e-7 (ResNet-20 ZeRO-3 ws 2)         2% orthogonal error: 0.19      1e-5
                            bf16        1.2e-6 (ResNet-20 FSDP2 ws 2)          2% orthogonal error: 0.19      2e-5
                            bf16-comm   2.9e-3 (ResNet-20 ZeRO-1 ws 2, fc.bias) 2% orthogonal error: 0.19     3e-2
  update norm by tensor     fp32        7.2e-7 (ResNet-20 FSDP2 ws 2)          one tensor never moves: 1      1e-5
                            bf16        2.0e-6 (ResNet-20 FSDP2 ws 2)          one tensor never moves: 1      2e-5
                            bf16-comm   7.8e-3 (gpt-tiny ZeRO-3 ws 2)          one tensor never moves: 1      0.1

Each tolerance is at least 8 times the noise and at least 4 times under the planted error (most are
10-1000 times either way). Step 0's loss agrees to one float32 ulp in bf16 as in fp32, four orders of
magnitude tighter than the later bf16 losses. Where every gradient is reduced in fp32, a bf16 row's norms
agree with the plain loop's as closely as an fp32 row's (to 1.3e-7): only the order of the fp32 sums differs.
ZeRO's bf16 communication rounds each reduced Linear gradient to 8 significant bits: 1.6e-4 on the global
norm, up to 2.9e-3 on one small tensor (ResNet-20's 10-element fc.bias; on gpt-tiny, 64-element biases, up to
1.2e-3), and on the update by tensor up to 1/(2n) of an n-element tensor where one element's tiny gradient
rounds across Adam's eps (7.8e-3 = 1/128 on a 64-element bias). The later losses separate in bf16 whatever the
reduction (Adam's sign-like first steps, above). Planted errors (tests/test_derive_parity.py,
tests/test_parity_faults.py): one of 2 ranks' gradients doubled (`grad-scale`: the gradient norm rose 1.55
times on gpt-tiny, and the later losses moved 0.33 of a step), one of a rank's 2 micro-batches left out
(`skip-microbatch`: 0.85 times, 0.28 of a step), a sum where an average belongs (2 times), every
c_attn.weight gradient halved on every rank (`grad-scale:tensors=*.c_attn.weight`: 1.4e-3 on the global
norm, 0.5 tensor by tensor), LayerNorm gradients doubled, a 2% random error orthogonal to the gradient (the
docstring's list above), one tensor that never moves, weights that never change (the later losses stay 1.3-2
step moves off, the update norm is 0, the parameter norm is off by 2.3e-5 on ResNet-20 in fp32, 4.0e-5 in
bf16, 1.4e-4 on gpt-tiny), a run one update behind (exactly one step move) and a +0.1 offset of every loss.
The parameter norm alone would catch weights that never change on ResNet-20 in bf16 by a factor of 4 only;
the update norm catches them 100 times over, and is why rows carry it.

fp16 (harness.strategies.loss_scaling) is held to bf16-comm's set, its own noise measured by the same commands
with --precision fp16 on gpt-tiny (every strategy at 2 ranks, an overflow planted at step 1) and ResNet-20 (DDP,
ZeRO-1): 4.6e-7 / 1.6e-3 / 1.8e-5 / 1.9e-7 / 1.0e-5 / 4.8e-4 / 4.6e-3 in the order of the table. An fp16 row must
also have applied the same optimizer steps as the reference among those compared, and at least one
(`_skipped_steps_verdict`).

Recipes computing with bf16 weights (`precision_recipe=deepspeed-bf16` of ZeRO, `mixed_precision=policy`
of FSDP2) are a different arithmetic from the plain loop's fp32 weights under autocast, already at step 0
(8.2e-6). They are held to the wider `bf16-weights` set, measured on gpt-tiny alone (ZeRO-1, -2, -3 with
the bf16 section and FSDP2 with the policy, at ws 1 and 2, seeds 0 and 1; on ResNet-20 both recipes fail
on CPU, float images meeting bf16 weights): noise 8.2e-6 / 1.1e-2 / 6.2e-4 / 7.1e-5 / 1.1e-2 / 1.6e-2 in
the order of the table (the gradient norm by tensor last), tolerances 8-20 times that (1e-4 / 0.2 / 5e-3 /
1e-3 / 0.1 / 0.15), at least 3 times under the planted errors (the gradient by tensor: c_attn.weight
halved, 0.5). The parameter norm no longer sees weights that never change there; the update norm and the
losses still do. The update by tensor is not judged there (`NOT_JUDGED`): a bf16 LayerNorm weight of 1
does not move by a step of 1e-3, under half of bf16's spacing next to 1 (2^-8 below, 2^-7 above), where the
plain loop's fp32 weight does (measured: every LayerNorm weight's update 0 with DeepSpeed's bf16 section).

All of this noise was measured on CPU, whose kernels repeat themselves bit for bit. A GPU's do not: on an H200
(../shared/gpu-h200, a3663fd; GPT-2 small in bf16 at world size 1, where DDP, FSDP2 and Horovod compute exactly
the plain loop's arithmetic) the first gradient differed from the plain loop's by up to 1.6e-4 tensor by tensor and
1.6e-5 as a whole (5 to 8 times the bf16 tolerances), its update by up to 3.8e-3 on one 2,304-element bias, all of it
in the first blocks' backward (the last blocks and the head repeated exactly), while ResNet-50's kernels repeated
exactly. The verdicts there were a coin toss: DDP, FSDP2 and Horovod `mismatch`, ZeRO's looser bf16-comm set `match`.

Two ways out were weighed. A deterministic probed step (torch.use_deterministic_algorithms for step 0 alone) cannot
be had: CUBLAS_WORKSPACE_CONFIG must be set before cuBLAS starts, so for the whole process, timed steps included, and
ResNet's adaptive average pool has no deterministic CUDA backward (torch raises in deterministic mode), so it would
still need warn_only and its non-determinism. So on a device other than the CPU (`DETERMINISTIC_DEVICES`) a row is
held to a noise floor measured beside it (`noise_floors`): the plain loop's own deviation between its launches of
the same key, every quantity as above (a global norm's at least the weighted mean of its tensors' deviations, the
first-order bound of its own: `BOUNDED_BY`), the largest over its launches; each tolerance becomes
max(tolerance, NOISE_FLOOR_FACTOR x floor). The factor is 20: the update by tensor is the one
quantity whose largest deviation comes from a single tensor (the bias above), so a floor from one pair of launches
is one sample of it; simulated with each tensor's noise as the H200's (scripts/parity_noise_floor.py, 1e5 trials),
an honest row exceeded 4 times the floor of two plain launches in 6.8% of trials, 10 times in 0.65%, 20 times in
0.046% (0.001% with three launches), while the gradient by tensor, its largest deviation shared by many tensors,
exceeded 4 times in 0.006%. 20 x the H200's floors
(3.2e-3 gradient by tensor, 7.6e-2 update by tensor) stays 150 and 13 times under the planted errors those catch (a
tensor's gradient halved, a tensor that never moves). A row is not judged where the plain loop ran once among the
rows (every GPU matrix launches it twice: harness.matrix); a quantity is left out of the verdict, which says so, where
no second plain launch read it (its noise there unknown) or where the plain loop's own launches differ so much in it
that 20 times that would pass a planted error (a tolerance raised over `FLOOR_CEILING`, a quarter of the smallest
planted error of that quantity): nothing can be held against a reference that does not repeat itself. A row left with
step 0's loss alone is not judged: weights that never change match on it. tests/test_derive_parity.py judges synthetic GPU-like noise both ways.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from harness.derive.techniques import techniques_on
from harness.derive.staleness import is_asynchronous, staleness_summary

PARITY_STEPS = 4          # losses compared: the initial one and three updates
REFERENCE_STRATEGY = "plain"


class Verdict(enum.StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"
    NO_REFERENCE = "no-reference"     # no ok plain row with the same reference key among the rows given
    REFERENCE = "reference"           # an ok plain row: what the others are held against
    NOT_JUDGED = "not-judged"         # not an ok row, or an ok row without losses
    # An asynchronous strategy (ps-async): its updates apply one worker's gradient on parameters others moved,
    # so no step is the plain loop's; its final loss is set beside the plain loop's after the same samples.
    NOT_COMPARABLE = "not comparable: asynchronous"


class Quantity(enum.StrEnum):
    """What is compared with the reference; each has its own tolerance per precision."""

    FIRST_LOSS = "loss_first_step"                       # loss of the initial weights (step 0)
    LATER_LOSSES = "loss_later_steps"                    # steps 1 .. PARITY_STEPS - 1, after 1..3 updates
    GRADIENT_NORM = "gradient_norm_first_step"
    PARAMETER_NORM = "parameter_norm_after_first_step"
    UPDATE_NORM = "update_norm_first_step"
    # {parameter name: norm} of the same gradient and update, judged on the tensor furthest off the reference
    GRADIENT_NORM_BY_TENSOR = "gradient_norm_by_tensor_first_step"
    UPDATE_NORM_BY_TENSOR = "update_norm_by_tensor_first_step"
    # An MoE model's router choices (harness.rank.routing): each expert's tokens in each of the first PARITY_STEPS
    # steps, held equal, not within a tolerance: one token routed elsewhere is a different model's step.
    ROUTING = "tokens_per_expert_by_step"


NORMS = (Quantity.GRADIENT_NORM, Quantity.PARAMETER_NORM, Quantity.UPDATE_NORM)
TENSOR_NORMS = (Quantity.GRADIENT_NORM_BY_TENSOR, Quantity.UPDATE_NORM_BY_TENSOR)
# 16-bit recipes that compute with 16-bit copies of the weights from step 0 on (harness.strategies.base
# PrecisionRecipe), where the plain loop keeps fp32 weights under autocast: a different arithmetic.
SIXTEEN_BIT_WEIGHT_RECIPES = ("deepspeed-bf16", "deepspeed-fp16", "fsdp-mp-policy")
# fp16 rows (harness.strategies.loss_scaling): each step applied on every rank, or skipped on an overflow.
STEP_APPLIED = "optimizer_step_applied"

# What a row says its gradient reduction communicated in (harness.strategies.base.Strategy.gradient_reduce_dtypes,
# torch's dtype names); only fp32 throughout keeps a bf16 row's reduced gradients to the plain loop's rounding.
REDUCE_DTYPES = "gradient_reduce_dtypes"
FP32_REDUCTION = "float32"

# Largest deviation that still matches, per arithmetic (`arithmetic`): |x - x_ref| / |x_ref| (for the
# tensor-by-tensor norms, of the tensor furthest off), and for the later losses the largest |l_k - r_k| over
# the reference's largest step move. The docstring has the noise each was set over and the planted errors
# each sits under.
TOLERANCE: Mapping[str, Mapping[Quantity, float]] = {
    "fp32": {Quantity.FIRST_LOSS: 1e-6, Quantity.LATER_LOSSES: 1e-3, Quantity.GRADIENT_NORM: 1e-5,
             Quantity.PARAMETER_NORM: 1e-6, Quantity.UPDATE_NORM: 1e-5,
             Quantity.GRADIENT_NORM_BY_TENSOR: 1e-5, Quantity.UPDATE_NORM_BY_TENSOR: 1e-5},
    "bf16": {Quantity.FIRST_LOSS: 1e-5, Quantity.LATER_LOSSES: 0.1, Quantity.GRADIENT_NORM: 1e-5,
             Quantity.PARAMETER_NORM: 1e-6, Quantity.UPDATE_NORM: 1e-5,
             Quantity.GRADIENT_NORM_BY_TENSOR: 2e-5, Quantity.UPDATE_NORM_BY_TENSOR: 2e-5},
    "bf16-comm": {Quantity.FIRST_LOSS: 1e-5, Quantity.LATER_LOSSES: 0.1, Quantity.GRADIENT_NORM: 3e-3,
                  Quantity.PARAMETER_NORM: 1e-5, Quantity.UPDATE_NORM: 1e-2,
                  Quantity.GRADIENT_NORM_BY_TENSOR: 3e-2, Quantity.UPDATE_NORM_BY_TENSOR: 0.1},
    # No UPDATE_NORM_BY_TENSOR: NOT_JUDGED says why.
    "bf16-weights": {Quantity.FIRST_LOSS: 1e-4, Quantity.LATER_LOSSES: 0.2, Quantity.GRADIENT_NORM: 5e-3,
                     Quantity.PARAMETER_NORM: 1e-3, Quantity.UPDATE_NORM: 0.1,
                     Quantity.GRADIENT_NORM_BY_TENSOR: 0.15},
}
# Quantities an arithmetic does not compare, and why (the verdict's note says it).
NOT_JUDGED: Mapping[str, Mapping[Quantity, str]] = {
    "bf16-weights": {Quantity.UPDATE_NORM_BY_TENSOR: (
        "a bf16 weight near 1 (a LayerNorm's) does not move by a step of lr = 1e-3, under half of bf16's "
        "spacing there; its fp32 master copy does")},
    "fp16-weights": {Quantity.UPDATE_NORM_BY_TENSOR: (
        "held as bf16-weights is: DeepSpeed's fp16 section runs on GPUs only and was not measured here")},
}
# fp16 rows are held to bf16-comm's tolerances whatever they reduce in: their measured noise tensor by tensor is
# larger than bf16's with fp32 reduction (gradient 4.8e-4, update 4.6e-3, against 1.2e-6 and 2.0e-6), the global
# norms and losses within bf16's (docs/methodology.md, "fp16 and loss scaling"). Our reading, not isolated: fp16
# has 5 exponent bits, and a micro-batch's loss is divided by the rank's own micro-batch count before backward, so
# the small gradients that land in fp16's subnormals round differently in each layout, where bf16 has fp32's
# range. fp16-weights (DeepSpeed's fp16 section, GPU only, unmeasured) is held to bf16-weights'.
TOLERANCE = {**TOLERANCE, "fp16": TOLERANCE["bf16-comm"], "fp16-comm": TOLERANCE["bf16-comm"],
             "fp16-weights": TOLERANCE["bf16-weights"]}


# On a device whose kernels do not repeat themselves, one rule for every strategy's gradient by tensor: 20 x the plain
# loop's floor, over the precision's own tolerance; for a row that communicated its gradients in 16 bits (ZeRO's
# torch_autocast section, fp16) over at most COMM_ROUNDING_BY_TENSOR, not the CPU's 3e-2 (set over CPU noise that a
# GPU's floor replaces), which let a 1-2% error on one tensor pass for ZeRO where DDP's row caught it. Rounding to
# bf16 moves a value by at most 2^-8 of itself (3.9e-3; 1.7e-3 root-mean-square over a binade), and a tensor's norm by
# about that over the square root of its elements: ZeRO's reduce of two ranks' bf16 halves into bf16, simulated
# (200 draws), moves a 768-element LayerNorm's norm by 1.4e-4 (standard deviation), a 10-element bias's by 1.2e-3 (at
# most 3.7e-3); measured, 2.9e-3 at most on CPU (ResNet-20 ZeRO-1 ws 2, its 10-element fc.bias), 2.5e-4 on the H200 at world size 1 (GPT-2 small ZeRO-1, results/reference/h200/a3663fd;
# DDP's 1.6e-4). 5e-3 sits over those and at half of a 1% error (tests/test_parity_noise_floor.py plants one on ZeRO-2
# and ZeRO-3 rows, and a 0.6% one). Not covered: a tensor of one or two elements, whose two roundings can reach
# 7.8e-3; the transformers' smallest tensors have 768. Rows computing with 16-bit weights keep theirs (0.15): their
# arithmetic differs from the plain loop's by 1.6e-2 already, so a 1% error cannot be told from it there.
COMM_ROUNDED = ("bf16-comm", "fp16", "fp16-comm")
COMM_ROUNDING_BY_TENSOR = 5e-3

# A choice a rounding could flip: the gap between a token's k-th and (k+1)-th router probability under which two
# layouts' arithmetic may order them differently (one of workloads.moe.NEAR_TIE_MARGINS, whose counts rows record).
# In fp32 the layouts differ by rounding alone: the weights by ~1e-7 of themselves after an update (the parameter
# norm's 1e-6 tolerance above), a router probability of ~0.25 by less than 1e-7; under bf16 autocast the router's
# matmul rounds its output to 2^-8 of itself (3.9e-3). A routing difference that flipped no more tokens than had
# gaps under this in either row is reported as near-ties, not a mismatch; moe-tiny's smallest gap over a step's
# 8,192 choices was 3e-6 to 1.4e-5 in fp32, so a flip is rare there and any other is a different model.
ROUTING_NEAR_TIE = {"fp32": 1e-6}
ROUTING_NEAR_TIE_16_BIT = 1e-2

# Devices whose kernels repeat themselves bit for bit, where the tolerances above are the whole story; elsewhere each
# is raised to NOISE_FLOOR_FACTOR x the plain loop's own launch-to-launch deviation (`noise_floors`, the docstring).
DETERMINISTIC_DEVICES = ("cpu",)
NOISE_FLOOR_FACTOR = 20
NOISE_FLOOR_LAUNCHES = 2          # of the plain loop, at least, wherever a floor is needed (harness.matrix plans them)
# How far a floor may raise each tolerance: a quarter of the smallest planted error that quantity is there to catch
# (the docstring's table; tests/test_parity_faults.py). A reference whose launches differ by more than a ceiling /
# NOISE_FLOOR_FACTOR judges nothing.
FLOOR_CEILING: Mapping[Quantity, float] = {
    Quantity.FIRST_LOSS: 0.016 / 4,                  # a +0.1 offset
    Quantity.LATER_LOSSES: 1 / 4,                    # one update behind
    Quantity.GRADIENT_NORM: 0.15 / 4,                # a micro-batch of 4 lost
    Quantity.PARAMETER_NORM: 1e-5 / 4,               # Horovod's weight decay before the first step
    Quantity.UPDATE_NORM: 1 / 4,                     # weights that never change
    Quantity.GRADIENT_NORM_BY_TENSOR: 0.5 / 4,       # a tensor's gradient halved
    Quantity.UPDATE_NORM_BY_TENSOR: 1 / 4,           # a tensor that never moves
}
# A global norm N of tensors n_t moves, to first order, by sum_t (n_t^2 / N^2) delta_t relative to itself when each
# moves by delta_t: its floor is at least that weighted mean of its tensors' |delta_t| (a bound with no cancellation
# in it, unlike a single global deviation, which can come out near zero by chance).
BOUNDED_BY = {Quantity.GRADIENT_NORM: Quantity.GRADIENT_NORM_BY_TENSOR,
              Quantity.UPDATE_NORM: Quantity.UPDATE_NORM_BY_TENSOR}


@dataclass(frozen=True)
class NoiseFloor:
    """The plain loop's launch-to-launch deviation of one reference key: every quantity as `TOLERANCE` measures it,
    the largest over its launches after the first, and how many launches it rests on."""

    launches: int
    deviations: dict[Quantity, float] = field(default_factory=dict)

    def raised(self, tolerance: Mapping[Quantity, float]) -> dict[Quantity, float]:
        """Each of `tolerance` raised to NOISE_FLOOR_FACTOR x this floor; those `left_out` are not in it."""
        left_out = self.left_out(tolerance)
        return {q: max(t, NOISE_FLOOR_FACTOR * self.deviations[q]) for q, t in tolerance.items() if q not in left_out}

    def left_out(self, tolerance: Mapping[Quantity, float]) -> dict[Quantity, str]:
        """{quantity of `tolerance`: why it cannot be judged against this reference}: no launch of the plain loop
        beside the reference read it (its noise unknown here), or its floor is one a tolerance could not follow
        without passing a planted error (`FLOOR_CEILING`)."""
        why = {}
        for quantity in tolerance:
            deviation = self.deviations.get(quantity)
            if deviation is None:
                why[quantity] = "no second launch of the plain loop read it"
            elif not NOISE_FLOOR_FACTOR * deviation <= FLOOR_CEILING[quantity]:
                why[quantity] = (f"the plain loop's own launches differ by {deviation:.3g}, and {NOISE_FLOOR_FACTOR} "
                                 "times that would pass a planted error")
        return why


@dataclass(frozen=True)
class Parity:
    """One row's verdict: which quantities failed, the largest relative deviation of each quantity compared,
    the tolerances it was held to, the tensor that showed each tensor-by-tensor deviation, and a note (which
    tensor failed, what was left out and why, or why it was not judged)."""

    verdict: Verdict
    failed: tuple[Quantity, ...] = ()
    deviations: dict[Quantity, float] = field(default_factory=dict)
    tolerances: dict[Quantity, float] = field(default_factory=dict)
    note: str = ""
    tensors: dict[Quantity, str] = field(default_factory=dict)


def reference_key(spec: Mapping[str, Any]) -> tuple:
    """What must be equal for two cells to train on identical arithmetic (a row's `spec` dict). Compiled or eager
    too: inductor fuses kernels and reorders their sums, so a compiled cell is held against the compiled plain loop
    (harness.strategies.compiling), whose arithmetic it shares, and never the eager one."""
    return (spec["workload"], spec["global_batch"], spec["micro_batch"], spec.get("precision", "fp32"),
            spec.get("seed", 0), spec.get("device", "cpu"), spec["warmup_steps"] + spec["timed_steps"],
            is_compiled(spec))


def is_compiled(spec: Mapping[str, Any]) -> bool:
    """Whether a row's `spec` dict compiled its blocks (`--option compile=true`)."""
    return bool((spec.get("options") or {}).get("compile"))


def held_key(row: Mapping[str, Any]) -> tuple:
    """The reference key of a row as parity holds it: its spec's, and on a device that does not repeat itself the
    device's name too. Two GPU models run other kernels (an H100 and an H200 differ by more than either's
    launch-to-launch noise), so a GPU row is held to the plain loop, and to the noise floor, of its own model; rows
    from machines of one model read together pool their plain launches. CPUs are one key, as they always were."""
    spec = row["spec"]
    if spec.get("device", "cpu") in DETERMINISTIC_DEVICES:
        return reference_key(spec)
    return (*reference_key(spec), row.get("measurements", {}).get("device_name"))


def references(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, Mapping[str, Any]]:
    """{reference key: the plain row the rows of that key are held against}: the earliest ok plain launch
    with losses of each key, whatever the order rows are read in, one with no options first."""
    found: dict[tuple, Mapping[str, Any]] = {}
    # The plain loop as it is, where it ran, before one with a technique turned on (activation checkpointing):
    # a technique is held against the loop without it.
    for row in sorted((r for r in rows if _is_reference(r)),
                      key=lambda r: (bool(techniques_on(r["measurements"])), *_launch_order(r))):
        found.setdefault(held_key(row), row)
    return found


def noise_floors(rows: Iterable[Mapping[str, Any]],
                 held_against: Mapping[tuple, Mapping[str, Any]] | None = None) -> dict[tuple, NoiseFloor]:
    """{reference key: the plain loop's launch-to-launch deviation} over the ok plain launches of each key that run
    as its reference does (the same techniques), each held against that reference (`references`)."""
    rows = list(rows)
    held_against = references(rows) if held_against is None else held_against
    floors: dict[tuple, NoiseFloor] = {}
    for key, reference in held_against.items():
        launches = [row for row in rows if _is_reference(row) and held_key(row) == key
                    and techniques_on(row["measurements"]) == techniques_on(reference["measurements"])]
        found: dict[Quantity, float] = {}
        for launch in launches:
            if launch is reference:
                continue
            deviation_of = {quantity: deviation for quantity, (deviation, _) in _deviations(launch, reference).items()}
            for quantity, by_tensor in BOUNDED_BY.items():
                if quantity in deviation_of and by_tensor in deviation_of:
                    deviation_of[quantity] = max(deviation_of[quantity], _weighted_mean_deviation(
                        launch["measurements"][by_tensor.value], reference["measurements"][by_tensor.value]))
            for quantity, deviation in deviation_of.items():
                found[quantity] = max(found.get(quantity, 0.0), deviation)
        floors[key] = NoiseFloor(launches=len(launches), deviations=found)
    return floors


def _weighted_mean_deviation(norms: Mapping[str, float], expected: Mapping[str, float]) -> float:
    """sum_t (r_t^2 / sum r^2) |n_t - r_t| / |r_t| over the tensors both name: the first-order bound of how far the
    global norm of those tensors is off (`BOUNDED_BY`); inf where a norm is not finite."""
    names = [name for name in expected if name in norms]
    total = sum(expected[name] ** 2 for name in names)
    if not total or not math.isfinite(total):
        return 0.0 if total == 0 else math.inf
    return sum(expected[n] ** 2 / total * _relative(norms[n], expected[n]) for n in names)


def judge(rows: Sequence[Mapping[str, Any]]) -> list[Parity]:
    """A verdict for each row, in the order given, each non-plain ok row (and each plain one with a technique on)
    held against the ok plain row of its reference key found anywhere among `rows`, on a device that does not repeat
    itself to that plain loop's noise floor among them (`noise_floors`). Verdicts a row stored when it was written are
    ignored."""
    held_against = references(rows)
    floors = noise_floors(rows, held_against)
    return [_judge_one(row, held_against, floors) for row in rows]


def arithmetic(row: Mapping[str, Any]) -> str:
    """The key of `TOLERANCE` a row is held to: fp32; bf16 (autocast over fp32 weights, as the plain loop,
    every gradient reduced in fp32); bf16-comm (the same, some gradients communicated in bf16: DeepSpeed
    ZeRO's torch_autocast section; also a bf16 row that does not say, written before rows recorded
    `gradient_reduce_dtypes`); bf16-weights (a recipe computing with bf16 weights)."""
    m = row["measurements"]
    precision = row["spec"].get("precision", "fp32")
    if precision == "fp32":
        return "fp32"
    if m.get("precision_recipe") in SIXTEEN_BIT_WEIGHT_RECIPES:
        return f"{precision}-weights"
    reduced_in = m.get(REDUCE_DTYPES)
    return precision if reduced_in is not None and set(reduced_in) <= {FP32_REDUCTION} else f"{precision}-comm"


def deviations(row: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[Quantity, float]:
    """Each quantity both rows hold, as `TOLERANCE` measures it (inf where a value is not finite)."""
    return {quantity: deviation for quantity, (deviation, _) in _deviations(row, reference).items()}


def loss_deviations(row: Mapping[str, Any], reference: Mapping[str, Any], steps: int = PARITY_STEPS) -> list[float]:
    """Each compared step's loss deviation, as `TOLERANCE` measures it (inf where not finite): step 0
    relative to the reference's loss; steps 1 .. `steps` - 1 as a fraction of the reference's largest
    move from one compared step to the next, not of the loss itself: how far off the reference's own
    progress a row is (see the docstring). FIRST_LOSS is the first, LATER_LOSSES the largest of the rest.
    `steps`: PARITY_STEPS for parity; every step for a resume check (harness.derive.resume)."""
    losses, expected = row["measurements"]["loss_per_step"], reference["measurements"]["loss_per_step"]
    count = min(steps, len(losses), len(expected))
    if count == 0:
        return []
    found = [_relative(losses[0], expected[0])]
    if count >= 2:
        move = max(abs(b - a) for a, b in zip(expected[:count - 1], expected[1:count]))
        found += [_ratio(abs(a - b), move) for a, b in zip(losses[1:count], expected[1:count])]
    return found


def _deviations(row: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[Quantity, tuple[float, str]]:
    """`deviations`, each with the tensor that showed it (empty but for the tensor-by-tensor quantities)."""
    m, r = row["measurements"], reference["measurements"]
    by_step = loss_deviations(row, reference)
    found: dict[Quantity, tuple[float, str]] = {}
    if by_step:
        found[Quantity.FIRST_LOSS] = by_step[0], ""
    if len(by_step) >= 2:
        found[Quantity.LATER_LOSSES] = max(by_step[1:]), ""
    if _probed_step_skipped(row) or _probed_step_skipped(reference):
        return found
    for quantity in NORMS:
        if m.get(quantity) is not None and r.get(quantity) is not None:
            found[quantity] = _relative(m[quantity], r[quantity]), ""
    for quantity in TENSOR_NORMS:
        if m.get(quantity) and r.get(quantity):
            found[quantity] = _largest_by_tensor(m[quantity], r[quantity])
    return found


def _routing(row: Mapping[str, Any], reference: Mapping[str, Any], key: str) -> tuple[bool, str]:
    """(whether the router's choices differ from the reference's in the first PARITY_STEPS steps beyond what its
    near-ties explain, a note). Every step is judged: a block whose choices add up to another total (a choice dropped
    or added) fails; otherwise the choices that moved, half the counts' difference rounded up, must be no more than
    the reference's near-ties in that step (the reference's alone: a row cannot excuse itself by near-ties of its
    own, as a router collapsed to equal probabilities would)."""
    mine, theirs = row["measurements"].get("routing"), reference["measurements"].get("routing")
    if not mine or not theirs:
        return False, ""
    near_tie = ROUTING_NEAR_TIE.get(key, ROUTING_NEAR_TIE_16_BIT)
    steps = zip(mine["tokens_per_expert_by_step"][:PARITY_STEPS], theirs["tokens_per_expert_by_step"][:PARITY_STEPS])
    excused = []
    for step, (tokens, expected) in enumerate(steps):
        if tokens == expected:
            continue
        if [sum(block) for block in tokens] != [sum(block) for block in expected]:
            return True, (f"the router's choices differ from the plain loop's in step {step}: its blocks routed "
                          f"{[sum(block) for block in tokens]} choices against {[sum(block) for block in expected]}")
        difference = sum(abs(a - b) for block, other in zip(tokens, expected) for a, b in zip(block, other))
        moved = -(-difference // 2)          # one moved choice takes one from an expert and gives one to another
        ties = _near_ties(theirs, step, near_tie)
        where = f"the router's choices differ from the plain loop's in step {step}: {moved} choice(s) moved"
        if moved > ties:
            return True, f"{where}, against {ties} near-tie(s) there in the plain loop (gaps under {near_tie:g})"
        excused.append(f"step {step}: {moved} moved, {ties} near-tie(s)")
    if excused:
        return False, (f"the router's choices differ from the plain loop's ({'; '.join(excused)}; gaps under "
                       f"{near_tie:g}): no more than a rounding can flip, so the routing is not held against it")
    return False, ""


def _near_ties(routing: Mapping[str, Any], step: int, margin: float) -> int:
    """The tokens whose choice was within `margin` of flipping in `step`, as the row counted them."""
    margins = routing.get("near_tie_margins", [])
    return routing["near_ties_by_step"][step][margins.index(margin)] if margin in margins else 0


def _largest_by_tensor(norms: Mapping[str, float], expected: Mapping[str, float]) -> tuple[float, str]:
    """The largest |n_t - r_t| / |r_t| over the tensors t of either row, and that tensor's name; inf for a
    tensor only one row names (a strategy that dropped or renamed a parameter)."""
    largest, where = -1.0, ""
    for name in sorted(set(norms) | set(expected)):
        deviation = (_relative(norms[name], expected[name]) if name in norms and name in expected
                     else math.inf)
        if deviation > largest:                 # _relative gives inf, never NaN, for a non-finite norm
            largest, where = deviation, name
    return largest, where


def _judge_one(row: Mapping[str, Any], references: Mapping[tuple, Mapping[str, Any]],
               floors: Mapping[tuple, NoiseFloor]) -> Parity:
    if row.get("status") != "ok" or not row.get("measurements", {}).get("loss_per_step"):
        return Parity(Verdict.NOT_JUDGED, note="not an ok row with losses")
    reference = references.get(held_key(row))
    # The plain loop is the reference, its repeats too; with a technique on (an option) it is judged against the
    # loop without it, where one ran.
    if _is_reference(row) and (reference is row or reference is None or not techniques_on(row["measurements"])
                               or techniques_on(reference["measurements"])):
        return Parity(Verdict.REFERENCE)
    if reference is None:
        return Parity(Verdict.NO_REFERENCE, note="no ok plain row with the same workload, batch, precision, "
                                                 "seed, device, steps and compile setting among the rows read")
    if is_asynchronous(row["measurements"]):
        return _asynchronous(row, reference)
    skipped = _skipped_steps_verdict(row, reference)
    if skipped is not None:
        return skipped
    key = arithmetic(row)
    tolerance = TOLERANCE[key]
    floor_note = ""
    device = row["spec"].get("device", "cpu")
    if device not in DETERMINISTIC_DEVICES:
        floor = floors.get(held_key(row), NoiseFloor(launches=1))
        if floor.launches < 2:
            return Parity(Verdict.NOT_JUDGED, note=(
                f"on {device} the tolerances follow the plain loop's own launch-to-launch noise, and it ran once among "
                "these rows: launch it at least twice (--repeats 2)"))
        if key in COMM_ROUNDED:
            tolerance = {**tolerance, Quantity.GRADIENT_NORM_BY_TENSOR: min(
                tolerance[Quantity.GRADIENT_NORM_BY_TENSOR], COMM_ROUNDING_BY_TENSOR)}
        raised = floor.raised(tolerance)
        floor_note = _floor_note(floor, tolerance, raised, device)
        tolerance = raised
    compared = _deviations(row, reference)
    found = {q: deviation for q, (deviation, _) in compared.items() if q in tolerance}
    if floor_note and not set(found) - {Quantity.FIRST_LOSS}:
        # A first loss alone says nothing of the updates: weights that never change match on it.
        return Parity(Verdict.NOT_JUDGED, note=f"nothing beyond step 0's loss could be held against the plain loop on "
                                               f"{device}: {floor_note}", deviations=found)
    failed = tuple(q for q, deviation in found.items() if not deviation <= tolerance[q])
    routing_differs, routing_note = _routing(row, reference, key)
    if routing_differs:
        failed += (Quantity.ROUTING,)
    tensors = {q: tensor for q, (_, tensor) in compared.items() if tensor and q in found}
    notes = [f"{q.value}: {tensors[q]} off by {found[q]:.3g}" for q in failed if q in tensors]
    if Quantity.GRADIENT_NORM in failed:
        notes.append(_still_scaled(row, reference))
    notes += [routing_note, _left_out(row, reference, compared)]
    notes += [f"{q.value} not judged with {key}: {why}" for q, why in NOT_JUDGED.get(key, {}).items() if q in compared]
    if key == "bf16-comm" and row["measurements"].get(REDUCE_DTYPES) is None:
        notes.append(f"held to the bf16-comm tolerances: the row does not record {REDUCE_DTYPES}")
    notes.append(floor_note)
    if is_compiled(row["spec"]):
        notes.append("held against the compiled plain loop (inductor's fused kernels)")
    return Parity(Verdict.MISMATCH if failed else Verdict.MATCH, failed=failed, deviations=found,
                  tolerances={q: tolerance[q] for q in found}, note="; ".join(n for n in notes if n),
                  tensors=tensors)


def _floor_note(floor: NoiseFloor, base: Mapping[Quantity, float], raised: Mapping[Quantity, float],
                device: str) -> str:
    """Which tolerances the plain loop's noise floor raised, to what, over how many of its launches, and which
    quantities it left out."""
    changed = [f"{q.value} {raised[q]:.2g}" for q in raised if raised[q] > base[q]]
    notes = [f"tolerances raised to {NOISE_FLOOR_FACTOR} x the plain loop's own deviation over its {floor.launches} "
             f"launches on {device}: {', '.join(changed)}" if changed else
             f"the plain loop's {floor.launches} launches on {device} repeat within these tolerances"]
    left_out = [f"{q.value} ({why})" for q, why in floor.left_out(base).items()]
    if left_out:
        notes.append(f"not judged: {', '.join(left_out)}")
    return "; ".join(notes)


def _asynchronous(row: Mapping[str, Any], reference: Mapping[str, Any]) -> Parity:
    """Never `match`: the final loss beside the plain loop's after the same steps (the same samples: every
    worker runs its share of the global batch each step), and the staleness of the updates applied."""
    losses, expected = row["measurements"]["loss_per_step"], reference["measurements"]["loss_per_step"]
    steps = min(len(losses), len(expected))
    note = (f"final loss {losses[steps - 1]:.4f} against the plain loop's {expected[steps - 1]:.4f} after the same "
            f"{steps} steps of {row['spec']['global_batch']} samples")
    staleness = staleness_summary(row["measurements"])
    if staleness:
        note += (f"; staleness of the {staleness['updates']} updates applied: median {staleness['median']:g}, max "
                 f"{staleness['max']}, {staleness['stale_share']:.0%} stale")
    else:
        note += "; no staleness recorded"
    return Parity(Verdict.NOT_COMPARABLE, note=note)


def _still_scaled(row: Mapping[str, Any], reference: Mapping[str, Any]) -> str:
    """Where a row's gradient norm is its first loss scale times the reference's: gradients read between
    reduction and update still multiplied by the scale (DeepSpeed ZeRO under torch_autocast float16, whose
    GradScaler unscales only inside its step, while ZeRO's own norm, which its gradient clipping uses, divides
    by ZeRO's scale of 1)."""
    scales = row["measurements"].get("loss_scale_per_step") or []
    norm, expected = (side["measurements"].get(Quantity.GRADIENT_NORM) for side in (row, reference))
    if not scales or not norm or not expected or abs(norm / expected / scales[0] - 1) > 1e-2:
        return ""
    return (f"the gradient norm is {norm / expected:.6g} times the reference's, the loss scale {scales[0]:g}: the "
            "reduced gradients were read still scaled, as the library's own norm (and any clipping) reads them")


def _skipped_steps_verdict(row: Mapping[str, Any], reference: Mapping[str, Any]) -> Parity | None:
    """fp16 rows: a MISMATCH where every optimizer step was skipped (nothing trained, whatever the losses say),
    where the ranks of the row did not skip the same steps (their replicas or stages now differ), or where the
    row and the reference skipped different steps, any of the steps both ran (different updates: compared
    losses would only hide it for a while); None where both applied the same steps, whose losses are then
    compared as any others."""
    m = row["measurements"]
    applied, expected = m.get(STEP_APPLIED), reference["measurements"].get(STEP_APPLIED)
    if applied is None and expected is None:
        return None
    if applied is not None and not any(applied):
        scales = sorted(set(m.get("loss_scale_per_step") or []))
        # A scale that a skip never lowered is a scaler that never backs off (DeepSpeed's torch_autocast under
        # ZeRO, harness.strategies.loss_scaling): a scale too high for the gradients then skips every step.
        stuck = ", never lowered" if len(scales) == 1 and len(applied) > 1 else ""
        return Parity(Verdict.MISMATCH, note=f"every one of the {len(applied)} optimizer steps was skipped on an "
                                             f"inf/NaN gradient (loss scale {', '.join(f'{s:g}' for s in scales)}"
                                             f"{stuck}): the weights never changed")
    by_rank = m.get("optimizer_step_applied_by_rank") or []
    split = [step for step, verdicts in enumerate(zip(*by_rank)) if len(set(verdicts)) > 1]
    if split:
        return Parity(Verdict.MISMATCH, note=f"the ranks disagreed on applying optimizer steps {_steps(split)}: "
                                             "some updated their weights and others did not")
    count = min(len(row["measurements"]["loss_per_step"]), len(reference["measurements"]["loss_per_step"]))
    # A row without the record applied every step (fp32, bf16).
    mine, theirs = (list(steps[:count]) if steps is not None else [True] * count for steps in (applied, expected))
    if mine != theirs:
        def skipped(steps):
            return _steps([i for i, done in enumerate(steps) if not done]) or "none"
        return Parity(Verdict.MISMATCH, note=f"skipped different optimizer steps of the {count} both ran: this "
                                             f"row skipped {skipped(mine)}, the reference {skipped(theirs)}")
    return None


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(str(step) for step in steps)


def _probed_step_skipped(row: Mapping[str, Any]) -> bool:
    """Whether the step the first-step norms read (step 0) was skipped on an overflow: its gradients are inf or
    NaN and its update nothing, on the reference as on the row (`_skipped_steps_verdict` has made them agree)."""
    applied = row["measurements"].get(STEP_APPLIED)
    return bool(applied) and not applied[0]


def _left_out(row: Mapping[str, Any], reference: Mapping[str, Any], found: Mapping[Quantity, Any]) -> str:
    """Which quantities were not compared, and why."""
    if all(q in found for q in NORMS + TENSOR_NORMS):
        return ""
    if _probed_step_skipped(row):
        return ("judged on losses alone: step 0, whose norms are read, was skipped on an overflow (here and in the "
                "reference)")
    for side, which in ((row, "this row"), (reference, "the reference")):
        reason = side["measurements"].get("norms_unavailable_because")
        if reason:
            return f"judged on losses alone: {which} has no norms ({reason})"
    for side, which in ((row, "this row"), (reference, "the reference")):
        if not any(q in side["measurements"] for q in NORMS):
            return f"judged on losses alone: {which} was written before rows held norms (schema 1)"
    for side, which in ((row, "this row"), (reference, "the reference")):
        reason = side["measurements"].get("norms_by_tensor_unavailable_because")
        if reason:
            return f"global norms alone, not tensor by tensor: {which} has none ({reason})"
    for side, which in ((row, "this row"), (reference, "the reference")):
        if not any(side["measurements"].get(q) for q in TENSOR_NORMS):
            return f"global norms alone, not tensor by tensor: {which} was written before rows held them"
    missing = ", ".join(q.value for q in NORMS + TENSOR_NORMS if q not in found)
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
                tensor = parity.tensors.get(quantity)
                largest[key] = (deviation, f"{label} {tensor}" if tensor else label)
    return largest
