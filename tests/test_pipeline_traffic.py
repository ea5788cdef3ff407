"""DeepSpeed's pipeline with data-parallel replicas: gpt-tiny on 2 stages x 2 replicas, its traffic counted on four
real ranks (tests/conftest.py `hybrid_rows`), stage by stage, against a schedule worked out here by hand from the model's shapes and DeepSpeed's
engine (harness.strategies.pipeline_traffic), and its parity with the plain loop."""

from __future__ import annotations

import pytest

from expected_traffic import expected_by_group

# gpt-tiny (workloads/gpt.py): vocabulary 512, 64 positions, 4 blocks of h = 64. DeepSpeed weighs each layer by
# its parameters, the head (tied to the embedding) by the embedding's: [36,864, 49,984 x 4, 128, 36,864], which
# partition_balanced cuts after the second block: stage 0 = embedding + 2 blocks (136,832 parameters), stage 1 =
# 2 blocks + final norm + the embedding's copy (136,960).
H = 64
EMBEDDING = 512 * H + 64 * H                                          # token and position embeddings
BLOCK = 2 * 2 * H + (H * 3 * H + 3 * H) + (H * H + H) + (H * 4 * H + 4 * H) + (4 * H * H + H)   # norms, 4 linears
NORM = 2 * H
STAGE_PARAMETERS = (EMBEDDING + 2 * BLOCK, 2 * BLOCK + NORM + EMBEDDING)
ACTIVATION = 4 * 64 * 64 * 4       # a micro-batch of 4 sequences at the cut, fp32: 65,536 B
TIED = 512 * 64 * 4                # the token embedding's gradient, fp32: 131,072 B
K = 4                              # global batch 32 over 2 replicas in micro-batches of 4


def test_the_hand_figures_add_up():
    assert (EMBEDDING, BLOCK) == (36_864, 49_984)
    assert STAGE_PARAMETERS == (136_832, 136_960)


@pytest.mark.launch
@pytest.mark.matrix
def test_a_2_stage_pipeline_of_2_replicas_counts_what_its_stages_should_send_and_matches_the_plain_loop(hybrid_rows):
    from harness.derive.parity import Verdict, judge

    rows = [hybrid_rows[name].to_dict() for name in ("plain", "pipeline")]     # tests/conftest.py, 4 ranks
    assert [j.verdict for j in judge(rows)] == [Verdict.REFERENCE, Verdict.MATCH]
    assert rows[1]["spec"]["options"] == {"stages": 2}
    m = rows[1]["measurements"]
    assert m["strategy_config"]["layer_boundaries"] == [0, 3, 7]
    for rank, counted in enumerate(m["comm_per_step_by_rank"]):
        stage = rank // 2          # DeepSpeed's topology: rank = stage x replicas + replica
        by_group = {kind: figures["by_group"] for kind, figures in counted.items()}
        gradients = 4 * STAGE_PARAMETERS[stage]
        expected = {
            # K activations forward and K gradients back across the one cut, on the default group.
            "send": {"world": {"calls": K, "bytes": K * ACTIVATION}},
            "recv": {"world": {"calls": K, "bytes": K * ACTIVATION}},
            # The tied embedding's gradient between the two stages; the stage's gradients among its 2 replicas;
            # the last stage's loss among its replicas.
            "all_reduce": {"tied": {"calls": 1, "bytes": TIED},
                           "dp": {"calls": 1 + (stage == 1), "bytes": gradients + 4 * (stage == 1)}},
            # The loss pair from the last stage along the pipeline.
            "broadcast": {"pp": {"calls": 1, "bytes": 8}},
        }
        assert by_group == expected, f"rank {rank}"
    # The strategy's expected traffic is its busiest stage's: stage 1's, whose gradients are the larger.
    expected = expected_by_group(m)
    assert expected == {kind: dict(groups) for kind, groups in {
        "send": {"world": {"calls": K, "bytes": K * ACTIVATION}},
        "recv": {"world": {"calls": K, "bytes": K * ACTIVATION}},
        "all_reduce": {"tied": {"calls": 1, "bytes": TIED}, "dp": {"calls": 2, "bytes": 4 * STAGE_PARAMETERS[1] + 4}},
        "broadcast": {"pp": {"calls": 1, "bytes": 8}}}.items()}


def test_the_stages_are_cut_where_deepspeeds_own_partition_functions_cut_them():
    # harness.strategies.pipeline_traffic writes DeepSpeed's two functions out so that a plan need not import it;
    # held here to the installed DeepSpeed's on layer weights like the workloads' (a repeated block, a large
    # embedding at either end), ties between equal runs, and fewer layers than stages.
    import random

    ds_utils = pytest.importorskip("deepspeed.runtime.utils")
    from harness.strategies.pipeline_traffic import partition_balanced, partition_uniform

    rng = random.Random(0)
    cases = [[EMBEDDING, *[BLOCK] * 4, NORM, EMBEDDING], [1] * 9, [5, 5, 5, 5], [3, 1], [0, 0, 7, 0]]
    cases += [[rng.choice((0, 1, rng.randrange(1, 10**9))) for _ in range(rng.randrange(1, 40))] for _ in range(40)]
    for weights in cases:
        for parts in (1, 2, 3, 4, 8):
            assert partition_balanced(weights, parts) == list(ds_utils.partition_balanced(weights, parts)), \
                (weights, parts)
            assert partition_uniform(len(weights), parts) == list(ds_utils.partition_uniform(len(weights), parts))


def test_the_planned_stage_traffic_of_2_stages_by_2_replicas_is_the_schedule_worked_by_hand():
    # What the test above counts on four ranks, planned from the layers on the meta device alone (a dry run's
    # figures): the cut after the second block, a micro-batch's activation at it, the stages' gradients.
    from harness.spec import RunSpec
    from harness.strategies import checked, get_strategy
    from workloads import get_workload

    spec = checked(RunSpec(workload="gpt-tiny", strategy="pipeline", world_size=4, global_batch=32, micro_batch=4,
                           precision="fp32", options={"stages": 2}, device="cpu"))
    traffic = get_strategy("pipeline").stage_traffic(spec, get_workload("gpt-tiny").build_layers_on_meta())
    for stage, planned in enumerate(traffic):
        assert planned.sends == planned.receives == ((K, ACTIVATION),)
        assert planned.tied_all_reduce == TIED
        assert planned.gradient_all_reduce == 4 * STAGE_PARAMETERS[stage]
        assert planned.loss_all_reduce == 4 * (stage == 1) and planned.loss_broadcast == 8
