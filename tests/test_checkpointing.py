"""Activation checkpointing (harness.strategies.checkpointing) on every strategy: the option and where it wraps,
the saved-for-backward census (harness.rank.saved_activations) against bytes worked out by hand for gpt-tiny,
parity against the loop without it, and the recompute cost (harness.rank.recompute_pass, .derive.techniques)."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
from torch import nn

from harness.derive.activations import predicted_activation_bytes
from harness.derive.parity import Verdict, judge
from harness.derive.techniques import recompute_cost, technique_columns
from harness.report.techniques import technique_lines
from harness.report.verdicts import COMPARABLE
from harness.spec import RunSpec, Status
from harness.strategies import STRATEGIES, checked
from harness.strategies.base import unwrapped_parameter_names
from harness.strategies.checkpointing import checkpoint_interval, checkpointed_blocks, count_checkpointed
from one_line import assert_one_line_error
from workloads import get_workload

# ---- gpt-tiny's saved-for-backward bytes by hand, fp32, one micro-batch of b = 4 -----------------------------
# s 64 tokens, h 64 features, a 4 heads, V 512 tokens in the vocabulary: s b h = 16,384 values, s b = 256 tokens.
# A block (harness/derive/activations.py's docstring): two layer-norm inputs, the q/k/v and MLP inputs, q, k, v,
# the attention output, GeLU's input (4h) and output (4h): 16 values of 4 bytes a token and feature; two norms'
# mean and reciprocal deviation, 16 B a token; the attention's log-sum-exp, 4 B a head and token.
BLOCK = 16_384 * 16 * 4 + 16 * 256 + 4 * 4 * 256                    # 1,056,768
# Checkpointed, a block keeps its input alone, the fp32 residual stream: 4 s b h.
CHECKPOINTED_BLOCK = 4 * 16_384                                       # 65,536
# After the blocks: the final norm's input (4 s b h) and its mean and deviation (8 s b), the head's input, the
# norm's output (4 s b h), the log-probabilities the loss keeps (4 s b V), the position ids (int64, 8 s) and
# the loss's fp32 total weight (4 B). The token ids and targets are the step's data, not counted.
HEAD = 4 * 16_384 + 8 * 256 + 4 * 16_384 + 4 * 256 * 512 + 8 * 64 + 4   # 657,924
assert (BLOCK, HEAD) == (1_056_768, 657_924)
WHOLE, ALL_CHECKPOINTED = 4 * BLOCK + HEAD, 4 * CHECKPOINTED_BLOCK + HEAD     # 4,884,996 and 920,068
SAVED_BY_CHECKPOINTING_A_BLOCK = BLOCK - CHECKPOINTED_BLOCK                 # 991,232
# At TP 2 the split part (q, k, v, the attention output, GeLU in and out: 12 of the 16 values) and the log-sum-exp
# of half the heads are halved; checkpointed, each rank keeps the block's whole input all the same.
TP2_BLOCK = 16_384 * 4 * 4 + 16_384 * 12 * 4 // 2 + 16 * 256 + 4 * 2 * 256  # 661,504
STRATEGIES_AT_2 = ("ddp", "horovod", "zero1", "zero2", "zero3", "fsdp2", "pipeline", "tp", "fsdp2-tp", "autotp", "ps")


# ---- the option --------------------------------------------------------------------------------------------


def test_the_option_reads_none_blocks_and_every_k():
    assert [checkpoint_interval(v) for v in ("none", None, "blocks", "every:1", "every:3")] == [0, 0, 1, 1, 3]
    for bad in ("every:0", "every:", "every:two", "some", 3, True):
        assert_one_line_error(lambda bad=bad: checkpoint_interval(bad), ["activation_checkpointing", "every:K"])


def test_every_strategy_takes_the_option_and_refuses_a_bad_value_before_launch():
    assert all("activation_checkpointing" in strategy.options for strategy in STRATEGIES.values())
    spec = RunSpec(workload="gpt-tiny", strategy="ddp", world_size=2, global_batch=16, micro_batch=4,
                   options={"activation_checkpointing": "every:0"})
    assert_one_line_error(lambda: checked(spec), ["activation_checkpointing", "every:K"])
    # DeepSpeed's pipeline checkpoints runs of K layers as one (activation_checkpoint_interval): every:K is another
    # thing, refused; blocks is its interval of one layer.
    pipeline = spec.replace(strategy="pipeline", options={"activation_checkpointing": "every:2"})
    assert_one_line_error(lambda: checked(pipeline), ["pipeline", "activation_checkpoint_interval"])
    checked(pipeline.replace(options={"activation_checkpointing": "blocks"}))


def test_every_k_wraps_the_first_block_of_every_k_and_keeps_the_parameters_and_their_names():
    layers = get_workload("gpt-tiny").build_layers()     # embedding, 4 blocks, final norm, head
    wrapped = checkpointed_blocks(layers, 3)
    assert [i for i, layer in enumerate(wrapped) if layer is not layers[i]] == [1, 4]      # blocks 0 and 3
    whole, checkpointed = nn.Sequential(*layers), nn.Sequential(*wrapped)
    assert [id(p) for p in checkpointed.parameters()] == [id(p) for p in whole.parameters()]
    assert unwrapped_parameter_names(checkpointed) == [name for name, _ in whole.named_parameters()]
    assert checkpointed_blocks(layers, 0) == layers and count_checkpointed(layers, 3) == 2
    resnet = get_workload("resnet20-cifar").build_layers()   # stem, 9 blocks, head: blocks 0, 2, 4, 6, 8
    assert count_checkpointed(resnet, 2) == 5 and count_checkpointed(resnet, 1) == 9


def test_a_checkpointed_block_computes_the_same_gradients(single_thread):
    torch.manual_seed(0)
    layers = get_workload("gpt-tiny").build_layers()
    tokens = torch.randint(0, 512, (2, 64))
    gradients = []
    for interval in (0, 1):
        model = nn.Sequential(*checkpointed_blocks(layers, interval))
        model.zero_grad()
        model(tokens).float().logsumexp(-1).mean().backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*gradients))


@pytest.fixture
def single_thread():
    """One intra-op thread: bit-for-bit equality holds for the same arithmetic in the same order, and a matrix
    product split over threads may be split otherwise on a loaded machine: with 2 threads this test failed 1 run in
    8 beside three processes multiplying matrices, and 2 in 3 beside a CI run; with 1, 12 of 12 passed beside
    the same three."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- derived figures by hand -------------------------------------------------------------------------------


def test_the_recompute_cost_is_the_median_pair_ratio_with_its_range():
    # Pairs 0.13/0.10, 0.12/0.10, 0.15/0.10: 30%, 20% and 50% extra; the median 30%, the range 20-50%.
    figures = recompute_cost({"recompute_checkpointed_step_time_s": [0.13, 0.12, 0.15],
                              "recompute_kept_step_time_s": [0.10, 0.10, 0.10]})
    assert figures == pytest.approx({"recompute_cost": 0.3, "recompute_cost_low": 0.2, "recompute_cost_high": 0.5})
    assert recompute_cost({})["recompute_cost"] is None
    assert technique_columns({"saved_activation_bytes_by_rank": [5, 7]})["saved_activation_bytes"] == 7
    # On a GPU: peak allocated 10 and 12 MiB over model states of 4 and 5: the larger rank's 7 MiB beyond them.
    gpu = technique_columns({"peak_allocated_bytes_by_rank": [10, 12], "model_state_bytes_measured_by_rank": [4, 5]})
    assert gpu["allocator_activation_bytes"] == 7 and technique_columns({})["allocator_activation_bytes"] is None


def test_the_predicted_block_activations_count_checkpointed_blocks_as_their_input_alone():
    shape = {"family": "gpt", "seq_len": 64, "n_layer": 4, "n_embd": 64, "n_head": 4}
    spec = {"workload": "gpt-tiny", "strategy": "ddp", "micro_batch": 4, "precision": "fp32"}
    row = {"workload_description": shape, "precision_recipe": "fp32"}
    assert predicted_activation_bytes(spec, row) == 4 * BLOCK
    assert predicted_activation_bytes(spec, {**row, "activation_checkpointed_blocks": 2}) == (
        2 * BLOCK + 2 * CHECKPOINTED_BLOCK)                                      # 2,244,608
    assert predicted_activation_bytes(spec, {**row, "activation_checkpointed_blocks": 4}) == 4 * CHECKPOINTED_BLOCK


# ---- real launches (tests/conftest.py's checkpointed stream) -----------------------------------------------


@pytest.fixture(scope="module")
def verdicts(checkpointed_rows):
    rows = list(checkpointed_rows.values())
    return {(row.spec.strategy, row.spec.options_dict.get("activation_checkpointing", "none")): verdict
            for row, verdict in zip(rows, judge([row.to_dict() for row in rows]))}


@pytest.mark.launch
@pytest.mark.matrix
def test_every_strategy_checkpointed_matches_the_plain_loop_without_it(checkpointed_rows, verdicts):
    for key, row in checkpointed_rows.items():
        assert row.status is Status.OK or row.spec.strategy == "dataparallel", (key, row.message)
    assert verdicts["plain", "none"].verdict is Verdict.REFERENCE
    for strategy in ("plain", *STRATEGIES_AT_2):
        assert verdicts[strategy, "blocks"].verdict is Verdict.MATCH, (strategy, verdicts[strategy, "blocks"])
    assert verdicts["plain", "every:2"].verdict is Verdict.MATCH
    # The plain loop recomputes the very same arithmetic: its losses are equal to the last bit.
    losses = {setting: row.measurements["loss_per_step"] for (strategy, setting), row in checkpointed_rows.items()
              if strategy == "plain"}
    assert losses["blocks"] == losses["none"] == losses["every:2"]


@pytest.mark.launch
@pytest.mark.matrix
def test_the_census_finds_the_bytes_worked_out_by_hand(checkpointed_rows):
    saved = {key: row.measurements["saved_activation_bytes_by_rank"] for key, row in checkpointed_rows.items()
             if row.status is Status.OK}
    assert saved["plain", "none"] == [WHOLE] == [4_884_996]
    assert saved["plain", "blocks"] == [ALL_CHECKPOINTED] == [920_068]
    assert saved["plain", "every:2"] == [2 * BLOCK + 2 * CHECKPOINTED_BLOCK + HEAD]
    # What checkpointing every block saved: 4 x 991,232 = 3,964,928 B; one block in two, half of it.
    assert saved["plain", "none"][0] - saved["plain", "blocks"][0] == 4 * SAVED_BY_CHECKPOINTING_A_BLOCK == 3_964_928
    assert saved["plain", "none"][0] - saved["plain", "every:2"][0] == 2 * SAVED_BY_CHECKPOINTING_A_BLOCK
    # Data parallel ranks each run micro-batches of 4 through the whole model: the plain loop's bytes; tensor
    # parallel ranks keep every checkpointed block's whole input.
    for strategy in ("ddp", "horovod", "zero1", "zero2", "zero3", "fsdp2", "tp", "fsdp2-tp", "autotp", "ps"):
        assert saved[strategy, "blocks"] == [ALL_CHECKPOINTED] * 2, strategy
    assert checkpointed_rows["plain", "blocks"].measurements["activation_checkpointed_blocks"] == 4
    assert checkpointed_rows["plain", "every:2"].measurements["activation_checkpointed_blocks"] == 2


@pytest.mark.launch
@pytest.mark.matrix
def test_each_rank_saves_what_checkpointing_its_blocks_should_save(checkpointed_rows, gpt_tiny_fp32):
    """Against the same strategy without checkpointing (the session's gpt-tiny rows): a rank saves one block's
    991,232 B (595,968 B at TP 2) for each block it holds and each micro-batch it has in flight at its peak."""
    tp2 = 4 * TP2_BLOCK + HEAD
    assert gpt_tiny_fp32["tp"].measurements["saved_activation_bytes_by_rank"] == [tp2, tp2] == [3_303_940] * 2
    for strategy in STRATEGIES_AT_2:
        before = gpt_tiny_fp32[strategy].measurements["saved_activation_bytes_by_rank"]
        after = checkpointed_rows[strategy, "blocks"].measurements["saved_activation_bytes_by_rank"]
        if strategy == "pipeline":
            # A stage's blocks from DeepSpeed's partition (layers 1-4 of gpt-tiny are its blocks); under 1F1B stage
            # s of S holds S - s micro-batches at its peak (S - s - 1 warm-up forwards and the current one).
            bounds = checkpointed_rows[strategy, "blocks"].measurements["strategy_config"]["layer_boundaries"]
            blocks = [len(set(range(start, stop)) & {1, 2, 3, 4}) for start, stop in zip(bounds, bounds[1:])]
            in_flight = [2, 1]
        else:
            blocks, in_flight = [4, 4], [1, 1]
        # A tensor-parallel rank's block saves half its split values, and keeps the whole input checkpointed.
        split = strategy in ("tp", "fsdp2-tp", "autotp")
        saved = TP2_BLOCK - CHECKPOINTED_BLOCK if split else SAVED_BY_CHECKPOINTING_A_BLOCK
        assert [b - a for b, a in zip(before, after)] == [n * k * saved for n, k in zip(blocks, in_flight)], strategy


@pytest.mark.launch
@pytest.mark.matrix
def test_a_checkpointed_cell_records_its_recompute_pass_and_one_without_checkpointing_records_none(
        checkpointed_rows):
    for (strategy, setting), row in checkpointed_rows.items():
        if row.status is not Status.OK:
            continue
        m = row.measurements
        assert m["activation_checkpointing"] == setting
        if setting == "none":
            assert "recompute_checkpointed_step_time_s" not in m and recompute_cost(m)["recompute_cost"] is None
            continue
        for series in ("recompute_checkpointed_step_time_s", "recompute_kept_step_time_s"):
            assert len(m[series]) == row.spec.timed_steps and all(t > 0 for t in m[series]), (strategy, series)
        assert recompute_cost(m)["recompute_cost"] is not None


# ---- the report's "memory saved, step time paid" -----------------------------------------------------------


def test_the_report_pairs_a_checkpointed_cell_with_the_same_cell_without_it():
    mib = 1 << 20
    common = {"device": "cpu", "workload": "gpt-tiny", "precision": "fp32", "global_batch": 16, "world_size": 2,
              "nnodes": 1, "conditions_id": "", "status": "ok", "strategy": "ddp"}
    cells = pd.DataFrame([
        {**common, "options": "", "activation_checkpointing": "none", "saved_activation_bytes": 4 * mib,
         "samples_per_s": 200.0},
        {**common, "options": "activation_checkpointing=blocks", "activation_checkpointing": "blocks",
         "saved_activation_bytes": 1 * mib, "samples_per_s": 160.0, "recompute_cost": 0.3,
         "recompute_cost_low": 0.2, "recompute_cost_high": 0.5},
        # No counterpart without checkpointing in its group (another world size): no line.
        {**common, "world_size": 4, "options": "activation_checkpointing=blocks", "activation_checkpointing": "blocks",
         "saved_activation_bytes": 1 * mib, "samples_per_s": 100.0}])
    # 4 -> 1 MiB is 75% less; 200 -> 160 samples/s is a step 200/160 - 1 = 25% longer.
    assert technique_lines(cells, COMPARABLE) == [
        "gpt-tiny at 2 rank(s) (cpu, fp32, global batch 16), ddp, activation checkpointing blocks: saved for backward "
        "4 -> 1 MiB per rank (75% less); median step +25% against the cell without it; recompute pass +30% forward "
        "and backward, pairs +20% to +50%."]
    assert technique_lines(cells[cells["activation_checkpointing"] == "none"], COMPARABLE) == []


@pytest.mark.launch
@pytest.mark.matrix
def test_the_report_opens_on_what_checkpointing_saved_for_each_strategy(checkpointed_rows, gpt_tiny_fp32):
    from harness.derive.cells import cell_table
    from harness.report.document import TECHNIQUES_HEADING, _verdict_sections
    from harness.report.verdicts import verdicts

    without = [row for row in gpt_tiny_fp32.values() if row.spec.world_size == 2]
    rows = [row.to_dict() for row in [*checkpointed_rows.values(), *without]]
    heading, lines = _verdict_sections(verdicts(cell_table(rows)))[0]
    assert heading == TECHNIQUES_HEADING
    by_cell = {" ".join(re.search(r"\), (.+), activation checkpointing (\S+):", line).groups()): line for line in lines}
    assert sorted(by_cell) == sorted(["plain blocks", "plain every:2", "ddp blocks", "horovod blocks", "zero1 blocks",
                                      "zero2 blocks", "zero3 blocks", "fsdp2 blocks", "pipeline[stages=2] blocks",
                                      "tp blocks", "fsdp2-tp[tp=2] blocks", "autotp[tp=2] blocks",
                                      "ps[placement=colocated] blocks"])
    # 4,884,996 B = 4.66 MiB -> 920,068 B = 0.877 MiB, 81% less; at TP 2 3,303,940 B = 3.15 MiB, 72% less.
    assert "saved for backward 4.66 -> 0.877 MiB per rank (81% less)" in by_cell["ddp blocks"]
    assert "saved for backward 3.15 -> 0.877 MiB per rank (72% less)" in by_cell["tp blocks"]
    assert "recompute pass" in by_cell["zero3 blocks"] and "no recompute pass" not in by_cell["zero3 blocks"]


def test_the_gpu_table_in_the_docs_is_the_committed_h200_rows():
    """docs/methodology.md's H200 table, figure by figure, from the rows it cites."""
    import json
    from pathlib import Path

    from harness.derive.cells import cell_table

    root = Path(__file__).resolve().parent.parent
    folder = root / "results" / "reference" / "h200-memory-techniques"
    rows = [json.loads(line) for line in (folder / "memory-techniques.jsonl").read_text().splitlines()]
    cells = {(c["workload"], c["strategy"], c["activation_checkpointing"]): c
             for c in cell_table(rows).to_dict("records")}
    docs = (root / "docs" / "methodology.md").read_text()
    mib = float(1 << 20)
    for workload, name in (("gpt2-small", "GPT-2 small"), ("gpt2-medium", "GPT-2 medium")):
        for strategy, shown in (("plain", "plain"), ("fsdp2", "FSDP2")):
            off, on = cells[workload, strategy, "none"], cells[workload, strategy, "blocks"]
            saved = f"{off['saved_activation_bytes'] / mib:,.0f} -> {on['saved_activation_bytes'] / mib:,.0f}"
            allocator = (f"{off['allocator_activation_bytes'] / mib:,.0f} -> "
                         f"{on['allocator_activation_bytes'] / mib:,.0f}")
            recompute = (f"{on['recompute_cost']:+.0%} ({on['recompute_cost_low']:+.0%} to "
                         f"{on['recompute_cost_high']:+.0%})")
            step = f"{off['samples_per_s'] / on['samples_per_s'] - 1:+.0%}"
            line = next(line for line in docs.splitlines() if line.startswith(f"| {name}, {shown} |"))
            for figure in (saved, allocator, recompute, step):
                assert figure in line, (line, figure)


def test_none_given_on_the_command_line_is_the_word_where_an_option_takes_words():
    from harness.cli.arguments import _option
    from harness.matrix import Selection

    # The command line reads `=none` as None; a strategy's word-valued option gets the word back, so that
    # offload_optimizer=none (choices none, cpu) is accepted and a cell says activation_checkpointing=none.
    assert _option("offload_optimizer=none") == ("offload_optimizer", None)
    selection = Selection(options=(("offload_optimizer", None), ("activation_checkpointing", None),
                                   ("static_graph", None)))
    assert selection.options_for("zero2") == {"offload_optimizer": "none", "activation_checkpointing": "none"}
    assert selection.options_for("ddp") == {"activation_checkpointing": "none", "static_graph": None}
