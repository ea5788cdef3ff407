"""Projection of the strategies whose traffic runs in groups of their own (harness.project.projection,
`grouped`): a 2-D fsdp2-tp row carried to 16 GPUs on two 8-GPU nodes, its tensor-parallel all-reduces priced
inside a node and its FSDP2 collectives on nodes shared by the groups beside them, every figure worked out
here from the alpha-beta ring formulas (docs/projection.md), not read from the code."""

from __future__ import annotations

import pytest

from harness.project.cluster import load_cluster
from harness.project.collectives import ClusterModel
from harness.project.facts import REGISTRY_FACTS
from harness.project.projection import Scaling, bases_from_rows, project
from harness.spec import SpecError

# 8 GPUs a node; 2 us and 100 GB/s inside a node, 10 us and 25 GB/s per node between nodes.
ALPHA_I, BETA_I, ALPHA_E, BETA_E = 2e-6, 1 / 100e9, 10e-6, 1 / 25e9
CLUSTER = load_cluster(None, {"gpus_per_node": 8, "intra_node_bandwidth_GBps": 100.0, "intra_node_latency_us": 2.0,
                              "inter_node_bandwidth_GBps": 25.0, "inter_node_latency_us": 10.0})
RING = ClusterModel(CLUSTER, {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "ring"})

# gpt-tiny at tp 2 (tests/test_hybrid.py works these out): a block's tp slice 25,184 parameters (100,736 B in
# fp32), the root's 36,992 (147,968 B); a micro-batch's activation 4 x 64 x 64 fp32 values, 65,536 B.
BLOCK, ROOT, ACTIVATION = 100_736, 147_968, 65_536
HELD = 4 * 25_184 + 36_992


def _fsdp2_tp_row(compute=0.2, beyond=0.05):
    """A gpt-tiny fsdp2-tp cell at 4 ranks (dp 2 x tp 2), global batch 32 in micro-batches of 4 (K = 4), with the
    counts tests/test_hybrid.py measured and the expected traffic its strategy gives (the same)."""
    steps, K = 3, 4
    def entry(collective, size, calls, ranks, group, stride):
        return {"collective": collective, "size_bytes": size, "calls": calls, "ranks": ranks, "group": group,
                "stride": stride}
    expected = [entry("all_reduce", ACTIVATION, 32, 2, "tp", 1), entry("all_reduce", ACTIVATION, 32, 2, "tp", 1),
                entry("all_gather", BLOCK, 2 * K * 4, 2, "dp", 2), entry("all_gather", ROOT, 2 * K, 2, "dp", 2),
                entry("reduce_scatter", BLOCK, 4, 2, "dp", 2), entry("reduce_scatter", ROOT, 1, 2, "dp", 2)]
    counted = {
        "all_reduce": {"bytes": 64 * ACTIVATION, "calls": 64, "bytes_by_group_size": {"2": 64 * ACTIVATION},
                       "by_group": {"tp": {"calls": 64, "bytes": 64 * ACTIVATION}}, "group_ranks": {"tp": 2}},
        "all_gather": {"bytes": 32 * BLOCK + 8 * ROOT, "calls": 40, "bytes_by_group_size": {"2": 32 * BLOCK + 8 * ROOT},
                       "by_group": {"dp": {"calls": 40, "bytes": 32 * BLOCK + 8 * ROOT}}, "group_ranks": {"dp": 2}},
        "reduce_scatter": {"bytes": 4 * BLOCK + ROOT, "calls": 5, "bytes_by_group_size": {"2": 4 * BLOCK + ROOT},
                           "by_group": {"dp": {"calls": 5, "bytes": 4 * BLOCK + ROOT}}, "group_ranks": {"dp": 2}}}
    return {"schema_version": 2, "run_id": "fsdp2-tp-4", "cell_id": "c", "repeat": 0, "status": "ok", "message": "",
            "spec": {"workload": "gpt-tiny", "strategy": "fsdp2-tp", "world_size": 4, "global_batch": 32,
                     "micro_batch": 4, "precision": "fp32", "warmup_steps": 1, "timed_steps": steps, "seed": 0,
                     "device": "cpu", "nnodes": 1, "options": {"tp": 2}},
            "measurements": {"step_time_s": [compute + beyond] * steps, "host_stalled_step_indices": [],
                             # As the worker records it: tensor parallelism has no communication-free pass.
                             "compute_only_unavailable_because": "tensor parallelism's all-reduces sit between "
                                                                 "a block's matmuls",
                             "comm_per_step_by_rank": [counted] * 4, "comm_expected_per_step": {
                                 "collectives": expected, "not_modelled_because": ""},
                             "data_parallel": 2, "micro_batches_per_step": K, "parameters": 236_928,
                             "parameters_held_by_rank": [HELD] * 4, "precision_recipe": "fp32",
                             "tokens_per_sample": 64}}


def _plain_row(step=0.8):
    """The plain loop on one device at the cells' global batch 32: 0.8 s, so 0.2 s for a rank's 8 samples."""
    return {"schema_version": 2, "run_id": "plain-1", "cell_id": "p", "repeat": 0, "status": "ok", "message": "",
            "spec": {"workload": "gpt-tiny", "strategy": "plain", "world_size": 1, "global_batch": 32,
                     "micro_batch": 4, "precision": "fp32", "warmup_steps": 1, "timed_steps": 3, "seed": 0,
                     "device": "cpu", "nnodes": 1, "options": {}},
            "measurements": {"step_time_s": [step] * 3, "host_stalled_step_indices": [], "data_parallel": 1,
                             "micro_batches_per_step": 8, "parameters": 236_928, "precision_recipe": "fp32"}}


def ring_all_reduce(n, ranks, alpha, beta):
    return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * n * beta


def test_a_2d_cell_is_projected_group_by_group_tp_inside_a_node_dp_across_shared_nodes():
    [basis], skipped = bases_from_rows([_fsdp2_tp_row(), _plain_row()], REGISTRY_FACTS)
    assert basis.grouped and "plain loop's world-size-1 step" in basis.compute_source
    assert basis.compute_s == pytest.approx(0.8 * 8 / 32)
    points, left_out = project(basis, [16], RING, REGISTRY_FACTS, scalings=(Scaling.WEAK,))
    [point] = points
    # Weak scaling at 16 ranks: 8 samples a rank, global batch 128, dp = 16 / 2 = 8 replicas of 16 samples, K = 4.
    assert (point.global_batch, point.micro_batches) == (128, 4)
    # TP: 4 blocks x (2 forward + 2 backward) x K = 64 all-reduces of 65,536 B among the 2 neighbours of a node:
    # a ring over the node's links.
    tp = 64 * ring_all_reduce(ACTIVATION, 2, ALPHA_I, BETA_I)
    # DP: 8 ranks 2 apart on two nodes of 8: 4 of them on each node, and the 2 dp groups (one per tp slice)
    # cross each node's boundary at once, each at half its 25 GB/s. A ring all-gather (reduce-scatter alike) of
    # n B: p - 1 = 7 steps, m - 1 = 1 of them across nodes; 7/8 n through the slower of a GPU's link and its
    # share of the node's (12.5 GB/s).
    def ring_half(n):
        return 6 * ALPHA_I + 1 * ALPHA_E + 7 / 8 * n * max(BETA_I, 2 * BETA_E)
    dp = (32 * ring_half(BLOCK) + 8 * ring_half(ROOT)) + (4 * ring_half(BLOCK) + ring_half(ROOT))
    assert point.comm_s == pytest.approx(tp + dp, rel=1e-12)
    # Wire bytes a rank sends: the tp ring's 2 (p-1)/p and the dp rings' (p-1)/p of each call.
    assert point.wire_bytes_per_rank == pytest.approx(64 * ACTIVATION + 7 / 8 * (36 * BLOCK + 9 * ROOT), rel=1e-12)
    # FSDP2 shards the tp slice's 16 fp32 bytes a parameter over the 8 dp ranks (ZeRO-3's plan).
    assert point.model_state_bytes_per_rank == pytest.approx(16 * HELD / 8)


def test_tensor_parallelism_beyond_a_node_or_the_heads_is_left_out_with_the_rule():
    [basis], _ = bases_from_rows([_fsdp2_tp_row(), _plain_row()], REGISTRY_FACTS)
    # Strong scaling of global batch 32 at 32 ranks: dp 16 replicas of 2 samples cannot make micro-batches of 4.
    points, left_out = project(basis, [8, 32], RING, REGISTRY_FACTS, scalings=(Scaling.STRONG,))
    assert [p.world_size for p in points] == [8]
    assert len(left_out) == 1 and "at 32" in left_out[0] and "16 x 4" in left_out[0], left_out
    with pytest.raises(SpecError, match="must divide gpt-tiny's 4 heads"):
        REGISTRY_FACTS.expected_for_cell(workload="gpt-tiny", strategy="tp", options={}, precision="fp32",
                                         world_size=8, global_batch=32, micro_batch=4, gpus_per_node=8)
    with pytest.raises(SpecError, match="within one node"):
        REGISTRY_FACTS.expected_for_cell(workload="gpt2-medium", strategy="tp", options={}, precision="bf16",
                                         world_size=16, global_batch=32, micro_batch=2, gpus_per_node=8)


def test_interleaved_groups_see_fewer_ranks_per_node_and_a_share_of_its_links():
    assert CLUSTER.seen_by_interleaved_groups(1) is CLUSTER
    two = CLUSTER.seen_by_interleaved_groups(2)
    assert (two.gpus_per_node, two.inter_node.bandwidth_bytes_per_s, two.intra_node) == (4, 12.5e9, CLUSTER.intra_node)
    sixteen = CLUSTER.seen_by_interleaved_groups(16)          # one rank a node, all 8 groups through its NICs
    assert (sixteen.gpus_per_node, sixteen.inter_node.bandwidth_bytes_per_s) == (1, 25e9 / 8)
    with pytest.raises(SpecError, match="do not tile nodes of 8"):
        CLUSTER.seen_by_interleaved_groups(3)


def _pipeline_row(compute=0.2, beyond=0.05):
    """A gpt-tiny pipeline cell at 4 ranks (2 stages x 2 replicas), global batch 32 in micro-batches of 4 (K = 4),
    as tests/test_pipeline_traffic.py measured it: its busiest stage, the last, sends and receives 4 activations
    of 65,536 B, all-reduces the tied embedding's 131,072 B with the first stage, its 547,840 B of gradients and
    its 4 B loss among its 2 replicas, and broadcasts the 8 B loss pair along the pipeline."""
    steps = 3
    def entry(collective, size, calls, ranks, group, stride):
        return {"collective": collective, "size_bytes": size, "calls": calls, "ranks": ranks, "group": group,
                "stride": stride}
    expected = [entry("send", ACTIVATION, 4, 2, "world", 2), entry("recv", ACTIVATION, 4, 2, "world", 2),
                entry("all_reduce", 131_072, 1, 2, "tied", 2), entry("all_reduce", 547_840, 1, 2, "dp", 1),
                entry("all_reduce", 4, 1, 2, "dp", 1), entry("broadcast", 8, 1, 2, "pp", 2)]
    def counts(calls, size, group, ranks):
        return {"bytes": size, "calls": calls, "bytes_by_group_size": {str(ranks): size},
                "by_group": {group: {"calls": calls, "bytes": size}}, "group_ranks": {group: ranks}}
    counted = {"send": counts(4, 4 * ACTIVATION, "world", 4), "recv": counts(4, 4 * ACTIVATION, "world", 4),
               "broadcast": counts(1, 8, "pp", 2),
               "all_reduce": {"bytes": 131_072 + 547_844, "calls": 3, "bytes_by_group_size": {"2": 131_072 + 547_844},
                              "by_group": {"tied": {"calls": 1, "bytes": 131_072}, "dp": {"calls": 2, "bytes": 547_844}},
                              "group_ranks": {"tied": 2, "dp": 2}}}
    row = _fsdp2_tp_row(compute, beyond)
    row["run_id"] = "pipeline-4"
    row["spec"].update(strategy="pipeline", options={"stages": 2})
    row["measurements"].update(comm_per_step_by_rank=[counted] * 4, parameters_held_by_rank=[136_960] * 4,
                               comm_expected_per_step={"collectives": expected, "not_modelled_because": ""},
                               compute_only_unavailable_because="a stage's work has no communication-free "
                                                                "equivalent")
    return row


def test_a_pipeline_of_2_stages_is_projected_with_its_sends_across_nodes_and_its_bubble():
    [basis], _ = bases_from_rows([_pipeline_row(), _plain_row()], REGISTRY_FACTS)
    assert basis.grouped
    [point], _ = project(basis, [16], RING, REGISTRY_FACTS, scalings=(Scaling.WEAK,))
    # 16 ranks on two nodes: stage 0 is node 0's 8 ranks, stage 1 node 1's (8 replicas, K = 16 / 4 = 4). The busiest
    # stage sends K activations across the boundary, the node's 8 ranks at once, each with 1/8 of 25 GB/s; its
    # receives cost nothing of its own.
    sends = 4 * (ALPHA_E + ACTIVATION * 8 * BETA_E)
    # The tied gradient between a rank of node 0 and one of node 1 (stride 8: one rank a node, the 8 pairs
    # sharing the NICs): a ring of 2 ranks on 2 nodes, 2 steps across, 2 x 1/2 of the bytes at 1/8 of B_e.
    tied = 2 * ALPHA_E + 131_072 * 8 * BETA_E
    # The stage's 8 replicas are one node: its gradients and the loss in a ring over the node's links.
    dp = ring_all_reduce(547_840, 8, ALPHA_I, BETA_I) + ring_all_reduce(4, 8, ALPHA_I, BETA_I)
    # The loss pair along the pipeline: one hop across, shared by the node's 8 ranks.
    loss = ALPHA_E + 8 * 8 * BETA_E
    assert point.comm_s == pytest.approx(sends + tied + dp + loss, rel=1e-12)
    # Compute: 0.2 s at 8 samples a rank, in the bubble of 1F1B: (K + S - 1) / K = 5 / 4.
    assert point.compute_s == pytest.approx(0.2 * 5 / 4)
    # Without a calibration of the measuring host all of it is exposed (f = 1).
    assert point.step_s == pytest.approx(0.25 + sends + tied + dp + loss)


def _tp_row():
    """gpt-tiny under `tp` at 2 ranks, global batch 32 (K = 8 micro-batches of 4, every rank on all of them)."""
    row = _fsdp2_tp_row()
    calls = 4 * 4 * 8
    row["run_id"] = "tp-2"
    row["spec"].update(strategy="tp", world_size=2, options={})
    row["measurements"].update(
        data_parallel=1, micro_batches_per_step=8, parameters_held_by_rank=[HELD] * 2,
        comm_per_step_by_rank=[{"all_reduce": {"bytes": calls * ACTIVATION, "calls": calls,
                                               "bytes_by_group_size": {"2": calls * ACTIVATION},
                                               "by_group": {"tp": {"calls": calls, "bytes": calls * ACTIVATION}},
                                               "group_ranks": {"tp": 2}}}] * 2,
        comm_expected_per_step={"collectives": [
            {"collective": "all_reduce", "size_bytes": ACTIVATION, "calls": calls // 2, "ranks": 2, "group": "tp",
             "stride": 1}] * 2, "not_modelled_because": ""})
    return row


def test_tp_holds_a_smaller_slice_at_each_degree_and_stops_at_the_heads():
    [basis], _ = bases_from_rows([_tp_row(), _plain_row()], REGISTRY_FACTS)
    points, left_out = project(basis, [4, 8], RING, REGISTRY_FACTS, scalings=(Scaling.STRONG,))
    [four] = points
    # At TP 4 a block keeps its norms (256) whole, a quarter of c_attn (12,480), c_fc (16,640) and the two
    # projections' weights (4,096 and 16,384), and their biases (64 each) whole; the root (36,992) whole:
    # 4 x 12,784 + 36,992 = 88,128 parameters, 16 bytes each in fp32 with AdamW.
    assert four.model_state_bytes_per_rank == 16 * (4 * (256 + 12_480 // 4 + 4_096 // 4 + 64 + 16_640 // 4
                                                         + 16_384 // 4 + 64) + 36_992)
    assert len(left_out) == 1 and "must divide gpt-tiny's 4 heads" in left_out[0]


def test_a_counted_schedule_that_departs_from_the_expected_one_is_said():
    row = _fsdp2_tp_row()
    for counted in row["measurements"]["comm_per_step_by_rank"]:
        counted["all_gather"] = {**counted["all_gather"], "by_group": {"dp": {"calls": 35, "bytes": 3_000_000}}}
    [basis], _ = bases_from_rows([row, _plain_row()], REGISTRY_FACTS)
    assert any(note.startswith("counted all_gather in group dp: 35 calls") for note in basis.notes), basis.notes
