"""moe-tiny launched for real on CPU (gloo): the plain loop, DDP with every expert replicated, torch's expert
parallelism (`ep`) at 2 ranks and at 4 (every rank one expert; and `ep=2`, two groups holding the experts) and
Horovod's (`horovod-ep`) at 2 and 4, judged against the plain loop: losses, norms and the router's choices; the
all-to-all bytes each rank's counter saw worked by hand from the tokens each expert received; and the planted dispatch
bugs (harness.rank.faults: `misroute`, `ungated-combine`), which parity must call a mismatch.

moe-tiny (workloads/moe.py): 4 blocks of 4 experts, 2 a token, hidden size 64, 64 tokens a sample. The moe matrix's
CPU plan: a global batch of 32 in micro-batches of 4, 3 warm-up and 10 timed steps."""

from __future__ import annotations

import pytest

from harness.derive.experts import expert_columns
from harness.derive.parity import Quantity, Verdict, judge
from harness.rank.faults import FAULT_ENV
from labelled_runs import labelled_run

pytestmark = [pytest.mark.launch, pytest.mark.matrix]

HONEST = ("moe-tiny/plain/ws1/gb32/mb4/fp32/cpu", "moe-tiny/ddp/ws2/gb32/mb4/fp32/cpu",
          "moe-tiny/ep/ws2/gb32/mb4/fp32/cpu", "moe-tiny/ep/ws4/gb32/mb4/fp32/cpu",
          "moe-tiny/ep[ep=2]/ws4/gb32/mb4/fp32/cpu", "moe-tiny/horovod-ep/ws2/gb32/mb4/fp32/cpu",
          "moe-tiny/horovod-ep/ws4/gb32/mb4/fp32/cpu")
EP2 = "moe-tiny/ep/ws2/gb32/mb4/fp32/cpu"
PLANTED = (("ep", "misroute"), ("ep", "ungated-combine"), ("horovod-ep", "misroute"))


def launched(tmp_path, arguments: list[str], fault: str | None, monkeypatch,
             precision: str = "fp32") -> dict[str, dict]:
    return labelled_run(tmp_path, ["--matrix", "moe", "--precision", precision, *arguments], fault, monkeypatch)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        honest = launched(tmp_path_factory.mktemp("honest"), ["--strategy", "plain,ddp,ep,horovod-ep"], None,
                          monkeypatch)
        planted = {(strategy, fault): launched(
            tmp_path_factory.mktemp(fault), ["--strategy", strategy, "--world-sizes", "2", "--global-batch", "32"],
            f"{fault}:rank=all:step=0", monkeypatch)[f"moe-tiny/{strategy}/ws2/gb32/mb4/fp32/cpu"]
            for strategy, fault in PLANTED}
        honest.update(launched(tmp_path_factory.mktemp("bf16"), ["--strategy", "ep", "--world-sizes", "2",
                                                                 "--global-batch", "32"], None, monkeypatch, "bf16"))
        honest.update(launched(tmp_path_factory.mktemp("checkpointed"), [
            "--strategy", "plain,ep", "--world-sizes", "1,2", "--global-batch", "32",
            "--option", "activation_checkpointing=blocks"], None, monkeypatch))
    return honest, planted


@pytest.mark.parametrize("cell", HONEST[1:])
def test_each_cell_trains_the_plain_loops_model_and_routes_every_token_as_it_does(rows, cell):
    honest, _ = rows
    row, reference = honest[cell], honest[HONEST[0]]
    assert row["status"] == "ok", row.get("message")
    parity = judge([row, reference])[0]
    assert parity.verdict is Verdict.MATCH, parity
    # The choices themselves, step by step, over the global batch: 32 samples x 64 tokens x 2 choices a block.
    tokens = row["measurements"]["routing"]["tokens_per_expert_by_step"]
    assert tokens == reference["measurements"]["routing"]["tokens_per_expert_by_step"]
    assert len(tokens) == 13 and all(sum(block) == 32 * 64 * 2 for step in tokens for block in step)


def test_a_ranks_all_to_all_bytes_are_its_routed_rows_worked_by_hand(rows):
    honest, _ = rows
    row = honest[EP2]
    m = row["measurements"]
    timed = m["routing"]["tokens_per_expert_by_step"][3:]          # the counter counts the 10 timed steps
    for rank in (0, 1):
        # Rank r holds experts 2r and 2r + 1 of each block; at ep = world size every rank's tokens for them come to it.
        received = sum(step[block][2 * rank] + step[block][2 * rank + 1] for step in timed for block in range(4)) / 10
        # It sends each of its 16 samples' 64 tokens twice (k = 2) in each of 4 blocks, over its 4 micro-batches.
        sent = 16 * 64 * 2 * 4
        dispatches = 4 * 4
        # Dispatch and combine-backward carry the sent rows, combine and dispatch-backward the received ones, each row
        # 64 fp32 values; each dispatch first exchanges 4 int64 counts.
        expected = (2 * sent + 2 * received) * 64 * 4 + dispatches * 4 * 8
        counted = m["comm_per_step_by_rank"][rank]["all_to_all"]["by_group"]["ep"]
        assert counted["bytes"] == pytest.approx(expected, rel=1e-12), rank
        assert counted["calls"] == dispatches * 5        # counts, dispatch, combine, and their two backward
    # The rank's own record of what it routed says the same.
    by_rank = m["strategy_figures_by_rank"]
    for rank in (0, 1):
        recorded = by_rank[rank]["expert_parallel"]["expected_all_to_all_bytes_by_step"][3:]
        assert sum(recorded) / 10 == pytest.approx(
            m["comm_per_step_by_rank"][rank]["all_to_all"]["by_group"]["ep"]["bytes"], rel=1e-12)


def test_under_bf16_autocast_the_outputs_go_back_in_bf16_and_the_rows_out_in_fp32(rows):
    honest, _ = rows
    m = honest["moe-tiny/ep/ws2/gb32/mb4/bf16/cpu"]["measurements"]
    timed = m["routing"]["tokens_per_expert_by_step"][3:]
    for rank in (0, 1):
        received = sum(step[block][2 * rank] + step[block][2 * rank + 1] for step in timed for block in range(4)) / 10
        sent = 16 * 64 * 2 * 4
        # The rows go out as the block's normed input (fp32, 4 bytes) and come back as the experts' bf16 outputs (2);
        # each backward in its tensor's dtype: (sent + received) rows of 64 values x (4 + 2) bytes, and the counts.
        expected = (sent + received) * 64 * (4 + 2) + 16 * 4 * 8
        counted = m["comm_per_step_by_rank"][rank]["all_to_all"]["by_group"]["ep"]["bytes"]
        assert counted == pytest.approx(expected, rel=1e-12), rank
    assert expert_columns(m)["all_to_all_counted_over_expected"] == pytest.approx(1.0, rel=1e-12)


def test_checkpointed_blocks_recompute_the_dispatch_and_still_match_with_the_bytes_expected(rows):
    """Activation checkpointing runs each block's forward again in backward: its dispatch exchanges again, which the
    routing log keeps apart; and the experts' tensors keep their names through the checkpoint wrapper (their norms
    were rank 0's slice alone, 0.29 off, before)."""
    honest, _ = rows
    row = honest["moe-tiny/ep[activation_checkpointing=blocks]/ws2/gb32/mb4/fp32/cpu"]
    reference = honest["moe-tiny/plain[activation_checkpointing=blocks]/ws1/gb32/mb4/fp32/cpu"]
    parity = judge([row, reference])[0]
    assert parity.verdict is Verdict.MATCH, parity
    routed = row["measurements"]["strategy_figures_by_rank"][0]["expert_parallel"]["routed_by_step"][-1]
    assert routed["recomputed_dispatches"] == routed["dispatches"] == 16
    assert expert_columns(row["measurements"])["all_to_all_counted_over_expected"] == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("cell", HONEST[5:])
def test_horovods_alltoall_carries_the_rows_each_rank_routed_and_one_all_reduce_the_dense_gradients(rows, cell):
    honest, _ = rows
    m = honest[cell]["measurements"]
    for rank, counts in enumerate(m["comm_per_step_by_rank"]):
        recorded = m["strategy_figures_by_rank"][rank]["expert_parallel"]["expected_all_to_all_bytes_by_step"][3:]
        assert counts["all_to_all"]["bytes"] == pytest.approx(sum(recorded) / 10, rel=1e-12), rank
        # The dense part: moe-tiny less its experts, 411,200 - 4 x 4 x 18,432 = 116,288 fp32 values, in one call.
        assert counts["all_reduce"]["bytes"] == 116_288 * 4 and counts["all_reduce"]["calls"] == 1, rank


def test_two_groups_of_two_sum_their_experts_gradients_between_them(rows):
    honest, _ = rows
    m = honest["moe-tiny/ep[ep=2]/ws4/gb32/mb4/fp32/cpu"]["measurements"]
    # Each rank holds 2 of a block's 4 experts: w_gate_up (2, 64, 192) and w_down (2, 96, 64) in 4 blocks, fp32.
    expert_bytes = 4 * (2 * 64 * 192 + 2 * 96 * 64) * 4
    for rank, counts in enumerate(m["comm_per_step_by_rank"]):
        edp = counts["all_reduce"]["by_group"]["edp"]
        assert edp["bytes"] == expert_bytes and edp["calls"] == 8, rank       # one all-reduce per expert tensor
    held = m["parameters_held_by_rank"]
    assert held == [411_200 - 4 * 2 * (64 * 192 + 96 * 64)] * 4


@pytest.mark.parametrize("strategy, fault", PLANTED)
def test_a_planted_dispatch_bug_is_a_mismatch(rows, strategy, fault):
    honest, planted = rows
    row = planted[strategy, fault]
    assert row["status"] == "ok", row.get("message")
    assert row["environment"]["env"][FAULT_ENV] == f"{fault}:rank=all:step=0"
    parity = judge([row, honest[HONEST[0]]])[0]
    assert parity.verdict is Verdict.MISMATCH, parity
    # The first loss is computed through the wrong dispatch already.
    assert Quantity.FIRST_LOSS in parity.failed, parity
