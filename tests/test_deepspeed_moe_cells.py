"""DeepSpeed-MoE (`deepspeed-moe`: DeepSpeed's MoE layer under ZeRO-1 and ZeRO-2, harness/strategies/deepspeed_moe.py)
launched for real on CPU (gloo) on moe-tiny, judged against the plain loop: losses, norms by tensor (its per-expert
tensors named and normed as the plain model's stacked ones) and the router's choices; its padded all-to-alls worked by
hand from the capacities each dispatch used; its gradient reductions and what a rank holds; activation checkpointing's
recomputed exchanges; and the planted dispatch bugs, which parity must call a mismatch.

moe-tiny (workloads/moe.py): 4 blocks of 4 experts, 2 a token, hidden size 64, 64 tokens a sample, each expert
64 x 192 + 96 x 64 = 18,432 parameters; 411,200 parameters, 116,288 of them outside the routed experts. The moe
matrix's CPU plan: a global batch of 32 in micro-batches of 4, 3 warm-up and 10 timed steps."""

from __future__ import annotations

import pytest

from harness.derive.parity import Quantity, Verdict, judge
from harness.rank.faults import FAULT_ENV
from labelled_runs import labelled_run

pytestmark = [pytest.mark.launch, pytest.mark.matrix]

PLAIN = "moe-tiny/plain/ws1/gb32/mb4/fp32/cpu"
HONEST = ("moe-tiny/deepspeed-moe/ws2/gb32/mb4/fp32/cpu", "moe-tiny/deepspeed-moe[zero_stage=1]/ws2/gb32/mb4/fp32/cpu",
          "moe-tiny/deepspeed-moe/ws4/gb32/mb4/fp32/cpu", "moe-tiny/deepspeed-moe[ep=2]/ws4/gb32/mb4/fp32/cpu")
EXPERT, DENSE = 18_432, 116_288
FAULTS = ("misroute", "ungated-combine")


def launched(tmp_path, arguments: list[str], fault: str | None, monkeypatch) -> dict[str, dict]:
    return labelled_run(tmp_path, ["--matrix", "moe", "--precision", "fp32", *arguments], fault, monkeypatch)


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return launched(tmp_path_factory.mktemp("honest"), ["--strategy", "plain,deepspeed-moe"], None, monkeypatch)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {fault: launched(tmp_path_factory.mktemp(fault), [
            "--strategy", "deepspeed-moe", "--world-sizes", "2", "--global-batch", "32", "--option", "zero_stage=2"],
            f"{fault}:rank=all:step=0", monkeypatch)["moe-tiny/deepspeed-moe[zero_stage=2]/ws2/gb32/mb4/fp32/cpu"]
            for fault in FAULTS}


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return launched(tmp_path_factory.mktemp("checkpointed"), [
            "--strategy", "plain,deepspeed-moe", "--world-sizes", "1,2", "--global-batch", "32",
            "--option", "activation_checkpointing=blocks"],
            None, monkeypatch)


@pytest.mark.parametrize("cell", HONEST)
def test_each_cell_trains_the_plain_loops_model_and_routes_every_token_as_it_does(honest, cell):
    row, reference = honest[cell], honest[PLAIN]
    assert row["status"] == "ok", row.get("message")
    parity = judge([row, reference])[0]
    assert parity.verdict is Verdict.MATCH, parity
    m = row["measurements"]
    # Every tensor normed under the plain model's name: the per-expert tensors joined into the stacked ones.
    assert m["gradient_norm_by_tensor_first_step"].keys() == \
        reference["measurements"]["gradient_norm_by_tensor_first_step"].keys()
    assert m["routing"]["tokens_per_expert_by_step"] == reference["measurements"]["routing"]["tokens_per_expert_by_step"]


def test_the_padded_all_to_alls_are_the_capacities_worked_by_hand(honest):
    m = honest[HONEST[0]]["measurements"]
    for rank, counts in enumerate(m["comm_per_step_by_rank"]):
        taken = m["strategy_figures_by_rank"][rank]["expert_parallel"]["capacities_by_step"][3:]   # the timed steps
        capacities = [c for step in taken for c in step["capacities"]]
        # 4 blocks x 4 micro-batches a step, each dispatch's capacity the most tokens an expert of the group got: a
        # rank's 4 x 64 = 256 tokens make 512 choices over 4 experts, so at least 128 and at most 256 (one a token).
        assert len(capacities) == 10 * 16 and all(128 <= c <= 256 for c in capacities), rank
        # Each dispatch: 4 buffers (dispatch and combine, forward and backward) of 4 experts x C rows x 64 fp32 values.
        assert counts["all_to_all"]["calls"] == 64
        assert counts["all_to_all"]["bytes"] == pytest.approx(sum(capacities) * 4 * 4 * 64 * 4 / 10, rel=1e-12)


def test_zero_reduces_the_dense_gradients_among_all_and_the_experts_among_their_replicas(honest):
    m = honest["moe-tiny/deepspeed-moe[ep=2]/ws4/gb32/mb4/fp32/cpu"]["measurements"]
    # ep=2 at 4 ranks: a rank holds 2 of each block's 4 experts, 4 x 2 x 18,432 = 147,456 parameters beside the
    # 116,288 dense ones; the ranks 2 apart hold the same experts.
    assert m["parameters_held_by_rank"] == [DENSE + 4 * 2 * EXPERT] * 4
    for counts in m["comm_per_step_by_rank"]:
        # The updated weights gathered once a step: the dense part among 4, the experts' fp32 among their 2 holders.
        assert counts["all_gather"]["bytes_by_group_size"] == {"4": DENSE * 4, "2": 4 * 2 * EXPERT * 4}
    expected = {(c["collective"], c["group"]): (c["size_bytes"], c["calls"], c["ranks"], c["stride"])
                for c in m["comm_expected_per_step"]["collectives"]}
    # ZeRO-2 reduce-scatters every micro-batch (2 a step at 4 ranks); the capacity's all-reduce (one int64) in each of
    # the 4 blocks and 2 micro-batches, among the 2 ranks of an expert group.
    assert expected == {("reduce_scatter", "world"): (DENSE * 4, 2, 4, 1), ("all_gather", "world"): (DENSE * 4, 1, 4, 1),
                        ("reduce_scatter", "edp"): (4 * 2 * EXPERT * 4, 2, 2, 2),
                        ("all_gather", "edp"): (4 * 2 * EXPERT * 4, 1, 2, 2), ("all_reduce", "ep"): (8, 8, 2, 1)}
    assert honest["moe-tiny/deepspeed-moe/ws4/gb32/mb4/fp32/cpu"]["measurements"]["parameters_held_by_rank"] == \
        [DENSE + 4 * EXPERT] * 4


def test_a_checkpointed_cell_matches_and_its_recomputed_exchanges_are_expected(checkpointed):
    reference = checkpointed["moe-tiny/plain[activation_checkpointing=blocks]/ws1/gb32/mb4/fp32/cpu"]
    for label in ("moe-tiny/deepspeed-moe[activation_checkpointing=blocks]/ws2/gb32/mb4/fp32/cpu",
                  "moe-tiny/deepspeed-moe[activation_checkpointing=blocks,zero_stage=1]/ws2/gb32/mb4/fp32/cpu"):
        row = checkpointed[label]
        assert judge([row, reference])[0].verdict is Verdict.MATCH, label
        m = row["measurements"]
        for rank, counts in enumerate(m["comm_per_step_by_rank"]):
            taken = m["strategy_figures_by_rank"][rank]["expert_parallel"]["capacities_by_step"][3:]
            first = sum(c for step in taken for c in step["capacities"])
            again = sum(c for step in taken for c in step["recomputed_capacities"])
            # Recomputation runs each block's forward again: its dispatch and combine, no backward of their own.
            assert len(taken[0]["recomputed_capacities"]) == 16 and again == pytest.approx(first, rel=0.0)
            assert counts["all_to_all"]["calls"] == 64 + 32
            assert counts["all_to_all"]["bytes"] == pytest.approx((2 * first + again) * 4 * 64 * 8 / 10, rel=1e-12)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_planted_dispatch_bug_is_a_mismatch(honest, planted, fault):
    row = planted[fault]
    assert row["status"] == "ok", row.get("message")
    assert row["environment"]["env"][FAULT_ENV] == f"{fault}:rank=all:step=0"
    parity = judge([row, honest[PLAIN]])[0]
    assert parity.verdict is Verdict.MISMATCH, parity
    assert Quantity.FIRST_LOSS in parity.failed, parity
