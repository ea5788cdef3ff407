"""`python -m harness memory`: model states per rank divided by the tensor- and pipeline-parallel degree as each
strategy lays a model out, a recipe applied only where a strategy can run it, and a reason under every "-".

Expected figures are worked by hand from bytes per parameter (Rajbhandari et al. 2020, sec. 3.1 and 5.1): torch
AdamW over fp32 weights under autocast keeps 4 (weights) + 4 (gradients) + 8 (two moments) = 16 bytes a parameter;
DeepSpeed ZeRO keeps an fp32 master partition beside them, K = 12.
"""

from types import SimpleNamespace

import pytest

from harness.cli import main
from harness.spec import DeviceKind, Precision
from harness.strategies import STRATEGIES, PrecisionRecipe
from harness.strategies.deepspeed_common import PRECISION_OPTION, precision_config

GIB = 2**30
COLUMNS = ("layout", "bytes", "weights", "gradients", "optimizer", "total", "host", "deepspeed")


def memory(capsys, *args: str) -> tuple[dict[str, dict[str, str]], str]:
    """The table's rows by strategy, each column by name, and the whole output."""
    assert main(["memory", *args]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("strategy "))
    rows = {}
    for line in lines[start + 1:]:
        fields = line.split()
        if not fields or fields[0] not in STRATEGIES:
            break
        rows[fields[0]] = dict(zip(COLUMNS, fields[1:]))
    return rows, out


def gib(bytes_: float) -> str:
    return f"{bytes_ / GIB:.3f}"


def test_tp_holds_an_eighth_of_ddps_model_states_at_tp_8(capsys):
    rows, _ = memory(capsys, "--params", "7B", "--dp", "8", "--option", "tp=8", "--no-deepspeed")
    assert rows["ddp"]["total"] == gib(7e9 * (4 + 4 + 8)) == "104.308"
    # tp: one group of 8 ranks, each holding 7e9 / 8 parameters whole, none sharded over replicas.
    assert rows["tp"]["layout"] == "1x8x1"
    assert rows["tp"]["total"] == gib(7e9 / 8 * (4 + 4 + 8)) == "13.039"
    assert (rows["tp"]["weights"], rows["tp"]["gradients"], rows["tp"]["optimizer"]) == (
        gib(7e9 / 8 * 4), gib(7e9 / 8 * 4), gib(7e9 / 8 * 8))


def test_fsdp2_tp_shards_a_tp_slice_over_the_dp_replicas(capsys):
    rows, _ = memory(capsys, "--params", "7B", "--dp", "8", "--option", "tp=8", "--no-deepspeed")
    # 8 replicas of 8 tp ranks: a rank's slice is 7e9 / 8 parameters, FSDP2 shards all 16 bytes of each over 8.
    assert rows["fsdp2-tp"]["layout"] == "8x8x1"
    assert rows["fsdp2-tp"]["total"] == gib(7e9 / 8 * (4 + 4 + 8) / 8) == gib(7e9 * 16 / 64) == "1.630"
    assert rows["fsdp2"]["total"] == gib(7e9 * (4 + 4 + 8) / 8) == "13.039"     # no tp: 1/8 of DDP only


def test_autotp_applies_zero_over_the_replicas_to_a_tp_slice(capsys):
    rows, _ = memory(capsys, "--params", "7B", "--dp", "8", "--option", "tp=8", "--no-deepspeed")
    # ZeRO-1 (AutoTP's default stage) of a 7e9 / 8 slice: fp32 weights and gradients whole, the 12-byte master
    # partition and moments over the 8 replicas.
    slice_ = 7e9 / 8
    assert rows["autotp"]["layout"] == "8x8x1"
    assert rows["autotp"]["total"] == gib(slice_ * (4 + 4 + 12 / 8)) == "7.742"
    assert rows["zero1"]["total"] == gib(7e9 * (4 + 4 + 12 / 8)) == "61.933"     # the same without tp: 8 x
    rows, _ = memory(capsys, "--params", "7B", "--dp", "8", "--option", "tp=8", "--option", "zero_stage=2",
                     "--no-deepspeed")
    assert rows["autotp"]["total"] == gib(slice_ * (4 + (4 + 12) / 8)) == "4.889"   # 5.25e9 B


def test_without_a_tp_option_every_tp_row_splits_by_its_default_and_says_so(capsys):
    rows, out = memory(capsys, "--params", "7B", "--dp", "8", "--no-deepspeed")
    assert (rows["tp"]["layout"], rows["fsdp2-tp"]["layout"], rows["autotp"]["layout"]) == ("1x2x1", "8x2x1", "8x2x1")
    assert rows["tp"]["total"] == gib(7e9 / 2 * 16)
    assert "tp=2 (the tp option's default; --option tp=N sets it), tp, fsdp2-tp, autotp: every parameter counted " \
           "as split 2 ways (3,500,000,000 a rank" in out
    assert "embeddings, layer norms and row-parallel biases stay whole on every tp rank" in out
    assert "tp: one group of 2 ranks whatever --dp says: it has no data-parallel replicas" in out


def test_the_pipelines_stages_are_its_stages_option(capsys):
    rows, out = memory(capsys, "--params", "7B", "--dp", "8", "--option", "stages=4", "--no-deepspeed")
    assert rows["pipeline"]["layout"] == "8x1x4"
    assert rows["pipeline"]["total"] == gib(7e9 / 4 * (4 + 4 + 8))
    assert "stages=4, pipeline: the layers cut into 4 stages" in out
    rows, _ = memory(capsys, "--params", "7B", "--dp", "8", "--no-deepspeed")
    assert rows["pipeline"]["total"] == gib(7e9 / 2 * (4 + 4 + 8))             # the option's default, 2


def test_memory_has_one_way_to_give_the_stages(capsys):
    assert main(["memory", "--params", "7B", "--dp", "8", "--stages", "4"]) == 2
    assert "unrecognized arguments: --stages 4" in capsys.readouterr().err


def test_ddp_under_a_deepspeed_recipe_is_a_dash_with_its_reason(capsys):
    rows, out = memory(capsys, "--params", "7B", "--dp", "8", "--recipe", "deepspeed-bf16", "--no-deepspeed")
    assert set(rows["ddp"].values()) == {"8x1x1", "-"}
    assert "  ddp: recipe deepspeed-bf16 is DeepSpeed's (its bf16 section); ddp runs fp32 and autocast" in out
    assert "  fsdp2: recipe deepspeed-bf16 is DeepSpeed's (its bf16 section); fsdp2 runs fp32, autocast and " \
           "fsdp-mp-policy" in out
    # ZeRO-1 runs it: the paper's P_os, (2 + 2) Psi + 12 Psi / N_d.
    assert rows["zero1"]["total"] == gib(7e9 * (2 + 2 + 12 / 8))
    # And AutoTP over a tp slice: 7e9 / 2 at its default tp=2.
    assert rows["autotp"]["total"] == gib(7e9 / 2 * (2 + 2 + 12 / 8))


def test_fsdp2s_recipe_is_run_by_fsdp2_alone(capsys):
    rows, out = memory(capsys, "--params", "7B", "--dp", "8", "--recipe", "fsdp-mp-policy", "--no-deepspeed")
    assert [name for name, row in rows.items() if row["total"] != "-"] == ["fsdp2"]
    assert "  zero3: recipe fsdp-mp-policy is FSDP2's (its MixedPrecisionPolicy); zero3 runs fp32, autocast, " \
           "deepspeed-bf16 and deepspeed-fp16" in out


@pytest.mark.parametrize("args", [
    ("--params", "7B", "--dp", "8", "--option", "tp=8"),
    ("--params", "7B", "--dp", "8", "--recipe", "deepspeed-bf16"),
    ("--params", "7B", "--dp", "8", "--recipe", "fsdp-mp-policy", "--no-deepspeed"),
    ("--params", "1.5B", "--dp", "16", "--gpus-per-node", "8", "--option", "offload_optimizer=cpu"),
])
def test_every_dash_in_the_table_has_its_reason_printed_under_it(capsys, args):
    rows, out = memory(capsys, *args)
    reasons = out.split("'-', why:\n", 1)[1].splitlines() if "'-', why:\n" in out else []
    estimates = next((line for line in reasons if line.startswith("  DeepSpeed est. of ")), "")
    for name, row in rows.items():
        figures = [value for column, value in row.items() if column not in ("layout", "deepspeed")]
        if "-" in figures:
            assert any(line.startswith(f"  {name}: ") for line in reasons), name
        elif row["deepspeed"] == "-":
            assert name in estimates.split(":")[0].removeprefix("  DeepSpeed est. of ").split(", "), name


def test_memory_takes_the_recipe_from_recipe_alone(capsys):
    assert main(["memory", "--params", "7B", "--dp", "8", "--option", "precision_recipe=deepspeed-bf16"]) == 2
    assert "memory takes the precision recipe from --recipe, not option(s) precision_recipe" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "pipeline", "autotp"])
def test_a_deepspeed_strategy_declares_every_recipe_its_config_can_give(name):
    strategy = STRATEGIES[name]
    for precision in Precision:
        for device in DeviceKind:
            for choice in PRECISION_OPTION.choices:
                _, recipe = precision_config(SimpleNamespace(precision=precision, device=device),
                                             {"precision_recipe": choice})
                assert strategy.recipe_refusal(recipe) is None, (precision, device, choice, recipe)
    assert strategy.recipe_refusal(PrecisionRecipe.FSDP_MP_POLICY)


def test_a_described_llama_keeps_its_embedding_and_untied_head_whole_at_tp_2(capsys):
    # Llama 3 8B at tp = 2: each block's wqkv (4096 x 6144), wo (4096^2), gate|up and down (3 x 4096 x 14336) split
    # two ways, its two RMSNorms (2 x 4096) whole; the embedding and the untied head (2 x 128,256 x 4096) and the
    # final RMSNorm (4096) whole on both ranks.
    split = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14_336) / 2
    whole = 32 * 2 * 4096 + 2 * 128_256 * 4096 + 4096
    held = split + whole                                         # 4,540,600,320 a rank, not 8.03B / 2
    rows, out = memory(capsys, "--model", "llama3-8b", "--dp", "8", "--option", "tp=2", "--no-deepspeed")
    # tp holds its slice whole (no data-parallel sharding): 16 bytes a parameter, 67.7 GiB.
    assert rows["tp"]["total"] == gib(16 * held) == "67.660"
    # fsdp2-tp shards the slice's 16 bytes over its 8 replicas.
    assert rows["fsdp2-tp"]["total"] == gib(16 * held / 8)
    assert "the embeddings and the head whole on every tp rank (4,540,600,320 a rank" in out


def test_a_described_model_shows_every_term_the_plan_counts(capsys):
    assert main(["memory", "--model", "llama3-8b", "--dp", "8", "--micro-batches", "4", "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    assert "activations" in out and "logits" in out and "GPU total" in out
    fsdp2 = next(line for line in out.splitlines() if line.startswith("fsdp2 "))
    fields = fsdp2.split()
    # Under autocast FSDP2 gathers fp32 and, at 4 micro-batches with gradient sync off, keeps every unsharded fp32
    # gradient: its working memory holds 4 bytes x 8.03B = 29.9 GiB of them.
    assert float(fields[-2]) > 4 * 8_030_261_248 / GIB
