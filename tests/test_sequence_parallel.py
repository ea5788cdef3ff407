"""tp with sequence parallelism (option sequence_parallel=true) on gpt-tiny at 2 ranks: its parity against the
plain loop in fp32 and bf16, and its collectives counted in a real run against a schedule worked out by hand."""

from __future__ import annotations

import pytest

from harness.spec import RunSpec, SpecError

# gpt-tiny: 4 blocks, hidden 64, 64 tokens a sample; 4 samples a micro-batch.
L, H, S, B = 4, 64, 64, 4
LAYER_NORMS = 2 * L + 1                       # two a block and the final one, each a weight and a bias of H


def _by_group(row):
    return {kind: figures["by_group"] for kind, figures in row["measurements"]["comm_per_step_by_rank"][0].items()}


@pytest.mark.launch
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sequence_parallel_matches_the_plain_loop_and_counts_its_schedule_by_hand(sequence_parallel_rows, precision):
    from harness.derive.parity import Verdict, judge

    rows = [row.to_dict() for row in sequence_parallel_rows[precision]]
    assert [(r["spec"]["strategy"], r["spec"]["precision"]) for r in rows] == [("plain", precision), ("tp", precision)]
    assert rows[0]["spec"]["global_batch"] == rows[1]["spec"]["global_batch"]
    verdicts = [judgement.verdict for judgement in judge(rows)]
    assert verdicts == [Verdict.REFERENCE, Verdict.MATCH], [row["message"] for row in rows]

    row = rows[1]
    assert row["spec"]["options"] == {"sequence_parallel": True}
    assert row["measurements"]["strategy_config"]["sequence_parallel"] is True
    K = row["spec"]["global_batch"] // B             # one replica runs the whole batch
    fp32 = B * S * H * 4                             # one micro-batch's b x s x h values: 65,536 B
    compute = fp32 // 2 if precision == "bf16" else fp32
    # Each block and micro-batch, Korthikanti et al.'s 2 + 2 each way: forward all-gathers the two norms' outputs
    # (fp32 even under autocast) for its column-parallel layers and reduce-scatters its two row-parallel outputs
    # (autocast's bf16); backward reduce-scatters the gathered inputs' gradients (fp32) and all-gathers the
    # scattered outputs' (bf16). Once a micro-batch: the final norm's output gathered for the head (fp32), and the
    # embedding's output gradient gathered (fp32; forward only cut it). Once a step: each norm weight and bias's
    # partial gradient summed (fp32, 256 B).
    gathers = {"calls": 2 * L * K + 2 * K + 2 * L * K,
               "bytes": (2 * L * K + 2 * K) * fp32 + 2 * L * K * compute}
    scatters = {"calls": 4 * L * K, "bytes": 2 * L * K * compute + 2 * L * K * fp32}
    sums = {"calls": 2 * LAYER_NORMS, "bytes": 2 * LAYER_NORMS * H * 4}
    by_hand = {"all_gather": {"tp": gathers}, "reduce_scatter": {"tp": scatters}, "all_reduce": {"tp": sums}}
    for rank, counts in enumerate(row["measurements"]["comm_per_step_by_rank"]):
        assert {kind: figures["by_group"] for kind, figures in counts.items()} == by_hand, f"rank {rank}"
    expected = {}
    for entry in row["measurements"]["comm_expected_per_step"]["collectives"]:
        group = expected.setdefault(entry["collective"], {}).setdefault(entry["group"], {"calls": 0, "bytes": 0})
        group["calls"] += entry["calls"]
        group["bytes"] += entry["calls"] * entry["size_bytes"]
    assert expected == by_hand


def test_sequence_parallelism_must_divide_the_sequence():
    from harness.strategies import get_strategy

    # gpt2-xl's 25 heads split over 5 ranks, but its 1,024 tokens do not.
    def spec(**options):
        return RunSpec(workload="gpt2-xl", strategy="tp", world_size=5, global_batch=10, micro_batch=2,
                       options=options)

    assert get_strategy("tp").layout_refusal(spec()) is None
    assert get_strategy("tp").layout_refusal(spec(sequence_parallel=True)) == (
        "sequence parallelism of 5 must divide gpt2-xl's sequence of 1024 tokens")
    with pytest.raises(SpecError, match="has no option 'sequence_parallel'"):
        RunSpec(workload="gpt-tiny", strategy="fsdp2-tp", world_size=2, global_batch=8, micro_batch=4,
                options={"sequence_parallel": True})
