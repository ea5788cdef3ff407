"""tp with sequence parallelism (option sequence_parallel=true), loss parallelism (loss_parallel=true) and both, on
gpt-tiny at 2 ranks: parity against the plain loop, in fp32 and bf16, and the collectives counted in a real run
against a schedule worked out by hand."""

from __future__ import annotations

import pytest

from harness.spec import RunSpec, SpecError
from expected_traffic import expected_by_group

# gpt-tiny: 4 blocks, hidden 64, 64 tokens a sample; 4 samples a micro-batch.
L, H, S, B = 4, 64, 64, 4
LAYER_NORMS = 2 * L + 1                       # two a block and the final one, each a weight and a bias of H


def by_hand(K, *, sequence_parallel, loss_parallel, bf16):
    """One step's collectives per rank in the tp group, {collective: {"calls", "bytes"}}, for K micro-batches."""
    fp32 = B * S * H * 4                             # one micro-batch's b x s x h values: 65,536 B
    compute = fp32 // 2 if bf16 else fp32            # what autocast's matmuls output
    schedule = {}

    def add(collective, calls, size):
        entry = schedule.setdefault(collective, {"calls": 0, "bytes": 0})
        entry["calls"] += calls
        entry["bytes"] += calls * size

    if sequence_parallel:
        # Each block and micro-batch, Korthikanti et al.'s 2 + 2 each way: forward all-gathers the two norms'
        # outputs (fp32 even under autocast) for its column-parallel layers and reduce-scatters its two row-parallel
        # outputs (autocast's dtype); backward reduce-scatters the gathered inputs' gradients (fp32) and all-gathers
        # the scattered outputs' (autocast's dtype). Once a micro-batch: the final norm's output gathered for the
        # head, and the embedding's output gradient gathered (forward only cut it), both fp32. Once a step: each
        # norm weight and bias's partial gradient summed (fp32, H values).
        add("all_gather", 2 * L * K + 2 * K, fp32)
        add("all_gather", 2 * L * K, compute)
        add("reduce_scatter", 2 * L * K, compute)
        add("reduce_scatter", 2 * L * K, fp32)
        add("all_reduce", 2 * LAYER_NORMS, H * 4)
    else:
        # Megatron's 2 + 2 a block and micro-batch: the row-parallel outputs forward (autocast's dtype), the
        # column-parallel inputs' gradients backward (fp32).
        add("all_reduce", 2 * L * K, compute)
        add("all_reduce", 2 * L * K, fp32)
    if loss_parallel:
        # Once a micro-batch, fp32: the embedding's lookups in each rank's vocabulary rows summed; the head's input
        # gradient, partial over those rows, summed (scattered onto the slices under sequence parallelism); the
        # cross-entropy on split logits, 3 all-reduces of a value per token (max, sum of exponentials, target).
        add("all_reduce", K, fp32)
        add("reduce_scatter" if sequence_parallel else "all_reduce", K, fp32)
        add("all_reduce", 3 * K, B * S * 4)
    return schedule


@pytest.mark.launch
@pytest.mark.matrix
@pytest.mark.parametrize("stream", ["sequence-parallel", "loss-parallel", "bf16-sequence-and-loss-parallel"])
def test_split_tp_matches_the_plain_loop_and_counts_its_schedule_by_hand(split_tp_rows, stream):
    from harness.derive.parity import Verdict, judge

    rows = [row.to_dict() for row in split_tp_rows[stream]]
    precision = "bf16" if stream.startswith("bf16") else "fp32"
    assert [(r["spec"]["strategy"], r["spec"]["precision"]) for r in rows] == [("plain", precision), ("tp", precision)]
    assert rows[0]["spec"]["global_batch"] == rows[1]["spec"]["global_batch"]
    verdicts = [judgement.verdict for judgement in judge(rows)]
    assert verdicts == [Verdict.REFERENCE, Verdict.MATCH], [row["message"] for row in rows]

    row = rows[1]
    flags = {name: "sequence" in stream if name == "sequence_parallel" else "loss" in stream
             for name in ("sequence_parallel", "loss_parallel")}
    assert row["spec"]["options"] == {name: True for name, on in flags.items() if on}
    assert {name: row["measurements"]["strategy_config"][name] for name in flags} == flags
    K = row["spec"]["global_batch"] // B             # one replica runs the whole batch
    expected_by_hand = {kind: {"tp": figures} for kind, figures in
                        by_hand(K, **flags, bf16=precision == "bf16").items()}
    for rank, counts in enumerate(row["measurements"]["comm_per_step_by_rank"]):
        assert {kind: figures["by_group"] for kind, figures in counts.items()} == expected_by_hand, f"rank {rank}"
    expected = expected_by_group(row["measurements"])
    assert expected == expected_by_hand
    # With the vocabulary split, a rank holds half the tied 512 x 64 matrix too.
    whole_blocks_split = L * (3 * H * H + 3 * H + H * H + 4 * H * H + 4 * H + 4 * H * H) // 2
    kept = L * (2 * H + 2 * 2 * H) + 2 * H + 64 * H      # row-parallel biases, 2 norms; final norm; wpe
    assert whole_blocks_split + kept + 512 * H == 137_728     # tests/test_hybrid.py's tp slice at TP 2
    vocabulary = 512 * H // 2 if flags["loss_parallel"] else 512 * H
    assert row["measurements"]["parameters_held_by_rank"] == [whole_blocks_split + kept + vocabulary] * 2


def test_a_schedule_by_hand_at_a_glance():
    # K = 4 (a global batch of 16 in micro-batches of 4): the counts measured on this machine (2026-11-25).
    assert by_hand(4, sequence_parallel=True, loss_parallel=False, bf16=False) == {
        "all_gather": {"calls": 72, "bytes": 4_718_592}, "reduce_scatter": {"calls": 64, "bytes": 4_194_304},
        "all_reduce": {"calls": 18, "bytes": 4_608}}
    assert by_hand(4, sequence_parallel=False, loss_parallel=True, bf16=False) == {
        "all_reduce": {"calls": 84, "bytes": 4_730_880}}


def test_sequence_parallelism_must_divide_the_sequence():
    from harness.strategies import checked, get_strategy

    # gpt2-xl's 25 heads split over 5 ranks, but its 1,024 tokens do not.
    def spec(**options):
        return RunSpec(workload="gpt2-xl", strategy="tp", world_size=5, global_batch=10, micro_batch=2,
                       options=options)

    assert get_strategy("tp").layout_refusal(spec()) is None
    assert get_strategy("tp").layout_refusal(spec(sequence_parallel=True)) == (
        "sequence parallelism of 5 must divide gpt2-xl's sequence of 1024 tokens")
    with pytest.raises(SpecError, match="has no option 'sequence_parallel'"):
        checked(RunSpec(workload="gpt-tiny", strategy="fsdp2-tp", world_size=2, global_batch=8, micro_batch=4,
                        options={"sequence_parallel": True}))


def test_loss_parallelism_splits_the_padded_vocabulary_rows():
    from harness.strategies import get_strategy

    # Issue 61: gpt2-small was refused loss_parallel because its 50,257 tokens are odd, though the matrices it
    # splits have 50,304 rows (padded to 64, workloads/gpt.py): 50,304 / 2 = 25,152 and / 4 = 12,576 rows a rank.
    for size in (2, 4):
        spec = RunSpec(workload="gpt2-small", strategy="tp", world_size=size, global_batch=8, micro_batch=2,
                       options={"loss_parallel": True})
        assert get_strategy("tp").layout_refusal(spec) is None
    # gpt2-xl's 25 heads split over 5 ranks; 50,304 rows do not (50,304 = 5 x 10,060 + 4).
    xl = RunSpec(workload="gpt2-xl", strategy="tp", world_size=5, global_batch=10, micro_batch=2,
                 options={"loss_parallel": True})
    assert get_strategy("tp").layout_refusal(xl) == (
        "loss parallelism of 5 must divide gpt2-xl's vocabulary of 50304 rows (50257 tokens, padded)")
