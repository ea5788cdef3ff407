"""Parity on a device whose kernels do not repeat themselves (harness.derive.parity: `noise_floors`), judged on
synthetic rows with GPU-like noise.

The noise: each tensor's own, as GPT-2 small in bf16 showed it at world size 1 on an H200 (results/reference/h200/
a3663fd): sigma_t = rms over DDP, FSDP2 and Horovod (the plain loop's exact arithmetic there) of the relative
deviation of tensor t's first-step gradient (and update) norm from the plain loop's, / sqrt(2). Up to 1.1e-4 on the
gradient, 2.5e-3 on one bias's update, 0 on the 63 tensors of the last blocks that repeated exactly. Each synthetic
launch is the H200 plain row with every tensor's norm times (1 + sigma_t z), z standard normal, its global norms the
root of the tensors' squares, its later losses moved by 1e-5 of the loss.
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest

from harness.derive.parity import NOISE_FLOOR_FACTOR, Quantity, Verdict, judge, noise_floors

H200 = Path(__file__).resolve().parents[1] / "results" / "reference" / "h200" / "a3663fd" / "rows.jsonl"
GRADIENTS, UPDATES = "gradient_norm_by_tensor_first_step", "update_norm_by_tensor_first_step"


def _h200_rows() -> dict[str, dict]:
    rows = [json.loads(line) for line in H200.read_text().splitlines()]
    return {row["spec"]["strategy"]: row for row in rows if row["status"] == "ok" and not row["spec"]["options"]
            and (row["spec"]["workload"], row["spec"]["precision"]) == ("gpt2-small", "bf16")}


ROWS = _h200_rows()
PLAIN = ROWS["plain"]


def _sigma(quantity: str) -> dict[str, float]:
    plain = PLAIN["measurements"][quantity]
    return {name: math.sqrt(sum(((ROWS[s]["measurements"][quantity][name] - value) / value) ** 2
                                for s in ("ddp", "fsdp2", "horovod")) / 3 / 2)
            for name, value in plain.items()}


SIGMA = {GRADIENTS: _sigma(GRADIENTS), UPDATES: _sigma(UPDATES)}


def launch(strategy: str, rng: random.Random, index: int, halve: str = "", noise: float = 1.0) -> dict:
    """One synthetic launch of the H200 cell under `strategy`: GPU-like noise on every tensor's norms (x `noise`: 0 for
    a GPU whose kernels repeat, as ResNet-50's did); `halve` names a tensor whose gradient is halved (a planted
    error)."""
    row = copy.deepcopy(PLAIN)
    row["spec"]["strategy"] = strategy
    row["run_id"], row["started_at"] = f"{strategy}-{index}", f"2026-11-27T00:00:{index:02d}"
    m = row["measurements"]
    m["gradient_reduce_dtypes"] = [] if strategy == "plain" else ["float32"]
    for quantity in (GRADIENTS, UPDATES):
        m[quantity] = {name: value * (1 + noise * SIGMA[quantity][name] * rng.gauss(0, 1))
                       for name, value in PLAIN["measurements"][quantity].items()}
    if halve:
        m[GRADIENTS][halve] *= 0.5
    m["gradient_norm_first_step"] = math.sqrt(sum(v * v for v in m[GRADIENTS].values()))
    m["update_norm_first_step"] = math.sqrt(sum(v * v for v in m[UPDATES].values()))
    m["parameter_norm_after_first_step"] *= 1 + noise * 5e-8 * rng.gauss(0, 1)
    m["loss_per_step"] = [m["loss_per_step"][0]] + [loss * (1 + noise * 1e-5 * rng.gauss(0, 1))
                                                    for loss in m["loss_per_step"][1:]]
    return row


def verdict_of_last(rows: list[dict]):
    return judge(rows)[-1]


def test_the_noise_profile_is_the_h200s():
    # What the synthetic rows stand on, read from the committed rows (not from the code under test).
    assert 1e-4 < max(SIGMA[GRADIENTS].values()) < 2e-4 and 2e-3 < max(SIGMA[UPDATES].values()) < 3e-3
    assert sum(1 for value in SIGMA[GRADIENTS].values() if value == 0) == 63


@pytest.mark.parametrize("plain_launches, seeds", [(3, 200), (2, 50)])
def test_honest_gpu_noise_matches(plain_launches, seeds):
    for seed in range(seeds):
        rng = random.Random(seed)
        rows = [launch("plain", rng, i) for i in range(plain_launches)] + [launch("ddp", rng, plain_launches)]
        parity = verdict_of_last(rows)
        assert parity.verdict is Verdict.MATCH, (seed, parity)
        assert "tolerances raised to 20 x the plain loop's own deviation" in parity.note


def test_the_same_honest_noise_mismatches_under_the_cpu_tolerances():
    # Why the floor exists: the CPU's tolerances (bf16, every gradient reduced in fp32: 2e-5 by tensor) call this
    # noise a mismatch. The same rows marked as CPU rows, where no floor applies.
    mismatches = 0
    for seed in range(20):
        rng = random.Random(seed)
        rows = [launch("plain", rng, 0), launch("plain", rng, 1), launch("ddp", rng, 2)]
        for row in rows:
            row["spec"]["device"] = "cpu"
        mismatches += verdict_of_last(rows).verdict is Verdict.MISMATCH
    assert mismatches == 20


@pytest.mark.parametrize("tensor", ["1.c_attn.bias", "1.ln_1.weight", "12.mlp_proj.weight", "0.wte.weight"])
def test_a_gradient_halved_on_one_tensor_mismatches_naming_it(tensor):
    # The noisiest tensors (layer 1's bias and LayerNorm), one that repeated exactly, and the tied embedding.
    for seed in range(20):
        rng = random.Random(seed)
        rows = [launch("plain", rng, 0), launch("plain", rng, 1), launch("ddp", rng, 2, halve=tensor)]
        parity = verdict_of_last(rows)
        assert parity.verdict is Verdict.MISMATCH, (seed, parity)
        assert Quantity.GRADIENT_NORM_BY_TENSOR in parity.failed
        assert parity.tensors[Quantity.GRADIENT_NORM_BY_TENSOR] == tensor


def test_the_floor_is_the_plain_loops_largest_deviation_and_bounds_the_global_norms():
    rng = random.Random(0)
    rows = [launch("plain", rng, i) for i in range(3)]
    floor = noise_floors(rows)[next(iter(noise_floors(rows)))]
    assert floor.launches == 3

    def largest(quantity: str, row: dict) -> float:
        mine, theirs = row["measurements"][quantity], rows[0]["measurements"][quantity]
        return max(abs(mine[n] - theirs[n]) / theirs[n] for n in theirs)

    def weighted(quantity: str, row: dict) -> float:
        mine, theirs = row["measurements"][quantity], rows[0]["measurements"][quantity]
        total = sum(v * v for v in theirs.values())
        return sum(theirs[n] ** 2 / total * abs(mine[n] - theirs[n]) / theirs[n] for n in theirs)

    by_tensor = max(largest(GRADIENTS, row) for row in rows[1:])
    assert floor.deviations[Quantity.GRADIENT_NORM_BY_TENSOR] == pytest.approx(by_tensor, rel=1e-12)
    # The global gradient norm's floor: its own deviation or, larger, the tensors' weighted mean |deviation|.
    own = max(abs(r["measurements"]["gradient_norm_first_step"] / rows[0]["measurements"]["gradient_norm_first_step"]
                  - 1) for r in rows[1:])
    bound = max(weighted(GRADIENTS, row) for row in rows[1:])
    assert bound > own and floor.deviations[Quantity.GRADIENT_NORM] == pytest.approx(bound, rel=1e-9)
    raised = judge(rows + [launch("ddp", rng, 3)])[-1].tolerances
    assert raised[Quantity.GRADIENT_NORM_BY_TENSOR] == pytest.approx(NOISE_FLOOR_FACTOR * by_tensor, rel=1e-12)
    parameter = max(abs(r["measurements"]["parameter_norm_after_first_step"]
                        / rows[0]["measurements"]["parameter_norm_after_first_step"] - 1) for r in rows[1:])
    assert raised[Quantity.PARAMETER_NORM] == pytest.approx(max(1e-6, NOISE_FLOOR_FACTOR * parameter), rel=1e-9)


def test_a_gpu_row_is_not_judged_where_the_plain_loop_ran_once():
    rng = random.Random(0)
    parity = verdict_of_last([launch("plain", rng, 0), launch("ddp", rng, 1)])
    assert parity.verdict is Verdict.NOT_JUDGED
    assert "ran once among these rows: launch it at least twice" in parity.note


def test_a_quantity_the_reference_does_not_repeat_is_left_out_and_the_rest_still_judged():
    rng = random.Random(0)
    rows = [launch("plain", rng, 0), launch("plain", rng, 1), launch("ddp", rng, 2, halve="1.mlp_proj.weight")]
    rows[1]["measurements"][GRADIENTS]["1.c_attn.bias"] *= 1.01       # 20 x 1% is 0.2, over a quarter of 0.5
    parity = verdict_of_last(rows)
    assert Quantity.GRADIENT_NORM_BY_TENSOR not in parity.tolerances
    # 1.01 x the two launches' own noise there
    assert ("not judged: gradient_norm_by_tensor_first_step (the plain loop's own launches differ by 0.00998, and 20 "
            "times that would pass a planted error)") in parity.note
    # The halved tensor still shows in the global gradient norm, whose floor stayed under its ceiling: its share of
    # |g|^2 is 0.998^2 / 2.1116^2 = 22%, so the norm drops by 1 - sqrt(1 - 3/4 x 0.22) = 8.7%.
    assert parity.verdict is Verdict.MISMATCH and parity.failed == (Quantity.GRADIENT_NORM,)


def test_a_reference_that_repeats_nothing_judges_nothing():
    rng = random.Random(0)
    rows = [launch("plain", rng, 0), launch("plain", rng, 1), launch("ddp", rng, 2)]
    m = rows[1]["measurements"]
    m["loss_per_step"] = [loss * 1.01 for loss in m["loss_per_step"]]
    for quantity in (GRADIENTS, UPDATES):
        m[quantity] = {name: value * 2 for name, value in m[quantity].items()}
    m["gradient_norm_first_step"] *= 2
    m["update_norm_first_step"] *= 2
    m["parameter_norm_after_first_step"] *= 2
    parity = verdict_of_last(rows)
    assert parity.verdict is Verdict.NOT_JUDGED and "pass a planted error" in parity.note


def test_cpu_rows_keep_the_cpu_tolerances_whatever_the_plain_loops_repeats_say():
    rng = random.Random(0)
    rows = [launch("plain", rng, 0), launch("plain", rng, 1), launch("ddp", rng, 2)]
    for row in rows:
        row["spec"]["device"] = "cpu"
    rows[2]["measurements"] = copy.deepcopy(rows[0]["measurements"])     # the plain loop's arithmetic exactly
    rows[2]["measurements"]["gradient_reduce_dtypes"] = ["float32"]
    parity = verdict_of_last(rows)
    assert parity.verdict is Verdict.MATCH and parity.tolerances[Quantity.GRADIENT_NORM_BY_TENSOR] == 2e-5
    assert "raised" not in parity.note


def test_a_row_left_with_step_0s_loss_alone_is_not_judged():
    # A row with no norms (the pipeline's) whose later losses the floor leaves out: weights that never change would
    # match on step 0's loss alone, so nothing is said.
    rng = random.Random(0)
    rows = [launch("plain", rng, 0), launch("plain", rng, 1), launch("pipeline", rng, 2)]
    losses = rows[0]["measurements"]["loss_per_step"]
    move = max(abs(b - a) for a, b in zip(losses[:3], losses[1:4]))
    rows[1]["measurements"]["loss_per_step"] = [losses[0]] + [loss + 0.013 * move for loss in losses[1:]]
    pipeline = rows[2]["measurements"]
    for quantity in [key for key in pipeline if "norm" in key]:
        del pipeline[quantity]
    pipeline["loss_per_step"] = [losses[0]] * len(losses)             # weights that never change
    parity = verdict_of_last(rows)
    assert parity.verdict is Verdict.NOT_JUDGED and "nothing beyond step 0's loss could be held" in parity.note


def test_a_quantity_no_other_plain_launch_read_is_left_out_not_held_to_the_cpu_tolerance():
    # The second plain launch was written before rows held norms by tensor: the GPU's noise there is unknown, so those
    # quantities are not judged (the CPU's 2e-5 would call honest GPU noise a mismatch); the rest still are.
    for seed in range(20):
        rng = random.Random(seed)
        rows = [launch("plain", rng, 0), launch("plain", rng, 1), launch("ddp", rng, 2)]
        del rows[1]["measurements"][GRADIENTS], rows[1]["measurements"][UPDATES]
        parity = verdict_of_last(rows)
        assert parity.verdict is Verdict.MATCH, (seed, parity)
        assert Quantity.GRADIENT_NORM_BY_TENSOR not in parity.tolerances
        assert "gradient_norm_by_tensor_first_step (no second launch of the plain loop read it)" in parity.note


def test_a_gpu_row_is_held_to_the_plain_loop_and_floor_of_its_own_gpu_model():
    # Rows of two GPU models read together: the H200's DDP row against the H200's plain loop, which ran once here (not
    # judged), never against the H100's two launches, whose floor says nothing of the H200's kernels.
    rng = random.Random(0)
    h100 = [launch("plain", rng, 0), launch("plain", rng, 1)]
    h200 = [launch("plain", rng, 2), launch("ddp", rng, 3, halve="12.ln_2.bias")]
    for row in h100:
        row["measurements"]["device_name"] = "NVIDIA H100 80GB HBM3"
    for row in h200:
        row["measurements"]["device_name"] = "NVIDIA H200"
    parity = verdict_of_last(h100 + h200)
    assert parity.verdict is Verdict.NOT_JUDGED and "it ran once among these rows" in parity.note
    h200.insert(1, launch("plain", rng, 4))
    h200[1]["measurements"]["device_name"] = "NVIDIA H200"
    parity = verdict_of_last(h100 + h200)
    assert parity.verdict is Verdict.MISMATCH and parity.tensors[Quantity.GRADIENT_NORM_BY_TENSOR] == "12.ln_2.bias"


def _elements() -> dict[str, int]:
    """Each GPT-2 small tensor's element count, from the workload built on the meta device."""
    from harness.project.facts import _meta_layers

    return {f"{index}.{name}": parameter.numel() for index, layer in enumerate(_meta_layers("gpt2-small"))
            for name, parameter in layer.named_parameters()}


ELEMENTS = _elements()


def reduced_in_bf16(elements: int, seed: int) -> float:
    """The relative change of a tensor's norm when two ranks' halves of its gradient are each cast to bf16 and summed
    into bf16 (ZeRO's reduce under its torch_autocast section, at two ranks): torch's own rounding, on standard-normal
    halves of `elements` elements (at most 2^20: beyond, the change is nothing either way)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(min(elements, 2 ** 20), generator=generator, dtype=torch.float64) for _ in range(2))
    reduced = (a.to(torch.bfloat16).double() + b.to(torch.bfloat16).double()).to(torch.bfloat16).double()
    return float(reduced.norm() / (a + b).norm() - 1)


ROUNDING = {name: reduced_in_bf16(count, seed) for seed, (name, count) in enumerate(sorted(ELEMENTS.items()))}


def zero_launch(strategy: str, rng: random.Random, index: int, scale: tuple[str, float] = ("", 1.0),
                noise: float = 1.0) -> dict:
    """A synthetic ZeRO launch of the H200 cell: GPU-like noise (x `noise`), then each tensor's gradient norm moved
    as its bf16 reduce moves it (`ROUNDING`, the same in every launch: rounding is a function of the gradient);
    `scale` multiplies one tensor's gradient (a planted error)."""
    row = launch(strategy, rng, index, noise=noise)
    m = row["measurements"]
    m["gradient_reduce_dtypes"] = ["bfloat16", "float32"]        # ZeRO's torch_autocast section: bf16-comm
    m[GRADIENTS] = {name: value * (1 + ROUNDING[name]) for name, value in m[GRADIENTS].items()}
    tensor, factor = scale
    if tensor:
        m[GRADIENTS][tensor] *= factor
    m["gradient_norm_first_step"] = math.sqrt(sum(v * v for v in m[GRADIENTS].values()))
    return row


def test_the_simulated_bf16_reduce_is_the_size_the_parity_docstring_says():
    # 768 elements (a LayerNorm): 1.4e-4 a standard deviation over draws; the largest over GPT-2 small's tensors under
    # the 5e-3 allowance, and over the bf16 tolerance (2e-5) that a row reducing in fp32 is held to.
    assert 3e-5 < abs(reduced_in_bf16(768, 0)) < 6e-4
    assert 2e-5 < max(abs(change) for change in ROUNDING.values()) < 5e-3


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_one_percent_error_on_one_tensor_is_caught_on_a_zero_row_and_its_bf16_rounding_is_not(strategy):
    # The 1% errors the CPU's bf16-comm tolerance (3e-2 by tensor) let pass on a GPU, on the noisiest tensor, one that
    # repeated exactly, and the largest; both ways.
    for seed in range(20):
        rng = random.Random(seed)
        plains = [launch("plain", rng, 0), launch("plain", rng, 1)]
        honest = verdict_of_last(plains + [zero_launch(strategy, rng, 2)])
        assert honest.verdict is Verdict.MATCH, (seed, honest)
        assert honest.tolerances[Quantity.GRADIENT_NORM_BY_TENSOR] < 1e-2     # 20 x the floor, or 5e-3
        for tensor in ("1.c_attn.bias", "12.mlp_proj.weight", "0.wte.weight"):
            for factor in (1.01, 0.99):
                planted = verdict_of_last(plains + [zero_launch(strategy, rng, 2, scale=(tensor, factor))])
                assert planted.verdict is Verdict.MISMATCH, (seed, tensor, factor, planted)
                assert planted.tensors[Quantity.GRADIENT_NORM_BY_TENSOR] == tensor


def test_a_one_percent_error_on_one_tensor_is_caught_on_every_data_parallel_row_that_computes_the_plain_loops_way():
    for strategy in ("ddp", "fsdp2", "horovod"):
        for seed in range(10):
            rng = random.Random(seed)
            rows = [launch("plain", rng, 0), launch("plain", rng, 1), launch(strategy, rng, 2)]
            rows[-1]["measurements"][GRADIENTS]["1.c_attn.bias"] *= 1.01
            parity = verdict_of_last(rows)
            assert parity.verdict is Verdict.MISMATCH, (strategy, seed, parity)


def test_on_a_gpu_whose_kernels_repeat_the_allowance_is_what_passes_zeros_rounding_and_nothing_more(monkeypatch):
    # No noise at all (the plain loop's launches identical, its floor 0): ZeRO's bf16 reduce alone is over the bf16
    # tolerance, so the allowance is what lets it match; without it, a mismatch. A 0.6% error is still caught.
    from harness.derive import parity

    rng = random.Random(0)
    plains = [launch("plain", rng, 0, noise=0), launch("plain", rng, 1, noise=0)]
    honest = verdict_of_last(plains + [zero_launch("zero2", rng, 2, noise=0)])
    assert honest.verdict is Verdict.MATCH and honest.tolerances[Quantity.GRADIENT_NORM_BY_TENSOR] == 5e-3
    for factor in (1.006, 0.994):
        planted = verdict_of_last(plains + [zero_launch("zero2", rng, 2, scale=("5.ln_2.weight", factor), noise=0)])
        assert planted.verdict is Verdict.MISMATCH and planted.tensors[Quantity.GRADIENT_NORM_BY_TENSOR] == "5.ln_2.weight"
    monkeypatch.setattr(parity, "COMM_ROUNDING_BY_TENSOR", 2e-5)        # the bf16 tolerance: no allowance
    assert verdict_of_last(plains + [zero_launch("zero2", rng, 2, noise=0)]).verdict is Verdict.MISMATCH


def test_an_fp16_row_on_a_gpu_is_held_to_the_same_rule():
    # DDP in fp16 (GradScaler, every gradient reduced in fp32): held to the fp16 set, whose gradient by tensor the rule
    # caps too; a 1% error on one tensor is caught.
    for seed in range(10):
        rng = random.Random(seed)
        rows = [launch("plain", rng, 0), launch("plain", rng, 1), launch("ddp", rng, 2)]
        for row in rows:
            row["spec"]["precision"] = "fp16"
        assert verdict_of_last(rows).verdict is Verdict.MATCH, seed
        rows[-1]["measurements"][GRADIENTS]["1.c_attn.bias"] *= 1.01
        parity = verdict_of_last(rows)
        assert parity.verdict is Verdict.MISMATCH and parity.tensors[Quantity.GRADIENT_NORM_BY_TENSOR] == "1.c_attn.bias"
