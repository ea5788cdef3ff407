"""The collective cost model against times worked out by hand (alpha-beta model; harness.project.collectives).

Every expected figure below is arithmetic written out in the test, never the code's own output. The
one-link cases use alpha = 10 us per step and 1 GB/s (beta = 1 ns per byte). The two-level cases use a
cluster whose links differ in both terms, so that swapping them changes every answer: inside a node
alpha_i = 2 us and B_i = 100 GB/s per GPU (1e-11 s/byte), between nodes alpha_e = 10 us and B_e = 25 GB/s
per node (4e-11 s/byte).
"""

import pytest

from harness.project.cluster import Cluster, Link
from harness.project.collectives import (ClusterModel, collective_time, fastest_algorithm, one_link_time)
from one_line import assert_one_line_error   # tests/one_line.py

LINK = Link(latency_s=10e-6, bandwidth_bytes_per_s=1e9)
CLUSTER = Cluster(name="hand", gpus_per_node=8,
                  intra_node=Link(latency_s=2e-6, bandwidth_bytes_per_s=100e9),
                  inter_node=Link(latency_s=10e-6, bandwidth_bytes_per_s=25e9))


# ---- one link: Thakur, Rabenseifner and Gropp 2005; NCCL's ring ------------------------------------------

@pytest.mark.parametrize("ranks, size, expected", [
    (2, 1e6, 2 * 1 * 10e-6 + 2 * 1 / 2 * 1e6 * 1e-9),         # 20 us + 1 ms = 1.020 ms
    (4, 8e6, 2 * 3 * 10e-6 + 2 * 3 / 4 * 8e6 * 1e-9),         # 60 us + 12 ms = 12.06 ms
    (8, 1e3, 2 * 7 * 10e-6 + 2 * 7 / 8 * 1e3 * 1e-9),         # 140 us + 1.75 us = 141.75 us
    (16, 64e6, 2 * 15 * 10e-6 + 2 * 15 / 16 * 64e6 * 1e-9),   # 300 us + 120 ms = 120.3 ms
])
def test_ring_all_reduce_is_2_p_minus_1_steps_and_2_p_minus_1_over_p_of_the_size(ranks, size, expected):
    assert one_link_time("all_reduce", size, ranks, LINK) == pytest.approx(expected, rel=1e-12)


def test_ring_all_reduce_figures_written_out():
    # The same cases as plain numbers, so a formula shared by test and code cannot hide a slip in both.
    assert one_link_time("all_reduce", 1e6, 2, LINK) == pytest.approx(1.020e-3)
    assert one_link_time("all_reduce", 8e6, 4, LINK) == pytest.approx(12.06e-3)
    assert one_link_time("all_reduce", 1e3, 8, LINK) == pytest.approx(141.75e-6)
    assert one_link_time("all_reduce", 64e6, 16, LINK) == pytest.approx(0.1203)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("ranks, size, expected", [
    (2, 1e6, 0.510e-3),       # 1 x 10 us + 1/2 x 1 MB at 1 GB/s = 10 us + 0.5 ms
    (4, 8e6, 6.030e-3),       # 3 x 10 us + 3/4 x 8 MB = 30 us + 6 ms
    (8, 1e3, 70.875e-6),      # 7 x 10 us + 7/8 x 1 kB = 70 us + 0.875 us
])
def test_ring_all_gather_and_reduce_scatter_are_half_an_all_reduce(collective, ranks, size, expected):
    # n is nccl-tests' size: the whole gathered output / scattered input.
    assert one_link_time(collective, size, ranks, LINK) == pytest.approx(expected, rel=1e-12)


def test_tree_all_reduce_pays_two_tree_depths_of_latency_and_twice_the_size():
    # Double binary tree: 2 floor(log2 p) steps, 2n bytes per rank each way.
    assert one_link_time("all_reduce", 1e6, 8, LINK, "tree") == pytest.approx(60e-6 + 2e-3)   # depth 3
    assert one_link_time("all_reduce", 1e6, 16, LINK, "tree") == pytest.approx(80e-6 + 2e-3)  # depth 4
    assert one_link_time("all_reduce", 1e6, 6, LINK, "tree") == pytest.approx(40e-6 + 2e-3)   # depth 2


def test_broadcast_chain_and_pairwise_all_to_all():
    # Chain: p-1 hops of latency, the whole buffer once: 3 x 10 us + 1 ms.
    assert one_link_time("broadcast", 1e6, 4, LINK) == pytest.approx(1.030e-3)
    assert one_link_time("reduce", 1e6, 4, LINK) == pytest.approx(1.030e-3)
    # Pairwise exchange: 3 rounds of 2 MB each (n/p of an 8 MB send buffer): 3 x (10 us + 2 ms).
    assert one_link_time("all_to_all", 8e6, 4, LINK) == pytest.approx(6.030e-3)


def test_one_rank_moves_nothing():
    assert one_link_time("all_reduce", 1e9, 1, LINK) == 0.0
    assert collective_time("all_to_all", 1e9, 1, CLUSTER) == 0.0


# ---- two levels -------------------------------------------------------------------------------------------

def test_hierarchical_all_reduce_on_2_nodes_of_8_gpus():
    # n = 1 GB, m = 2 nodes, g = 8 GPUs each.
    # 1+3. reduce-scatter and all-gather inside the node, each (g-1) alpha_i + (g-1)/g n / B_i:
    #      2 x (7 x 2 us + 7/8 x 1e9 x 1e-11 s) = 2 x (14 us + 8.75 ms) = 17.528 ms
    # 2.   8 all-reduces of a 1/8 shard (125 MB) across 2 nodes at once, each at B_e / 8 = 3.125 GB/s:
    #      2 x 1 x 10 us + 2 x 1/2 x 125e6 / 3.125e9 = 20 us + 40 ms = 40.020 ms
    # total 57.548 ms. (With intra and inter swapped: 80.144 ms; with the NIC not shared: 22.548 ms.)
    assert collective_time("all_reduce", 1e9, 16, CLUSTER, "hierarchical") == pytest.approx(57.548e-3, rel=1e-12)


def test_ring_all_reduce_across_2_nodes_runs_at_the_slower_of_nvlink_and_the_nodes_nics():
    # 30 steps, 2 of them across nodes: 28 x 2 us + 2 x 10 us = 76 us; 2 x 15/16 x 1 GB through every GPU's
    # link (100 GB/s) and every node's NICs (25 GB/s): the NICs set the pace, 1.875e9 x 4e-11 = 75 ms.
    assert collective_time("all_reduce", 1e9, 16, CLUSTER) == pytest.approx(75.076e-3, rel=1e-12)


def test_tree_all_reduce_across_2_nodes():
    # 2 x (7 x 2 us + log2(2) x 10 us) = 48 us; 2 x 1 GB at 25 GB/s = 80 ms.
    assert collective_time("all_reduce", 1e9, 16, CLUSTER, "tree") == pytest.approx(80.048e-3, rel=1e-12)


def test_all_gather_and_broadcast_across_2_nodes():
    # All-gather: 14 x 2 us + 1 x 10 us = 38 us; 15/16 x 1 GB at 25 GB/s = 37.5 ms.
    assert collective_time("all_gather", 1e9, 16, CLUSTER) == pytest.approx(37.538e-3, rel=1e-12)
    assert collective_time("reduce_scatter", 1e9, 16, CLUSTER) == pytest.approx(37.538e-3, rel=1e-12)
    # Broadcast chain: 14 x 2 us + 1 x 10 us = 38 us; 1 GB at 25 GB/s = 40 ms.
    assert collective_time("broadcast", 1e9, 16, CLUSTER) == pytest.approx(40.038e-3, rel=1e-12)


def test_all_to_all_across_2_nodes_shares_each_nodes_nics_between_its_gpus():
    # n = 1.6 GB, so each pair exchanges n/p = 100 MB.
    # 7 rounds inside the node:  7 x (2 us + 1e8 x 1e-11 s)      = 7 x 1.002 ms  =   7.014 ms
    # 8 rounds across nodes, all 8 GPUs of a node at once: 8 x (10 us + 8 x 1e8 x 4e-11 s) = 8 x 32.01 ms
    #                                                                           = 256.080 ms
    assert collective_time("all_to_all", 1.6e9, 16, CLUSTER) == pytest.approx(263.094e-3, rel=1e-12)


def test_within_one_node_every_all_reduce_is_the_intra_node_ring_or_chain():
    # 8 ranks on one node: ring 14 x 2 us + 2 x 7/8 x 1 GB at 100 GB/s = 28 us + 17.5 ms.
    assert collective_time("all_reduce", 1e9, 8, CLUSTER) == pytest.approx(17.528e-3, rel=1e-12)
    assert collective_time("all_reduce", 1e9, 8, CLUSTER, "hierarchical") == pytest.approx(17.528e-3, rel=1e-12)
    # NCCL's tree inside a node is a chain: 2 x 7 x 2 us + 2 x 1 GB at 100 GB/s = 28 us + 20 ms.
    assert collective_time("all_reduce", 1e9, 8, CLUSTER, "tree") == pytest.approx(20.028e-3, rel=1e-12)
    # 4 ranks share a node too: 6 x 2 us + 2 x 3/4 x 1 GB at 100 GB/s.
    assert collective_time("all_reduce", 1e9, 4, CLUSTER) == pytest.approx(12e-6 + 15e-3, rel=1e-12)


def test_one_gpu_per_node_is_the_one_link_model_over_the_network():
    single = Cluster(name="g1", gpus_per_node=1, intra_node=CLUSTER.intra_node, inter_node=CLUSTER.inter_node)
    # 4 nodes: 6 x 10 us + 2 x 3/4 x 1 GB at 25 GB/s = 60 us + 60 ms, ring and hierarchical alike.
    assert collective_time("all_reduce", 1e9, 4, single) == pytest.approx(60.06e-3, rel=1e-12)
    assert collective_time("all_reduce", 1e9, 4, single, "hierarchical") == pytest.approx(60.06e-3, rel=1e-12)
    assert collective_time("all_reduce", 1e9, 4, single) == pytest.approx(
        one_link_time("all_reduce", 1e9, 4, CLUSTER.inter_node), rel=1e-12)


def test_fastest_all_reduce_is_the_tree_for_small_buffers_across_many_nodes_and_the_ring_for_large():
    # NCCL's choice: ring or tree. 128 nodes x 8, 1 kB (bytes terms below 0.1 us): ring 2046 steps, 254 of
    # them across nodes, 1792 x 2 us + 254 x 10 us = 6.124 ms; tree 2 x (7 x 2 us + log2(128) x 10 us) = 168 us.
    algorithm, seconds = fastest_algorithm("all_reduce", 1e3, 1024, CLUSTER)
    assert algorithm == "tree"
    assert seconds == pytest.approx(168e-6 + 2 * 1e3 * 4e-11, rel=1e-12)
    # 1 GB on 2 nodes: ring 75.076 ms, tree 80.048 ms. Horovod's hierarchical all-reduce (57.548 ms) is
    # opt-in, not NCCL's to choose; MPI's halving-doubling is 57.532 ms (test below).
    assert fastest_algorithm("all_reduce", 1e9, 16, CLUSTER) == ("ring", pytest.approx(75.076e-3))
    assert fastest_algorithm("all_reduce", 1e9, 16, CLUSTER, "mpi") == ("halving_doubling", pytest.approx(57.532e-3))


# ---- halving-doubling: Thakur, Rabenseifner and Gropp 2005, sec. 4.1, 4.2 and 4.4 ----------------------------

def test_halving_doubling_on_one_link_is_lg_p_steps_and_the_ring_s_bytes():
    # Recursive halving reduce-scatter: lg p alpha + (p-1)/p n beta; recursive doubling all-gather the same
    # steps reversed; Rabenseifner's all-reduce the two: 2 lg p alpha + 2(p-1)/p n beta. p = 8, n = 8 MB:
    # 3 x 10 us + 7/8 x 8 MB at 1 GB/s = 30 us + 7 ms; the all-reduce 14.06 ms (the ring's: 14.14 ms).
    assert one_link_time("reduce_scatter", 8e6, 8, LINK, "halving_doubling") == pytest.approx(7.03e-3, rel=1e-12)
    assert one_link_time("all_gather", 8e6, 8, LINK, "halving_doubling") == pytest.approx(7.03e-3, rel=1e-12)
    assert one_link_time("all_reduce", 8e6, 8, LINK, "halving_doubling") == pytest.approx(14.06e-3, rel=1e-12)
    assert one_link_time("all_reduce", 8e6, 8, LINK) == pytest.approx(14.14e-3, rel=1e-12)


def test_halving_doubling_on_2_nodes_of_8_keeps_the_larger_halves_inside_the_node():
    # 1 GB among 16 packed ranks, partners at distance 1, 2, 4, 8 exchanging 1/2, 1/4, 1/8, 1/16 GB:
    # inside the node 3 x 2 us + 7/8 GB at 100 GB/s = 8.756 ms; the step at distance 8 crosses with all
    # 8 GPUs at once, 1/16 GB each at 25/8 GB/s: 10 us + 20 ms. Reduce-scatter 28.766 ms, all-reduce twice.
    # Sending the larger halves across first (1/2 GB each at 25/8 GB/s) would take 160 ms on that step alone.
    assert collective_time("reduce_scatter", 1e9, 16, CLUSTER, "halving_doubling") == pytest.approx(28.766e-3)
    assert collective_time("all_gather", 1e9, 16, CLUSTER, "halving_doubling") == pytest.approx(28.766e-3)
    assert collective_time("all_reduce", 1e9, 16, CLUSTER, "halving_doubling") == pytest.approx(57.532e-3)
    # One node of 8 is the one-link form on the node's link: 2 x (3 x 2 us + 7/8 x 8 MB / 100 GB/s) = 152 us.
    assert collective_time("all_reduce", 8e6, 8, CLUSTER, "halving_doubling") == pytest.approx(152e-6, rel=1e-12)


def test_each_call_gets_the_least_modelled_time_among_its_library_s_algorithms():
    nccl = ClusterModel(CLUSTER)
    assert nccl.choose("all_reduce", 1e3, 1024) == ("tree", pytest.approx(168e-6 + 2 * 1e3 * 4e-11))
    assert nccl.choose("all_reduce", 1e9, 16) == ("ring", pytest.approx(75.076e-3))
    # NCCL's tree is all-reduce only: its all-gather is the ring (37.538 ms) though halving-doubling would
    # take 28.766 ms.
    assert nccl.choose("all_gather", 1e9, 16) == ("ring", pytest.approx(37.538e-3))
    mpi = ClusterModel(CLUSTER, library="mpi")
    assert mpi.choose("all_reduce", 1e9, 16) == ("halving_doubling", pytest.approx(57.532e-3))
    # 24 ranks (3 nodes) is not a power of two: MPI's all-reduce falls back on the ring,
    # 2 x 21 x 2 us + 2 x 2 x 10 us + 2 x 23/24 x 1 GB / 25 GB/s = 124 us + 76.667 ms.
    assert mpi.choose("all_reduce", 1e9, 24) == ("ring", pytest.approx(124e-6 + 2 * 23 / 24 * 1e9 / 25e9))
    # gloo runs rings only (gloo/allreduce.cc), even where halving-doubling would be faster.
    gloo = ClusterModel(CLUSTER, library="gloo")
    assert gloo.choose("all_reduce", 1e9, 16) == ("ring", pytest.approx(75.076e-3))
    assert gloo.choose("reduce_scatter", 1e9, 16) == ("ring", pytest.approx(37.538e-3))
    # --algorithm forces one whatever its time: the ring's 6.124 ms where the tree takes 168 us.
    forced = ClusterModel(CLUSTER, {"all_reduce": "ring"})
    assert forced.choose("all_reduce", 1e3, 1024) == ("ring", pytest.approx(6.124e-3 + 2 * 1023 / 1024 * 1e3 * 4e-11))
    assert forced.algorithm("all_gather", 1e3, 1024) == "ring"


def test_cluster_model_prices_each_collective_with_its_chosen_algorithm():
    model = ClusterModel(CLUSTER, {"all_reduce": "hierarchical"})
    assert model.collective_seconds("all_reduce", 1e9, 16) == pytest.approx(57.548e-3, rel=1e-12)
    assert model.collective_seconds("all_gather", 1e9, 16) == pytest.approx(37.538e-3, rel=1e-12)
    assert ClusterModel(CLUSTER).collective_seconds("all_reduce", 1e9, 16) == pytest.approx(75.076e-3, rel=1e-12)


# ---- point to point: a pipeline's sends ---------------------------------------------------------------------

def test_a_send_is_one_hop_inside_a_node_or_across_and_its_recv_costs_nothing():
    # 1 MB between two GPUs of a node: 2 us + 1e6 x 1e-11 s = 12 us; from each of a node's 8 GPUs to the next
    # node at once (stages a node apart), each with 1/8 of its 25 GB/s: 10 us + 1e6 x 8 x 4e-11 s = 330 us; on one
    # link: 10 us + 1 ms.
    assert collective_time("send", 1e6, 2, CLUSTER) == pytest.approx(2e-6 + 1e6 * 1e-11)
    across = CLUSTER.seen_by_interleaved_groups(8)       # the 8 ranks of a node each send to the next node at once
    assert collective_time("send", 1e6, 2, across) == pytest.approx(10e-6 + 1e6 * 8 * 4e-11)
    assert one_link_time("send", 1e6, 2, LINK) == pytest.approx(10e-6 + 1e6 * 1e-9)
    assert collective_time("recv", 1e6, 2, CLUSTER) == 0.0


# ---- bad input: one line naming what is wrong and what is allowed -------------------------------------------

@pytest.mark.parametrize("call, words", [
    (lambda: collective_time("all_reduce", 1e9, 12, CLUSTER), ["12", "whole nodes of 8", "multiple of 8"]),
    (lambda: collective_time("all_gather", 1e9, 16, CLUSTER, "tree"), ["tree", "all_gather", "ring"]),
    (lambda: collective_time("scatter", 1e6, 2, CLUSTER), ["scatter", "all_reduce"]),
    (lambda: collective_time("all_reduce", -1.0, 2, CLUSTER), ["size", ">= 0"]),
    (lambda: collective_time("all_reduce", 1e6, 0, CLUSTER), ["ranks", ">= 1"]),
    (lambda: one_link_time("all_reduce", 1e6, 4, LINK, "hierarchical"), ["hierarchical", "ring, tree"]),
    (lambda: ClusterModel(CLUSTER, {"broadcast": "ring"}), ["ring", "broadcast", "chain"]),
    (lambda: collective_time("all_reduce", 1e9, 24, CLUSTER, "halving_doubling"), ["halving_doubling", "24",
                                                                                   "power-of-two"]),
    (lambda: ClusterModel(CLUSTER, {"all_reduce": "halving_doubling"}).check_ranks(24), ["24", "power-of-two"]),
    (lambda: ClusterModel(CLUSTER, library="rccl"), ["rccl", "nccl, gloo, mpi"]),
])
def test_bad_input_is_one_line_naming_the_field_and_what_is_allowed(call, words):
    assert_one_line_error(call, words)
