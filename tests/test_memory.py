"""Memory figures against hand counts: what each rank holds as model states, what its strategy predicts,
peak RSS since the first timed step, and DeepSpeed's largest-layer figure.

gpt-tiny by hand (workloads/gpt.py: vocab 512, 64 positions, 4 blocks of width 64):
    token embedding  wte 512 x 64 = 32,768 + wpe 64 x 64 = 4,096          = 36,864
    block            12 x 64^2 + 13 x 64 = 49,152 + 832                   = 49,984   (x 4 = 199,936)
    final LayerNorm  2 x 64                                               =    128
    head             the token embedding's wte (tied: counted once)
    Psi = 36,864 + 199,936 + 128 = 236,928 parameters in 2 + 4 x 12 + 2 = 52 tensors.

The census counts storages, so besides the plan's bytes it finds AdamW's `step`, a 4-byte scalar tensor per
parameter tensor the optimizer updates (52 here; 1 for DeepSpeed's one flat partition). Nothing is padded
here: every gpt-tiny parameter's first dimension is even (FSDP2 shards dim 0 over 2 ranks) and Psi is a
multiple of 4 (DeepSpeed aligns its flat buffers to 2 elements x 2 ranks), so the tolerance is zero.
"""

import gc
import math

import pytest
import torch
from torch import nn

from harness.derive.memory import (STORED_SCHEMA_1, model_state_comparison, plan_bytes, predicted_model_states)
from harness.rank.memory_model import (MIB, OUTSIDE_CENSUS_FLAG_BYTES, ModelStateReader, ModelStateTensors,
                                       PeakRssSince, census_bytes, largest_module_own_parameters, outside_census,
                                       peak_memory, reset_peak_memory, resident_bytes, torch_model_state_tensors,
                                       untracked_tensor_bytes)
from harness.record import read_results
from harness.runner import RunOptions, run_specs
from harness.spec import RunSpec, Status
from harness.strategies import STRATEGIES, PrecisionRecipe
from harness.strategies.plain import plain_trainer
from workloads import WORKLOADS, count_parameters

PSI = 236_928
TENSORS = 52
STEP = 4                     # bytes of one AdamW step counter
MB = 1 << 20


# ---- peak RSS -----------------------------------------------------------------------------------


def _touch(megabytes: int) -> bytes:
    return b"\x01" * (megabytes * MB)      # written, so resident (unlike a calloc'd bytearray)


def test_peak_rss_reset_forgets_an_allocation_freed_before_it():
    block = _touch(200)
    before = peak_memory(torch.device("cpu"), PeakRssSince.FIRST_TIMED_STEP)["peak_rss"]
    del block
    since = reset_peak_memory(torch.device("cpu"))
    assert since is PeakRssSince.FIRST_TIMED_STEP          # this machine's kernel lets a process reset VmHWM
    small = _touch(10)
    after = peak_memory(torch.device("cpu"), since)["peak_rss"]
    del small
    # `before` held the 200 MB block; `after` saw only the 10 MB one on top of what is resident now.
    assert after < before - 150 * MB, (before / MB, after / MB)


def test_peak_rss_falls_back_to_the_process_peak_where_it_cannot_be_reset(monkeypatch, tmp_path):
    monkeypatch.setattr("harness.rank.memory_model.CLEAR_REFS", tmp_path / "no-such-dir" / "clear_refs")
    since = reset_peak_memory(torch.device("cpu"))
    assert since is PeakRssSince.PROCESS_START
    import resource
    assert peak_memory(torch.device("cpu"), since)["peak_rss"] >= resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- gpt2-small by hand: DeepSpeed's largest layer, and pipeline stages with a tied embedding --------

WTE = 50_304 * 768                     # 38,633,472: the vocabulary padded to a multiple of 64 (workloads/gpt.py)
WPE = 1_024 * 768                      #    786,432
EMBEDDING = WTE + WPE                  # 39,419,904: TokenEmbedding, wte and wpe
BLOCK = 12 * 768**2 + 13 * 768         #  7,087,872
LN_F = 2 * 768                         #      1,536


def _gpt2_small_on_meta() -> list[nn.Module]:
    with torch.device("meta"):          # shapes only: no 500 MB of weights
        return WORKLOADS["gpt2-small"].build_layers()


def test_hand_counts_of_gpt2_small_add_up_to_the_published_size_and_its_padded_rows():
    # Published: 124,439,808 with 50,257 rows; 47 padded rows of 768 more.
    assert EMBEDDING + 12 * BLOCK + LN_F == 124_439_808 + 47 * 768 == 124_475_904 \
        == count_parameters(nn.Sequential(*_gpt2_small_on_meta()))


def test_largest_module_own_parameters_of_gpt2_small_is_the_token_embedding_matrix():
    layers = _gpt2_small_on_meta()
    # DeepSpeed's largest_layer_params: the most parameters one module holds itself, here nn.Embedding wte
    # (and the head, which holds the same matrix); not a whole top-level layer (TokenEmbedding adds wpe).
    assert largest_module_own_parameters(nn.Sequential(*layers)) == WTE == 38_633_472
    old_top_level_figure = max(count_parameters(layer) for layer in layers)
    assert old_top_level_figure == EMBEDDING == 39_419_904
    from deepspeed.runtime.zero.stage3 import model_to_params      # DeepSpeed's own count, for comparison
    assert model_to_params(nn.Sequential(*layers))[1] == WTE


def test_gpt2_small_pipeline_stages_each_hold_the_tied_embedding():
    # DeepSpeed's partition_method "parameters" balances the layers' counts, counting each TiedLayerSpec as
    # the whole module it builds: [39,419,904, 12 x 7,087,872, 1,536, 39,419,904], 163,895,808 in all,
    # cut at 81,947,904 -> stage 0 = embedding + 6 blocks, stage 1 = 6 blocks + final norm + head, and the
    # head's stage builds its own TokenEmbedding (wte and wpe) to hold the tied matrix.
    stage_0 = EMBEDDING + 6 * BLOCK                # 39,419,904 + 42,527,232 = 81,947,136
    stage_1 = 6 * BLOCK + LN_F + EMBEDDING         # 42,527,232 + 1,536 + 39,419,904 = 81,948,672
    assert (stage_0, stage_1) == (81_947_136, 81_948_672)
    from deepspeed.runtime.utils import partition_balanced
    assert partition_balanced([EMBEDDING, *[BLOCK] * 12, LN_F, EMBEDDING], 2) == [0, 7, 15]

    plan = STRATEGIES["pipeline"].model_state_plan(1, PrecisionRecipe.FP32, STRATEGIES["pipeline"].resolve_options({}))
    predicted = predicted_model_states({"model_state_plan": plan.to_dict(), "parameters_held_by_rank": [stage_0,
                                                                                                        stage_1]})
    # fp32 AdamW, unsharded: 4 + 4 + 8 = 16 bytes per parameter held.
    assert [p["total"] for p in predicted] == [16 * 81_947_136, 16 * 81_948_672] == [1_311_154_176, 1_311_178_752]
    # The old per-stage figure, parameters / stages, is 24% short of either stage.
    old = 16 * 124_475_904 / 2                    # 995,807,232
    assert 1 - old / predicted[0]["total"] > 0.24


# ---- what a reading after zero_grad would have seen (finding: 12 bytes per parameter, not 16) -----


def test_plain_loop_holds_16_bytes_per_parameter_at_gradients_ready_and_12_after_zero_grad():
    spec = RunSpec(workload="gpt-tiny", strategy="plain", world_size=1, global_batch=4, micro_batch=4)
    context = STRATEGIES["plain"].start(spec)
    workload = WORKLOADS["gpt-tiny"]
    torch.manual_seed(0)
    trainer = plain_trainer(spec, context, workload, nn.Sequential(*workload.build_layers()))
    batch = [workload.batch(0, 0, torch.arange(4), context.device)]
    trainer.train_step(batch)                                  # AdamW's state exists from here on
    at_ready = {}
    trainer.train_step(batch, lambda: at_ready.update(census_bytes(trainer.model_state_tensors())))
    after_step = census_bytes(trainer.model_state_tensors())
    assert at_ready == {"weights": 4 * PSI, "gradients": 4 * PSI, "optimizer": 8 * PSI + TENSORS * STEP}
    assert after_step == {"weights": 4 * PSI, "gradients": 0, "optimizer": 8 * PSI + TENSORS * STEP}


def test_model_states_are_unavailable_with_fewer_than_two_warmup_steps():
    reader = ModelStateReader(trainer=None, device=torch.device("cpu"), warmup_steps=1)
    assert "warmup_steps >= 2" in reader.unavailable_because
    assert reader.gradients_ready(0, []) is None


# ---- memory outside the census ------------------------------------------------------------------


def _linear_after_one_adamw_step():
    """nn.Linear(3, 2) (8 parameters in 2 tensors) and its AdamW after one update, which makes AdamW's state:
    by hand its census is 32 bytes of weights, 32 of gradients and 2 x 32 of moments + 2 x 4 of steps = 72."""
    from harness.strategies.base import make_adamw

    model = nn.Linear(3, 2)
    optimizer = make_adamw(model.parameters(), torch.device("cpu"))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _untracked(states, inputs=()) -> int:
    gc.collect()
    return untracked_tensor_bytes(states, inputs)


NOTHING = ModelStateTensors(weights=[], gradients=None, optimizer=[])


def test_tensors_outside_the_census_leave_out_the_census_storages_and_the_inputs():
    model, optimizer = _linear_after_one_adamw_step()
    states = torch_model_state_tensors(model, optimizer)
    assert census_bytes(states) == {"weights": 32, "gradients": 32, "optimizer": 72}
    inputs = [torch.ones(4, 3), torch.zeros(4, dtype=torch.int64)]          # 48 + 32 bytes
    # Every other tensor of this process (pytest's, torch's own) is found too: compare, never count from zero.
    everything = _untracked(NOTHING)
    assert everything - _untracked(states) == 32 + 32 + 72
    assert _untracked(states) - _untracked(states, inputs) == 48 + 32


def test_tensors_outside_the_census_count_each_storage_once_and_not_a_view_of_a_counted_one():
    model, optimizer = _linear_after_one_adamw_step()
    states = torch_model_state_tensors(model, optimizer)
    before = _untracked(states)
    views = [model.weight.detach()[0], model.weight.grad.view(-1)]        # views of census storages: nothing
    assert _untracked(states) == before
    copy = torch.zeros(1000)                                                # 4,000 bytes outside the census
    halves = copy[:500], copy[500:]                                         # its views: the same storage
    assert _untracked(states) == before + 4000
    del views, copy, halves
    assert _untracked(states) == before


def test_the_gap_is_the_resident_growth_less_the_census_and_flagged_above_the_devices_size():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    census = 10 * MIB
    assert outside_census(100 * MIB, census, cpu) == (90 * MIB, False)
    assert outside_census(census + OUTSIDE_CENSUS_FLAG_BYTES["cpu"], census, cpu) == (
        OUTSIDE_CENSUS_FLAG_BYTES["cpu"], False)                            # at the size: not above it
    assert outside_census(census + OUTSIDE_CENSUS_FLAG_BYTES["cpu"] + 1, census, cpu)[1]
    # The allocator counts tensors alone: the GPU's size is the smaller, and 90 MiB is above it.
    assert OUTSIDE_CENSUS_FLAG_BYTES["cuda"] < OUTSIDE_CENSUS_FLAG_BYTES["cpu"]
    assert outside_census(100 * MIB, census, cuda) == (90 * MIB, True)
    assert outside_census(5 * MIB, census, cpu) == (-5 * MIB, False)       # freed since the baseline
    assert outside_census(None, census, cpu) == (None, False)               # no growth read: no gap, no flag


class _HandTrainer:
    """The one method and flag ModelStateReader asks a trainer for, over a hand-built model and AdamW."""

    reaches_gradients_ready = True

    def __init__(self) -> None:
        self.model, self.optimizer = _linear_after_one_adamw_step()

    def model_state_tensors(self) -> ModelStateTensors:
        return torch_model_state_tensors(self.model, self.optimizer)


def test_the_reading_records_tensors_outside_the_census_and_the_gap_of_the_resident_growth():
    trainer = _HandTrainer()
    reader = ModelStateReader(trainer, torch.device("cpu"), warmup_steps=2, resident_before=resident_bytes(
        torch.device("cpu")))
    batch = [(torch.ones(4, 3), torch.zeros(4, dtype=torch.int64))]
    reader.gradients_ready(1, batch)()
    assert reader.census == {"weights": 32, "gradients": 32, "optimizer": 72}
    assert reader.untracked == _untracked(trainer.model_state_tensors(), batch[0])
    assert reader.resident_growth is not None                # Linux: RssAnon is readable
    assert reader.outside_census == reader.resident_growth - (32 + 32 + 72)
    assert reader.flagged is (reader.outside_census > OUTSIDE_CENSUS_FLAG_BYTES["cpu"])
    # No baseline (a reader built without one): no growth, no gap, no flag; the tensors are still counted.
    blind = ModelStateReader(trainer, torch.device("cpu"), warmup_steps=2)
    blind.gradients_ready(1, batch)()
    assert (blind.resident_growth, blind.outside_census, blind.flagged) == (None, None, False)
    assert blind.untracked is not None


# ---- real launches: the census at gradients_ready against the strategy's plan ---------------------
# tests/conftest.py's fp32 cells on gpt-tiny (two warm-up steps: the census is read in the second, once the
# optimizer holds its state), and ZeRO-3 once more with a persistence threshold that shards one tensor.

ZERO3_OPTIONS = {"param_persistence_threshold": 20_000}   # wte (32,768 elements) is above it, the rest below
FROM_SESSION = ("plain", "ddp", "fsdp2", "zero1", "zero2", "pipeline")


@pytest.fixture(scope="module")
def rows(gpt_tiny_fp32, tmp_path_factory):
    """{name: row}: the session's fp32 gpt-tiny rows, and ZeRO-3 with ZERO3_OPTIONS at the same batch and steps."""
    out = tmp_path_factory.mktemp("memory") / "rows.jsonl"
    plain = gpt_tiny_fp32["plain"].spec
    run_specs([plain.replace(strategy="zero3", world_size=2, options=ZERO3_OPTIONS)],
              RunOptions(results=out, timeout_s=300))
    [zero3] = read_results([out])
    return {**{name: gpt_tiny_fp32[name] for name in FROM_SESSION}, "zero3": zero3}


def _census(rows, name):
    row = rows[name]
    assert row.status is Status.OK, row.message
    assert row.measurements["model_state_read_at"].startswith("gradients_ready of warm-up step 1") or name == "pipeline"
    return row.measurements["model_state_census_bytes_by_rank"]


@pytest.mark.launch
@pytest.mark.parametrize("name", ["plain", "ddp"])
def test_unsharded_census_is_16_bytes_per_parameter(rows, name):
    # DDP's gradients are views of its buckets (gradient_as_bucket_view), one storage counted once.
    for census in _census(rows, name):
        assert census == {"weights": 4 * PSI, "gradients": 4 * PSI, "optimizer": 8 * PSI + TENSORS * STEP}
    assert [p["total"] for p in predicted_model_states(rows[name].measurements)] == [16 * PSI] * len(
        rows[name].measurements["parameters_held_by_rank"])


@pytest.mark.launch
def test_fsdp2_census_is_its_plan_sharded_over_two_ranks(rows):
    # Every rank: 4 x Psi / 2 of weights and gradients, 8 x Psi / 2 of moments, and a step per tensor.
    for census in _census(rows, "fsdp2"):
        assert census == {"weights": 2 * PSI, "gradients": 2 * PSI, "optimizer": 4 * PSI + TENSORS * STEP}
    for line in model_state_comparison(rows["fsdp2"].measurements):
        assert line["predicted"]["total"] == 8 * PSI
        assert math.isclose(line["census_over_predicted"], 1 + TENSORS * STEP / (8 * PSI))


@pytest.mark.launch
def test_zero_keeps_an_fp32_master_partition_so_its_optimizer_holds_12_bytes_per_parameter(rows):
    for name in ("zero1", "zero2", "zero3"):
        for census, predicted in zip(_census(rows, name), predicted_model_states(rows[name].measurements)):
            # master weights 4 + momentum 4 + variance 4 over 2 ranks, and the one flat partition's step
            assert census["optimizer"] == 6 * PSI + STEP == predicted["optimizer"] + STEP


@pytest.mark.launch
def test_zero1_and_zero2_hold_the_gradients_of_their_partition_and_of_the_parameter_it_cuts(rows):
    # Stages 1/2 flatten the parameters in model order and cut the flat buffer at Psi / 2 = 118,464. Block 1's
    # c_fc.weight (64 x 256 = 16,384) spans flat elements 103,744..120,128 and is cut: after the reduction
    # each rank keeps the reduced gradients of the parameters in its partition, that one whole on both.
    # rank 0: elements [0, 120,128) -> 480,512 bytes; rank 1: [103,744, 236,928) = 133,184 -> 532,736 bytes.
    for name in ("zero1", "zero2"):
        census = _census(rows, name)
        assert [c["weights"] for c in census] == [4 * PSI] * 2           # the whole flat buffer, 4 x Psi
        assert [c["gradients"] for c in census] == [480_512, 532_736]
    # ZeRO-2's plan shards gradients (4 x Psi / 2 = 473,856): the cut parameter is its whole gap. ZeRO-1's
    # plan (the paper's P_os) keeps them whole, 4 x Psi = 947,712; DeepSpeed 0.19 frees the reduced
    # gradients outside the partition before the update, so at gradients_ready it holds about half of that.
    assert [p["gradients"] for p in predicted_model_states(rows["zero2"].measurements)] == [2 * PSI] * 2
    assert [p["gradients"] for p in predicted_model_states(rows["zero1"].measurements)] == [4 * PSI] * 2


@pytest.mark.launch
def test_zero3_shards_weights_but_keeps_persistent_parameters_whole(rows):
    m = rows["zero3"].measurements
    kept_whole = PSI - 32_768                      # all but wte: at or below the 20,000-element threshold
    assert m["weights_kept_whole_parameters_by_rank"] == [kept_whole] * 2
    for census, predicted in zip(_census(rows, "zero3"), predicted_model_states(m)):
        # every parameter's shard (4 x Psi / 2) plus the persistent ones whole (4 x 204,160)
        assert census["weights"] == 2 * PSI + 4 * kept_whole == 1_290_496 == predicted["weights"]
        assert census["gradients"] == 2 * PSI == predicted["gradients"]


@pytest.mark.launch
def test_deepspeed_zero3_estimate_uses_the_largest_module_own_parameters(rows):
    m = rows["zero3"].measurements
    assert m["largest_module_own_parameters"] == 512 * 64           # wte; a whole block would be 49,984
    # estimate_zero3_model_states_mem_needs without offload: 4 x largest + int(18 x Psi / GPUs)
    assert m["model_state_bytes_deepspeed_estimate"] == 4 * 32_768 + 18 * PSI // 2 == 2_263_424


@pytest.mark.launch
def test_pipeline_stages_hold_their_layers_and_the_tied_embedding_copy(rows):
    m = rows["pipeline"].measurements
    # Stage 0: embedding + 2 blocks = 36,864 + 99,968; stage 1: 2 blocks + final norm + the token
    # embedding's copy (wte and wpe) = 99,968 + 128 + 36,864. Psi / 2 would be 118,464 for each.
    assert m["parameters_held_by_rank"] == [136_832, 136_960]
    census = _census(rows, "pipeline")
    # Read after train_batch: gradients released; weights 4 and moments 8 bytes per parameter held, and a
    # step per tensor (stage 0: wte, wpe and 2 x 12 = 26 tensors; stage 1: 2 x 12 + ln_f 2 + wte, wpe = 28).
    assert census == [{"weights": 4 * 136_832, "gradients": None, "optimizer": 8 * 136_832 + 26 * STEP},
                      {"weights": 4 * 136_960, "gradients": None, "optimizer": 8 * 136_960 + 28 * STEP}]
    for line in model_state_comparison(m):
        assert line["census_components"] == ["weights", "optimizer"]
        assert line["census_over_predicted"] == pytest.approx(1, abs=1e-4)


@pytest.mark.launch
def test_rows_say_where_their_peak_rss_starts(rows):
    for row in rows.values():
        assert row.measurements["peak_rss_since"] == "first timed step"


def test_schema_1_rows_fall_back_to_their_stored_prediction():
    rows = read_results(["results/reference/ci-cpu/smoke.jsonl"])
    for row in rows:
        predicted = predicted_model_states(row.measurements)
        assert [p["total"] for p in predicted] == [row.measurements["model_state_bytes_predicted"]] * len(predicted)
        assert predicted[0]["source"] == STORED_SCHEMA_1


def test_plan_bytes_adds_persistent_parameters_only_where_weights_are_sharded():
    plan = STRATEGIES["zero3"].model_state_plan(4, PrecisionRecipe.FP32, {})
    # 1,000 parameters over 4 ranks at (4, 4, 12) bytes, 100 of them also whole: 1,000 + 400 + 1,000 + 3,000
    assert plan_bytes(plan, 1_000, kept_whole=100) == {"weights": 1_400, "gradients": 1_000, "optimizer": 3_000,
                                                       "total": 5_400, "host": 0}
    # The same under DeepSpeed's bf16 section: a kept-whole parameter costs its 2-byte bf16 weight, not 4
    # (ZeRO paper, 2 + 2 + 12 bytes): 1,000 x 2 / 4 + 100 x 2 = 700 of weights, 500 + 3,000 for the rest.
    plan = STRATEGIES["zero3"].model_state_plan(4, PrecisionRecipe.DEEPSPEED_BF16, {})
    assert plan_bytes(plan, 1_000, kept_whole=100) == {"weights": 700, "gradients": 500, "optimizer": 3_000,
                                                       "total": 4_200, "host": 0}
