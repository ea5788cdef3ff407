"""fp16 with dynamic loss scaling (harness.strategies.loss_scaling) on every strategy that runs it on CPU, an overflow
planted in one rank's loss (harness.rank.faults, `overflow`), and what parity makes of skipped steps.

The launched cells: gpt-tiny at 2 ranks in fp16, every strategy, with rank 0's losses of step 1 multiplied by inf
(the other rank's are honest). torch's GradScaler starts at 2^10 and halves on an overflow, so its rows must read
applied [T, F, T, T, T] and scales 1024, 1024, 512, 512, 512; DeepSpeed's torch_autocast scaler starts at
torch's default 2^16 and, under ZeRO, never falls (its overflow check returns before the scaler's update), so
65536 throughout. The pipeline is skipped on CPU with its reason.

An inf in one rank's loss reaches every rank's gradients through the reductions (and tensor parallelism's
all-reduces), so it cannot tell whether a scaler shares its verdict. A third stream plants the overflow in one
rank's shard of a column-parallel weight alone (`tensors=*.c_fc.weight`), which no collective carries: the
tensor-parallel strategies must still skip on both ranks (fsdp2-tp with torch's own scaler did not).

A fourth makes every gradient 64 times larger on every rank and step (`grad-scale:factor=64:rank=all:step=0+`), a
model whose gradients a scale of 2^16 overflows in fp16 (65536 x 64 = 2^22 times the unscaled gradient, where
gpt-tiny's largest values overflow fp16's 65504) and 2^10 does not (2^16 times). torch's scaler applies every step at
1024; DeepSpeed's torch_autocast under ZeRO skips every one at 65536, never lowered: the case a benchmark must
report, not average over.
"""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from harness.derive.parity import Quantity, Verdict, arithmetic, judge
from harness.rank.faults import FAULT_ENV, Fault
from harness.spec import DeviceKind, Precision, RunSpec, Status
from harness.strategies import STRATEGIES
from harness.strategies.deepspeed_common import precision_config
from harness.strategies.loss_scaling import deepspeed_fp16_config, grad_scaler, scaler_step
from launch_streams import Stream, run_streams

SMOKE = Path(__file__).resolve().parents[1] / "results" / "reference" / "ci-cpu" / "smoke.jsonl"
OVERFLOW = "overflow:rank=0:step=1"
SHARD_OVERFLOW = "overflow:tensors=*.c_fc.weight:rank=0:step=1"
TOO_HIGH_A_SCALE = "grad-scale:factor=64:rank=all:step=0+"
STUCK = ("zero1", "zero3")
SPLIT = ("tp", "fsdp2-tp", "autotp")
TORCH_SCALED = ("plain", "ddp", "horovod", "fsdp2", "tp", "fsdp2-tp")
DEEPSPEED_SCALED = ("zero1", "zero2", "zero3", "autotp")


# ---- without launching ------------------------------------------------------------------------------------


def test_an_overflow_fault_multiplies_every_micro_batch_loss_of_its_step_by_inf():
    fault = Fault.parse(OVERFLOW)
    assert fault.loss_multipliers(0, 1, 3) == [math.inf] * 3
    assert fault.loss_multipliers(1, 1, 3) is None and fault.loss_multipliers(0, 0, 3) is None


def test_an_overflow_confined_to_some_tensors_leaves_the_losses_alone_and_multiplies_their_gradients_by_inf():
    fault = Fault.parse(SHARD_OVERFLOW)
    assert (fault.tensors, fault.factor) == ("*.c_fc.weight", math.inf)
    assert fault.loss_multipliers(0, 1, 3) is None


def test_the_scaler_skips_a_step_with_an_inf_gradient_and_halves_its_scale():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    scaler = grad_scaler(torch.device("cpu"))
    scaler.scale(torch.ones(()))                           # what a backward starts from: it sets the scale up
    weight.grad = torch.tensor([1.0, math.inf, 0.0])
    outcome = scaler_step(scaler, optimizer)
    assert (outcome.applied, outcome.loss_scale, scaler.get_scale()) == (False, 1024.0, 512.0)
    assert weight.detach().tolist() == [1.0, 1.0, 1.0]
    weight.grad = torch.tensor([512.0, 0.0, 0.0])        # 1 once unscaled by 512: the weight moves by lr x 1
    outcome = scaler_step(scaler, optimizer)
    assert (outcome.applied, outcome.loss_scale, scaler.get_scale()) == (True, 512.0, 512.0)
    assert weight.detach().tolist() == [0.5, 1.0, 1.0]
    scaler.update(0.0)                                     # a scale run down to 0 unscales by inf: never applied
    weight.grad = torch.tensor([0.0, 0.0, 0.0])
    assert scaler_step(scaler, optimizer).applied is False


def test_deepspeed_gets_torchs_rule_on_gpus_and_its_torch_autocast_section_on_cpu():
    # initial_scale_power 10 is 2^10 = 1024; hysteresis 1 lowers the scale at the first overflow, as torch does.
    assert deepspeed_fp16_config() == {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10,
                                                "loss_scale_window": 2000, "hysteresis": 1, "min_loss_scale": 1}}
    spec = RunSpec(workload="gpt-tiny", strategy="zero1", world_size=2, precision="fp16", device="cpu",
                   global_batch=16, micro_batch=4)
    assert precision_config(spec, {})[0] == {"torch_autocast": {"enabled": True, "dtype": "float16"}}
    on_gpu = spec.replace(device=DeviceKind.CUDA)
    assert precision_config(on_gpu, {})[0] == deepspeed_fp16_config()


def _zero3_trainer_with_gradients(fragments, recipe, scale, autocast_scale=None):
    """A DeepSpeedTrainer over a stand-in ZeRO-3 engine whose reduced fp32 partitions are `fragments` and whose
    fp16 optimizer's scale is `scale` (DeepSpeed's fp16 section runs on GPUs alone: its arithmetic is not needed to
    check what the probe divides by)."""
    from types import SimpleNamespace

    from harness.strategies.base import PrecisionRecipe, RankContext
    from harness.strategies.zero import DeepSpeedTrainer

    parameters = []
    for fragment in fragments:
        parameter = torch.nn.Parameter(torch.zeros(1))
        parameter._z3_optimizer = SimpleNamespace(get_local_fp32_grad_for_param=lambda p, f=fragment: f)
        parameters.append(parameter)
    optimizer = SimpleNamespace(cur_scale=scale)
    if autocast_scale is not None:      # DeepSpeed's torch_autocast section in float16 (the CPU's fp16) keeps one
        optimizer.torch_autocast_gradscaler = SimpleNamespace(get_scale=lambda: autocast_scale)
    engine = SimpleNamespace(zero_optimization_stage=lambda: 3, optimizer=optimizer,
                             module=SimpleNamespace(parameters=lambda: iter(parameters)))
    context = RankContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                          backend="gloo", shared_device=False)
    return DeepSpeedTrainer(context=context, engine=engine, precision_recipe=PrecisionRecipe(recipe))


def test_zero_fp16_sections_gradients_are_read_divided_by_its_loss_scale():
    # Recorded on the H200 at a3663fd: ZeRO-2 in fp16 read wte's gradient norm as 267.85, the plain loop and DDP
    # 0.26157; its first loss scale was 2^10. A stand-in gradient of that norm at that scale must read 0.26157 tensor by
    # tensor, to parity's fp16 tolerance by tensor (3e-2; by hand 267.85 / 1024 = 0.261572).
    wte = torch.full((4, 4), 267.85 / 4, dtype=torch.float16)          # norm 267.85 (16 values of 66.96)
    trainer = _zero3_trainer_with_gradients([wte], "deepspeed-fp16", 1024.0)
    (norm,) = trainer.tensor_norms(*trainer.local_gradients())
    assert abs(norm - 0.26157) / 0.26157 < 1e-3
    # A small fp16 gradient the scale kept out of underflow is divided in fp32: 2e-7 survives (fp16's smallest
    # subnormal is 6e-8, and 2e-7 x 1024 / 1024 in fp16 would round to a multiple of it).
    small = torch.full((1,), 2e-7 * 1024, dtype=torch.float16)
    (read,) = _zero3_trainer_with_gradients([small], "deepspeed-fp16", 1024.0).local_gradients()[0]
    assert read.dtype == torch.float32 and abs(float(read) / 2e-7 - 1) < 1e-3


def test_zero_gradients_are_read_as_they_are_where_nothing_scaled_them():
    # bf16 and fp32 carry no scale, and autocast without a GradScaler (bf16) none either: the stand-in's cur_scale
    # must not be applied there.
    gradient = torch.full((4,), 2.0)
    for recipe in ("autocast", "deepspeed-bf16", "fp32"):
        trainer = _zero3_trainer_with_gradients([gradient], recipe, 1024.0)
        assert trainer.tensor_norms(*trainer.local_gradients()) == [4.0]


def test_zero_under_torch_autocast_float16_reads_its_gradients_and_norm_divided_by_the_gradscalers_scale():
    # Issue 61: DeepSpeed's torch_autocast section in float16 (the CPU's fp16 recipe) unscales only inside its
    # optimizer step, so its reduced gradients and its own norm carry the GradScaler's scale: ZeRO-2's rows on CPU read
    # per-tensor norms 65,536 (2^16, GradScaler's first scale) times the plain loop's. A gradient of norm 4 x 65,536
    # must read 4, and so must the engine's norm of 4 x 65,536 once the step's backward scale is known.
    gradient = torch.full((4,), 2.0 * 65536)
    trainer = _zero3_trainer_with_gradients([gradient], "autocast", 1.0, autocast_scale=65536.0)
    assert trainer.tensor_norms(*trainer.local_gradients()) == [4.0]
    trainer.engine.get_global_grad_norm = lambda: 4.0 * 65536
    trainer.backward_scale = 65536.0
    assert trainer.gradient_norm() == 4.0
    # The fp16 section's own norm is already divided by its scale: not divided again.
    sectioned = _zero3_trainer_with_gradients([gradient], "deepspeed-fp16", 1024.0)
    sectioned.engine.get_global_grad_norm, sectioned.backward_scale = (lambda: 0.26157), 1024.0
    assert sectioned.gradient_norm() == 0.26157


def test_the_pipeline_skips_fp16_on_cpu_with_its_reason():
    spec = RunSpec(workload="gpt-tiny", strategy="pipeline", world_size=2, precision=Precision.FP16, device="cpu",
                   global_batch=16, micro_batch=4)
    assert "the first stage fails" in STRATEGIES["pipeline"].skip_reason(spec)


@pytest.fixture
def pair():
    """The smoke file's plain and DDP gpt-tiny rows, as fp16 rows that applied every step."""
    rows = {row["spec"]["strategy"]: row for row in map(json.loads, SMOKE.read_text().splitlines())}
    pair = []
    for name in ("plain", "ddp"):
        row = copy.deepcopy(rows[name])
        row["spec"]["precision"] = "fp16"
        steps = len(row["measurements"]["loss_per_step"])
        row["measurements"].update(precision_recipe="autocast", gradient_reduce_dtypes=["float32"],
                                   optimizer_step_applied=[True] * steps, loss_scale_per_step=[1024.0] * steps)
        pair.append(row)
    return pair


def test_fp16_rows_that_skip_the_same_steps_are_judged_on_their_losses(pair):
    plain, ddp = pair
    for row in pair:
        row["measurements"]["optimizer_step_applied"][1] = False
    assert arithmetic(ddp) == "fp16"
    assert judge([plain, ddp])[1].verdict is Verdict.MATCH
    ddp["measurements"]["loss_per_step"][3] += 0.1          # and still on them
    assert judge([plain, ddp])[1].verdict is Verdict.MISMATCH


def test_an_fp16_row_that_skipped_another_step_is_a_mismatch_naming_both(pair):
    plain, ddp = pair
    ddp["measurements"]["optimizer_step_applied"][2] = False
    parity = judge([plain, ddp])[1]
    assert parity.verdict is Verdict.MISMATCH
    assert "this row skipped 2, the reference none" in parity.note


def test_a_step_skipped_after_the_compared_losses_is_still_a_mismatch(pair):
    plain, ddp = pair
    ddp["measurements"]["optimizer_step_applied"][12] = False        # the last of 13 steps
    parity = judge([plain, ddp])[1]
    assert parity.verdict is Verdict.MISMATCH and "this row skipped 12, the reference none" in parity.note


def test_ranks_that_disagree_on_a_step_are_a_mismatch_though_the_step_counts_as_skipped(pair):
    plain, ddp = pair
    plain["measurements"]["optimizer_step_applied"][1] = False
    ddp["measurements"]["optimizer_step_applied"][1] = False         # all(...) over the ranks: False
    applied = ddp["measurements"]["optimizer_step_applied"]
    ddp["measurements"]["optimizer_step_applied_by_rank"] = [applied, [True] * len(applied)]
    parity = judge([plain, ddp])[1]
    assert parity.verdict is Verdict.MISMATCH and "the ranks disagreed on applying optimizer steps 1" in parity.note


def test_rows_that_both_skipped_step_0_are_judged_on_losses_not_on_its_inf_norms(pair):
    for row in pair:
        row["measurements"]["optimizer_step_applied"][0] = False
        row["measurements"].update(gradient_norm_first_step=math.inf, parameter_norm_after_first_step=25.3,
                                   update_norm_first_step=0.0)
    parity = judge(pair)[1]
    assert parity.verdict is Verdict.MATCH, parity
    assert "step 0, whose norms are read, was skipped" in parity.note
    assert Quantity.GRADIENT_NORM not in parity.deviations


def test_an_fp16_row_that_skipped_every_step_is_a_mismatch_whatever_its_losses(pair):
    plain, ddp = pair
    ddp["measurements"]["optimizer_step_applied"] = [False] * len(ddp["measurements"]["loss_per_step"])
    ddp["measurements"]["loss_scale_per_step"] = [65536.0] * len(ddp["measurements"]["loss_per_step"])
    parity = judge([plain, ddp])[1]
    assert parity.verdict is Verdict.MISMATCH
    assert "every one of the 13 optimizer steps was skipped" in parity.note
    assert "(loss scale 65536, never lowered)" in parity.note
    ddp["measurements"]["loss_scale_per_step"] = [2.0 ** (16 - step) for step in range(13)]    # backing off
    assert "(loss scale 16, 32, 64" in judge([plain, ddp])[1].note and "never lowered" not in judge([plain, ddp])[1].note


# ---- launched ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp16_streams(tmp_path_factory):
    """Every strategy in fp16 on gpt-tiny at 2 ranks (the plain loop at 1), the overflow planted, in two streams (the
    DeepSpeed strategies in the second); and the tensor-parallel ones with the overflow in one shard, a third."""
    # Every built-in strategy but DataParallel (CUDA only), named: another test may register one more.
    fp16 = ("--workload", "gpt-tiny", "--world-sizes", "2", "--precision", "fp16", "--strategy")
    streams = [Stream(f"fp16-{n}", (*fp16, ",".join(group)), {FAULT_ENV: OVERFLOW})
               for n, group in enumerate((TORCH_SCALED, (*DEEPSPEED_SCALED, "pipeline")))]
    streams.append(Stream("fp16-shard", (*fp16, ",".join(SPLIT)), {FAULT_ENV: SHARD_OVERFLOW}))
    streams.append(Stream("fp16-too-high", (*fp16, ",".join(("plain", *STUCK))), {FAULT_ENV: TOO_HIGH_A_SCALE}))
    return run_streams(tmp_path_factory.mktemp("fp16"), streams)


@pytest.fixture(scope="module")
def fp16_rows(fp16_streams):
    """{strategy: row} with the overflow in rank 0's loss."""
    return {row.spec.strategy: row for name in ("fp16-0", "fp16-1") for row in fp16_streams[name]}


@pytest.mark.launch
@pytest.mark.matrix
@pytest.mark.parametrize("strategy", TORCH_SCALED + DEEPSPEED_SCALED)
def test_every_rank_of_every_strategy_skips_the_planted_overflow_and_no_other_step(fp16_rows, strategy):
    row = fp16_rows[strategy]
    assert row.status is Status.OK, row.message
    assert row.environment["env"][FAULT_ENV] == OVERFLOW and row.spec.precision == "fp16"
    applied = [True, False, True, True, True]
    assert row.measurements["optimizer_step_applied"] == applied
    assert row.measurements["optimizer_step_applied_by_rank"] == [applied] * row.spec.world_size
    assert all(math.isfinite(loss) for loss in row.measurements["loss_per_step"])


@pytest.mark.launch
@pytest.mark.matrix
@pytest.mark.parametrize("strategy", TORCH_SCALED)
def test_torchs_scaler_starts_at_2_to_the_10_and_halves_at_the_overflow_then_parity_matches(fp16_rows, strategy):
    row = fp16_rows[strategy]
    assert row.measurements["loss_scale_per_step"] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    if strategy != "plain":
        parity = judge([row.to_dict(), fp16_rows["plain"].to_dict()])[0]
        assert parity.verdict is Verdict.MATCH, parity


@pytest.mark.launch
@pytest.mark.matrix
@pytest.mark.parametrize("strategy", DEEPSPEED_SCALED)
def test_zero_under_torch_autocast_fp16_keeps_its_scale_and_its_gradients_read_unscaled_match(fp16_rows, strategy):
    """The overflow is skipped, but the scale stays at 2^16; the gradients read between reduction and update (and
    DeepSpeed's own norm of them) carry it, and are read divided by it (issue 61: they were 65536 times the plain
    loop's, a mismatch on losses that agreed), so parity matches."""
    row = fp16_rows[strategy]
    assert row.measurements["loss_scale_per_step"] == [65536.0] * 5
    parity = judge([row.to_dict(), fp16_rows["plain"].to_dict()])[0]
    assert parity.verdict is Verdict.MATCH, parity


@pytest.mark.launch
@pytest.mark.matrix
@pytest.mark.parametrize("strategy", SPLIT)
def test_an_overflow_in_one_ranks_shard_alone_skips_the_step_on_every_rank(fp16_streams, fp16_rows, strategy):
    row = next(row for row in fp16_streams["fp16-shard"] if row.spec.strategy == strategy)
    assert row.status is Status.OK and row.environment["env"][FAULT_ENV] == SHARD_OVERFLOW, row.message
    applied = [True, False, True, True, True]
    assert row.measurements["optimizer_step_applied_by_rank"] == [applied, applied]
    assert judge([row.to_dict(), fp16_rows["plain"].to_dict()])[0].verdict is Verdict.MATCH


@pytest.mark.launch
@pytest.mark.matrix
def test_zero_under_torch_autocast_skips_every_step_where_its_scale_is_too_high_and_parity_says_so(fp16_streams):
    rows = {row.spec.strategy: row for row in fp16_streams["fp16-too-high"]}
    assert all(row.status is Status.OK for row in rows.values()), [row.message for row in rows.values()]
    plain = rows["plain"].measurements
    assert plain["optimizer_step_applied"] == [True] * 5 and plain["loss_scale_per_step"] == [1024.0] * 5
    for strategy in STUCK:
        m = rows[strategy].measurements
        assert m["optimizer_step_applied_by_rank"] == [[False] * 5] * 2, strategy
        assert m["loss_scale_per_step"] == [65536.0] * 5, strategy
        parity = judge([rows[strategy].to_dict(), rows["plain"].to_dict()])[0]
        assert parity.verdict is Verdict.MISMATCH and parity.note == (
            "every one of the 5 optimizer steps was skipped on an inf/NaN gradient (loss scale 65536, never lowered): "
            "the weights never changed"), (strategy, parity)


@pytest.mark.launch
@pytest.mark.matrix
def test_the_pipeline_row_is_skipped_with_its_reason(fp16_rows):
    row = fp16_rows["pipeline"]
    assert row.status is Status.SKIPPED and "the first stage fails" in row.message


def test_autotp_reads_its_fp16_gradients_divided_by_the_loss_scale_as_zero_does():
    # AutoTP's trainer takes its parts of the reduced gradients itself (and its whole-model norm from them): under the
    # fp16 section they carry ZeRO's scale too. A stage-1 stand-in whose wte fragment has norm 267.85 at scale 2^10.
    from types import SimpleNamespace

    from harness.strategies.autotp import AutoTPTrainer
    from harness.strategies.base import PrecisionRecipe, RankContext

    wte = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float16))
    fragment = torch.full((16,), 267.85 / 4, dtype=torch.float16)
    wte._hp_mapping = SimpleNamespace(get_lp_grad_fragment=lambda index: fragment)
    wte._index_in_param_group = 0
    embedding, module = torch.nn.Module(), torch.nn.Module()
    embedding.register_parameter("weight", wte)
    module.add_module("wte", embedding)           # named wte.weight, as AutoTP's name rules expect
    engine = SimpleNamespace(zero_optimization_stage=lambda: 1, optimizer=SimpleNamespace(cur_scale=1024.0), module=module)
    context = RankContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                          backend="gloo", shared_device=False)
    trainer = AutoTPTrainer(context=context, engine=engine, precision_recipe=PrecisionRecipe.DEEPSPEED_FP16)
    (norm,) = trainer.tensor_norms(*trainer.local_gradients())
    assert abs(norm / 0.26157 - 1) < 1e-3 and abs(trainer.gradient_norm() / 0.26157 - 1) < 1e-3


def test_the_bare_loop_records_what_the_loss_scaler_did_as_the_plain_loop_does():
    # fp16 on this CPU, in this process: its steps' outcomes are in its row, so parity compares its skipped steps with
    # the plain loop's instead of taking it for a loop that applied every step.
    from harness.rank.bare_loop import run_bare_loop

    spec = RunSpec(workload="gpt-tiny", strategy="bare", world_size=1, global_batch=4, micro_batch=4,
                   precision=Precision.FP16, warmup_steps=1, timed_steps=2)
    strategy = STRATEGIES["bare"]
    figures = run_bare_loop(spec, strategy, strategy.start(spec))
    assert figures["optimizer_step_applied"] == [True, True, True]
    assert figures["optimizer_step_applied_by_rank"] == [[True, True, True]]
    assert figures["loss_scale_per_step"] == [1024.0] * 3           # harness.strategies.loss_scaling.INITIAL_SCALE
    assert figures["gradient_reduce_dtypes"] == [] and figures["loop_steps"] == 2
