"""A parameter server projected to 1024 GPUs (harness.project: Algorithm.STAR, ServerLinks, the ps strategy's
`expected_collectives` and `point_to_point`): every figure worked out here by hand from the formulas of
docs/projection.md ("Parameter server") and the preset's numbers written out below, never read from the code.

Dedicated, S servers and W workers, P the fp32 gradient bytes, n = P / S a message: a step has two phases that do
not overlap (gradients in, then parameters out); in each a server's link carries W n, a worker node's link g S n =
g P (g = min(W, 8) workers a node), and the busier sets the pace with one alpha a message:

    phase = W alpha_e + max(W n, g P) / B_e        comm = 2 x phase

Colocated (S = W): 2 (W - 1) sends of P / W a rank, its recvs carried by its peers' sends (a chain's hops).
"""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.project.cluster import Link, preset
from harness.project.collectives import (Algorithm, ClusterModel, ServerLinks, collective_time, fastest_algorithm,
                                         one_link_time)
from harness.project.facts import REGISTRY_FACTS
from harness.project.fit import Calibration, LinkFit, NodesCalibration
from harness.project.projection import Scaling, Scheduled, bases_from_rows, comm_seconds, description_basis, project
from harness.project.run import project_description
from harness.strategies import STRATEGIES
from harness.strategies.base import TrafficBytes
from one_line import assert_one_line_error   # tests/one_line.py
from test_project_hybrid import _plain_row   # gpt-tiny's plain loop at world size 1

# dgx-h100-ib as harness/project/presets.py gives it: 8 GPUs a node; inside a node 3.4 us a step and 450 GB/s a
# GPU (NVLink 4, 900 GB/s both ways); between nodes 14.0 us a step and 400 GB/s a node (8 x 400 Gb/s ConnectX-7).
ALPHA_I, B_I, ALPHA_E, B_E = 3.4e-6, 450e9, 14.0e-6, 400e9
DGX = ClusterModel(preset("dgx-h100-ib"))
DGX_RING = ClusterModel(preset("dgx-h100-ib"), {"all_reduce": "ring"})

PARAMETERS = 1_500_000_000    # 2^8 x 5,859,375: every server count up to 256 divides it
P = 6e9                       # 4 x 1.5e9 fp32 bytes, the gradient each worker sends and the parameters it gets back


def _comm(strategy, world_size, model=DGX, parameters=PARAMETERS):
    """Priced communication per step of a described model of `parameters` under `strategy` at `world_size`."""
    [point], _ = project_description([strategy], model, [world_size], [Scaling.WEAK], parameters=parameters,
                                     compute_s=0.12)
    return point


# ---- what a step sends: the strategy's own traffic -------------------------------------------------------------

def _busiest(workers, elements, **options):
    ps = STRATEGIES["ps"]
    # Gradient bytes of 2 an element, as a bf16 recipe would reduce them: a parameter server sends fp32 regardless.
    traffic = ps.expected_collectives(data_parallel=workers, micro_batches=4, options=ps.resolve_options(options),
                                      traffic=TrafficBytes(parameters=elements, gradients_reduced=2 * elements,
                                                           parameters_gathered=2 * elements))
    return {c.collective.value: (c.calls, c.size_bytes, c.ranks) for c in traffic.collectives}


def test_a_dedicated_server_takes_w_shards_and_a_colocated_rank_2_w_minus_1():
    # S = 8, W = 16: 16 gradient shards in and 16 parameter shards out, each 1.5e9 / 8 x 4 B = 750 MB.
    assert _busiest(16, PARAMETERS, servers=8) == {"send": (16, 750_000_000, 2), "recv": (16, 750_000_000, 2)}
    # 10 elements over 3 servers: shards of 4, 3 and 3 elements; the largest, 16 B.
    assert _busiest(5, 10, servers=3) == {"send": (5, 16, 2), "recv": (5, 16, 2)}
    # Colocated at W = 4: 2 x 3 = 6 messages each way of ceil(10 / 4) = 3 elements, 12 B.
    assert _busiest(4, 10, placement="colocated") == {"send": (6, 12, 2), "recv": (6, 12, 2)}
    assert REGISTRY_FACTS.point_to_point("ps", {"servers": 8}) == ("star", 8)
    assert REGISTRY_FACTS.point_to_point("ps", {"placement": "colocated"}) == ("chain", 0)
    assert REGISTRY_FACTS.point_to_point("pipeline", {}) == ("chain", 0)


# ---- the server's link -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("servers, workers, phase, figure", [
    # S = 1, W = 16: the server's link 16 x 6 GB = 96 GB against a worker node's 8 x 6 GB = 48 GB.
    (1, 16, 16 * ALPHA_E + 16 * P / B_E, 0.480448),              # 2 x (224 us + 240 ms)
    # S = 1, W = 1024: 1024 x 6 GB = 6.144 TB on the server's link.
    (1, 1024, 1024 * ALPHA_E + 1024 * P / B_E, 30.748672),       # 2 x (14.336 ms + 15.36 s)
    # S = 8, W = 16: the server's link 16 x 750 MB = 12 GB, a worker node's 8 x 6 GB = 48 GB: the node's link.
    (8, 16, 16 * ALPHA_E + 8 * P / B_E, 0.240448),               # 2 x (224 us + 120 ms)
    # S = 8, W = 1024: the server's link 1024 x 750 MB = 768 GB against 48 GB.
    (8, 1024, 1024 * ALPHA_E + 1024 * (P / 8) / B_E, 3.868672),  # 2 x (14.336 ms + 1.92 s)
])
def test_the_server_link_time_by_hand(servers, workers, phase, figure):
    point = _comm(f"ps[servers={servers}]", workers)
    assert point.comm_s == pytest.approx(2 * phase, rel=1e-12)
    assert point.comm_s == pytest.approx(figure, rel=1e-12)
    assert [(item.collective, item.calls, item.size_bytes) for item in point.schedule] == [
        ("send", workers, P / servers), ("recv", workers, P / servers)]


def test_workers_within_one_node_share_its_link_and_no_more():
    # W = 4 workers on one node (g = 4, not the node's 8 GPUs), S = 1: the server's link and the node's both carry
    # 4 x 6 GB a phase: 2 x (4 x 14 us + 4 x 6 GB / 400 GB/s) = 2 x (56 us + 60 ms).
    assert _comm("ps", 4).comm_s == pytest.approx(0.120112, rel=1e-12)
    # S = 4: the server's link carries 4 x 1.5 GB, the node's still 4 x 6 GB.
    assert _comm("ps[servers=4]", 4).comm_s == pytest.approx(0.120112, rel=1e-12)


def test_one_message_carries_its_share_of_the_busier_link():
    # S = 8, W = 16, n = 750 MB: the node's link carries 8 x 8 = 64 messages a phase where the server's carries 16,
    # so each of the server's 16 pays alpha_e + n / B_e x 64 / 16 = 14 us + 7.5 ms.
    links = ServerLinks(preset("dgx-h100-ib"), workers=16, servers=8)
    assert links.collective_seconds("send", 750e6, 2) == pytest.approx(14e-6 + 7.5e-3, rel=1e-12)
    assert links.collective_seconds("recv", 750e6, 2) == pytest.approx(14e-6 + 7.5e-3, rel=1e-12)
    assert links.bottleneck(750e6) == "worker node"
    assert links.phase_bytes(750e6) == (12e9, 48e9)


def test_a_stars_recv_is_priced_and_a_pipelines_recv_stays_free():
    cluster, link = preset("dgx-h100-ib"), Link(latency_s=10e-6, bandwidth_bytes_per_s=1e9)
    # One message on a server's link, each way: 14 us + 1 MB / 400 GB/s = 16.5 us; on one link 10 us + 1 ms.
    assert collective_time("recv", 1e6, 2, cluster, "star") == pytest.approx(16.5e-6, rel=1e-12)
    assert collective_time("send", 1e6, 2, cluster, "star") == pytest.approx(16.5e-6, rel=1e-12)
    assert one_link_time("recv", 1e6, 2, link, "star") == pytest.approx(1.010e-3, rel=1e-12)
    # A pipeline's hop: its recv is carried by the peer's send, and the library never picks the star for it.
    assert collective_time("recv", 1e6, 2, cluster) == 0.0
    assert one_link_time("recv", 1e6, 2, link) == 0.0
    assert fastest_algorithm("recv", 1e6, 2, cluster) == (Algorithm.CHAIN, 0.0)
    chosen, seconds = fastest_algorithm("send", 1e6, 2, cluster)
    assert chosen is Algorithm.CHAIN and seconds == pytest.approx(3.4e-6 + 1e6 / 450e9, rel=1e-12)
    # In a step: a pipeline's 4 recvs across nodes cost nothing; a server's 16 recvs at W = 16 cost 16 x 16.5 us
    # (the server's 16 MB a phase beats a worker node's 8 MB, so no share is taken off a message).
    pipeline = Scheduled(collective="recv", size_bytes=1e6, calls=4, group=2, stride=8)
    server = Scheduled(collective="recv", size_bytes=1e6, calls=16, servers=1)
    assert comm_seconds([pipeline], 16, DGX) == 0.0
    assert comm_seconds([server], 16, DGX) == pytest.approx(264e-6, rel=1e-12)
    assert_one_line_error(lambda: ClusterModel(cluster, {"send": "star"}), ["star", "not one to force", "chain"])


# ---- which link is the bottleneck, and the crossover -----------------------------------------------------------

def _bottleneck_note(point):
    [note] = [note for note in point.notes if note.startswith(f"N = {point.world_size}: bottleneck")]
    return note


def test_the_bottleneck_moves_from_the_servers_link_to_the_workers_node_link_as_servers_are_added():
    # W = 1024, g = 8: a worker node's link carries g P = 8 x 6 GB = 48 GB a phase whatever S; a server's, W P / S.
    # S = 64: 1024 x 93.75 MB = 96 GB, the server's; S = 128: 48 GB, a tie; S = 256: 24 GB, the node's.
    at_64, at_128, at_256 = (_comm(f"ps[servers={s}]", 1024) for s in (64, 128, 256))
    assert "the server's link (W P / S = 1024 x 9.375e+07 B = 9.6e+10 B a phase" in _bottleneck_note(at_64)
    assert "alike" in _bottleneck_note(at_128)
    assert "the workers' node link (g P = 8 x 6e+09 B = 4.8e+10 B a phase" in _bottleneck_note(at_256)
    # Small W: 8 workers fill one node, whose link carries 8 x 6 GB against a server's 8 x 750 MB at S = 8.
    assert "the workers' node link" in _bottleneck_note(_comm("ps[servers=8]", 8))
    # Every point says where the servers sit.
    assert ("N counts the W workers (GPUs); the S = 64 dedicated servers are 64 more hosts, one server a host with "
            "its node's whole inter-node link") in at_64.notes
    assert "the S = 1 dedicated server is 1 more host" in _comm("ps", 16).notes[0]


def test_the_crossover_one_server_loses_to_the_ring_and_enough_servers_reach_the_worker_node_floor():
    # DDP's ring at 1024 GPUs (128 nodes): 2 x 896 x 3.4 us + 2 x 127 x 14 us + 2 x 1023/1024 x 6 GB / 400 GB/s
    # = 6.0928 ms + 3.556 ms + 29.970703125 ms.
    ring = _comm("ddp", 1024, DGX_RING).comm_s
    assert ring == pytest.approx(0.039619503125, rel=1e-12)
    # One server: 2 x (1024 x 14 us + 1024 x 6 GB / 400 GB/s) = 30.748672 s, 776 times the ring.
    assert _comm("ps", 1024).comm_s == pytest.approx(30.748672, rel=1e-12)
    # More servers shrink the server's share until S = W / g = 128; from there the worker node's link, g P a phase,
    # sets the floor: 2 x (1024 x 14 us + 8 x 6 GB / 400 GB/s) = 0.268672 s, however many servers are added.
    by_servers = {s: _comm(f"ps[servers={s}]", 1024).comm_s for s in (8, 64, 128, 256)}
    assert by_servers == pytest.approx({8: 3.868672, 64: 0.508672, 128: 0.268672, 256: 0.268672}, rel=1e-12)
    # That floor is g = 8 times the ring's bandwidth term (2 P / B_e = 30 ms) plus the server's 2 W alpha_e.
    assert by_servers[256] == pytest.approx(8 * 2 * P / B_E + 2 * 1024 * ALPHA_E, rel=1e-12)
    assert all(comm > ring for comm in by_servers.values())


# ---- colocated: the ring's bytes, point to point --------------------------------------------------------------

def test_colocated_equals_the_rings_terms_on_one_link():
    # 8 ranks on one node: 2 x 7 = 14 sends of 6 GB / 8 = 750 MB over NVLink, the recvs carried by the peers'
    # sends: 14 x (3.4 us + 750 MB / 450 GB/s) = 47.6 us + 23.333 ms, the ring's 2 x 7 x 3.4 us + 2 x 7/8 x 6 GB
    # / 450 GB/s.
    colocated = _comm("ps[placement=colocated]", 8)
    assert colocated.comm_s == pytest.approx(14 * 3.4e-6 + 14 * 750e6 / 450e9, rel=1e-12)
    assert colocated.comm_s == pytest.approx(_comm("ddp", 8, DGX_RING).comm_s, rel=1e-12)
    assert colocated.algorithms == ("chain", "chain")
    # On a calibrated link (a send as a 2-rank broadcast, 100 us and 1 GB/s), 4 ranks of a 100 MB model: 6 x (100
    # us + 25 MB x 1 ns) = 0.1506 s, the ring's 2 x 3 x 100 us + 2 x 3/4 x 100 MB x 1 ns.
    assert _comm("ps[placement=colocated]", 4, _calibration(), parameters=25_000_000).comm_s == pytest.approx(
        0.1506, rel=1e-12)


def test_colocated_across_nodes_shares_each_nodes_link_among_its_ranks():
    # 16 ranks on 2 nodes: all 8 of a node send across at once, each at 400 / 8 GB/s: 30 messages of 375 MB,
    # 30 x (14 us + 375 MB x 8 / 400 GB/s) = 30 x 7.514 ms.
    assert _comm("ps[placement=colocated]", 16).comm_s == pytest.approx(0.22542, rel=1e-12)


# ---- on calibrations -------------------------------------------------------------------------------------------

def _calibration(latency_s=100e-6, seconds_per_byte=1e-9):
    """A one-level link whose only fit is the 2-rank broadcast a send is priced as."""
    return Calibration(fits={"broadcast": LinkFit(collective="broadcast", algorithm=Algorithm.CHAIN,
                                                  latency_s=latency_s, seconds_per_byte=seconds_per_byte, fixed_s=0.0,
                                                  world_sizes=(2,), residuals=())}, backend="gloo", device="cpu")


def test_on_a_calibration_every_message_of_a_star_is_a_send():
    # S = 2, W = 4, 100 MB: 4 sends and 4 recvs of 50 MB, each 100 us + 50 MB x 1 ns: 8 x 50.1 ms.
    point = _comm("ps[servers=2]", 4, _calibration(), parameters=25_000_000)
    assert point.comm_s == pytest.approx(0.4008, rel=1e-12)
    assert point.algorithms == ("star", "star")
    assert any("priced as one send on the calibrated link" in note for note in point.notes)


def test_on_the_emulated_cluster_a_star_crosses_once_workers_and_servers_fill_more_than_a_node():
    within, across = _calibration(10e-6, 1e-10), _calibration(1e-3, 1e-8)
    # W = 4 and S = 2 are 6 ranks: on one node of 8 they talk over its loopback, 8 x (10 us + 50 MB x 0.1 ns);
    # W = 8 and S = 2, 10 ranks, cross: 16 x (1 ms + 50 MB x 10 ns).
    nodes = NodesCalibration(within_node=within, across_nodes=across, ranks_per_node=8)
    assert _comm("ps[servers=2]", 4, nodes, parameters=25_000_000).comm_s == pytest.approx(8 * 5.01e-3, rel=1e-12)
    assert _comm("ps[servers=2]", 8, nodes, parameters=25_000_000).comm_s == pytest.approx(16 * 0.501, rel=1e-12)
    one_a_node = NodesCalibration(within_node=within, across_nodes=across, ranks_per_node=1)
    assert _comm("ps[servers=2]", 4, one_a_node, parameters=25_000_000).comm_s == pytest.approx(8 * 0.501, rel=1e-12)


# ---- from a measured row ---------------------------------------------------------------------------------------

GPT_TINY_P = 947_712    # gpt-tiny's 236,928 fp32 parameters (tests/test_parameter_server.py)


def _dedicated_row(step=0.25):
    """gpt-tiny under ps with one dedicated server at world size 3 (W = 2), global batch 16 in micro-batches of 4,
    counted as a launch counts it: every message among the launch's 3 ranks; the server (rank 2) sends and receives
    2 of P, each worker 1. No compute-only pass (a dedicated server runs no model)."""
    def counts(calls):
        return {kind: {"bytes": calls * GPT_TINY_P, "calls": calls, "bytes_by_group_size": {"3": calls * GPT_TINY_P}}
                for kind in ("send", "recv")}
    expected = [{"collective": kind, "size_bytes": GPT_TINY_P, "calls": 2, "ranks": 2, "group": "world", "stride": 1}
                for kind in ("send", "recv")]
    return {"schema_version": 2, "run_id": "ps-3", "cell_id": "c", "repeat": 0, "status": "ok", "message": "",
            "spec": {"workload": "gpt-tiny", "strategy": "ps", "world_size": 3, "global_batch": 16, "micro_batch": 4,
                     "precision": "fp32", "warmup_steps": 1, "timed_steps": 3, "seed": 0, "device": "cpu",
                     "nnodes": 1, "options": {"placement": "dedicated"}},
            "measurements": {"step_time_s": [step] * 3, "host_stalled_step_indices": [],
                             "compute_only_unavailable_because": "a dedicated server steps the optimizer",
                             "comm_per_step_by_rank": [counts(1), counts(1), counts(2)],
                             "comm_expected_per_step": {"collectives": expected, "not_modelled_because": ""},
                             "data_parallel": 2, "micro_batches_per_step": 2, "parameters": 236_928,
                             "parameters_held_by_rank": [236_928] * 3, "precision_recipe": "fp32"}}


def _plain_rows():
    """The plain loop at world size 1 at global batches 8 (0.16 s) and 4 (0.1 s): a basis of 8 samples a device
    takes the first; one of 16 / 3 = 5.3 (the launch's 3 ranks, not its 2 workers) would take the nearer 4."""
    rows = []
    for batch, step in ((8, 0.16), (4, 0.1)):
        row = _plain_row(step)
        row["run_id"], row["spec"]["global_batch"] = f"plain-{batch}", batch
        rows.append(row)
    return rows


def test_a_measured_dedicated_row_projects_its_workers_with_the_server_beside_them():
    [basis], skipped = bases_from_rows([_dedicated_row(), *_plain_rows()], REGISTRY_FACTS)
    assert skipped == []
    # 2 workers of 8 samples each; compute from the plain loop's 8 samples, 0.16 s.
    assert (basis.world_size, basis.per_device_batch) == (2, 8)
    assert basis.compute_s == pytest.approx(0.16, rel=1e-12)
    assert "measured at 3 ranks: 2 workers and 1 dedicated server" in basis.notes[0]
    [point], _ = project(basis, [16], DGX, REGISTRY_FACTS, [Scaling.WEAK])
    # 16 workers: the server's 16 sends and 16 recvs of P (2 counted at W = 2, x 16 / 2); its link carries 16 P
    # against a worker node's 8 P: 2 x (16 x 14 us + 16 x 947,712 B / 400 GB/s) = 2 x (224 us + 37.90848 us).
    assert [(item.collective, item.calls, item.size_bytes) for item in point.schedule] == [
        ("recv", 16, GPT_TINY_P), ("send", 16, GPT_TINY_P)]
    assert point.comm_s == pytest.approx(523.81696e-6, rel=1e-12)
    assert point.step_s == pytest.approx(0.16 + 523.81696e-6, rel=1e-12)


# ---- the command line ------------------------------------------------------------------------------------------

def test_harness_project_prints_ps_beside_ddp_with_the_server_count_as_an_option(capsys):
    assert main(["project", "--params", "1.5B", "--compute-ms", "120", "--cluster", "dgx-h100-ib", "--strategies",
                 "ddp,horovod,ps,ps[servers=8],ps[servers=64]", "--scaling", "weak", "--world-sizes", "8,1024"]) == 0
    printed = capsys.readouterr().out
    for label in ("described/ddp/", "described/horovod/", "described/ps/", "described/ps[servers=8]/",
                  "described/ps[servers=64]/"):
        assert label in printed
    assert "send=star recv=star" in printed and "\nweak     1024 " in printed


@pytest.mark.parametrize("strategy, words", [
    ("ps[foo=1]", ["no option 'foo'", "servers", "placement"]),
    ("ps[servers=0]", ["servers", ">= 1", "got 0"]),
    ("ps[placement=colocated,servers=2]", ["placement=colocated", "leave servers unset"]),
    ("ps[servers]", ["'ps[servers]'", "KEY=VALUE"]),
    ("ps[servers=8", ["'ps[servers=8'", "NAME[KEY=VALUE,...]"]),
])
def test_a_bad_strategy_is_one_line(strategy, words):
    assert_one_line_error(lambda: _comm(strategy, 8), words)


def test_a_description_basis_keeps_its_options_in_its_label():
    basis = description_basis(strategy="ps", parameters=10, compute_s=0.1, options={"servers": 8})
    assert basis.label == "described/ps[servers=8]/autocast"
