"""The synchronous parameter server (harness.strategies.parameter_server): its shards, roles and traffic worked out
by hand, and real cells against the plain loop.

Traffic per step, P the parameter bytes, W workers, S servers: with dedicated servers each worker sends P (its
gradient, S shards) and receives P (the updated parameters), and each server's link carries W x P / S in and as
much out; colocated (S = W), each rank sends its W - 1 peers their gradient shards and its own updated shard, P / W
a message. gpt-tiny has 236,928 fp32 parameters: P = 947,712 B.
"""

import pytest

from harness.spec import RunSpec, SpecError
from harness.strategies import STRATEGIES, checked
from harness.strategies.parameter_server import Roles, shard_bounds
from launch_streams import Stream, run_streams
from workloads import get_workload

PS = STRATEGIES["ps"]
PARAMETERS = 236_928
P = 4 * PARAMETERS                     # 947,712 B


def spec(world_size, **options):
    return RunSpec(workload="gpt-tiny", strategy="ps", world_size=world_size, global_batch=16, micro_batch=4,
                   options=options)


def test_shards_are_contiguous_and_the_first_ones_take_the_remainder():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(PARAMETERS, 2) == [(0, 118_464), (118_464, 236_928)]
    assert shard_bounds(5, 1) == [(0, 5)]


def test_dedicated_servers_are_the_last_ranks_and_colocated_ones_are_the_workers():
    assert Roles.of(3, 1, "dedicated") == Roles(workers=(0, 1), servers=(2,))
    assert Roles.of(6, 2, "dedicated") == Roles(workers=(0, 1, 2, 3), servers=(4, 5))
    assert Roles.of(4, 1, "colocated") == Roles(workers=(0, 1, 2, 3), servers=(0, 1, 2, 3))


@pytest.mark.parametrize("world_size, options, workers", [(3, {}, 2), (4, {"servers": 2}, 2), (5, {}, 4),
                                                          (4, {"placement": "colocated"}, 4)])
def test_the_workers_share_the_global_batch(world_size, options, workers):
    layout = PS.layout(checked(spec(world_size, **options)))
    assert layout.data_parallel == workers and layout.per_replica_batch == 16 // workers


def _busiest(world_size, **options):
    traffic = PS.expected_traffic(spec(world_size, **options), get_workload("gpt-tiny").build_layers())
    return {c.collective.value: (c.calls, c.size_bytes) for c in traffic.collectives}


def test_a_dedicated_servers_link_carries_w_times_p_over_s_each_way():
    # S = 1, W = 2: the server takes 2 gradients of P and sends 2 copies of P back.
    assert _busiest(3) == {"send": (2, P), "recv": (2, P)}
    # S = 2, W = 2: each server 2 x P / 2 each way; W = 4, S = 1: 4 x P.
    assert _busiest(4, servers=2) == {"send": (2, P // 2), "recv": (2, P // 2)}
    assert _busiest(5) == {"send": (4, P), "recv": (4, P)}


def test_a_colocated_rank_moves_the_bytes_of_a_ring_all_reduce_point_to_point():
    # W = 2: one gradient shard out and one parameter shard out, P / 2 each: 2 (W - 1) / W x P = P in all.
    assert _busiest(2, placement="colocated") == {"send": (2, P // 2), "recv": (2, P // 2)}
    # W = 4: 6 messages of P / 4 each way, 1.5 P = 2 x 3 / 4 x P.
    assert _busiest(4, placement="colocated") == {"send": (6, P // 4), "recv": (6, P // 4)}


def test_bad_layouts_are_refused_in_one_line():
    assert "needs a world size above it" in PS.skip_reason(spec(1))
    # 2 servers and 1 worker: the worker would send 2 messages a step where a server receives 1.
    assert "needs at least as many workers; this cell has 1" in PS.skip_reason(spec(3, servers=2))
    assert PS.skip_reason(spec(4, servers=2)) is None
    with pytest.raises(SpecError, match="leave servers unset"):
        checked(spec(2, placement="colocated", servers=2))
    with pytest.raises(SpecError, match="fp16"):
        checked(RunSpec(workload="gpt-tiny", strategy="ps", world_size=3, global_batch=16, micro_batch=4,
                        precision="fp16"))


# ---- launched: every layout at 2 and 4 workers, in fp32 and bf16, against the plain loop ---------------------------

LAYOUTS = {"dedicated-1": ("3,5", ("--option", "placement=dedicated")),
           "dedicated-2": ("4,6", ("--option", "placement=dedicated", "--option", "servers=2")),
           "colocated": ("2,4", ("--option", "placement=colocated"))}


@pytest.fixture(scope="module")
def ps_rows(tmp_path_factory):
    """{(layout, precision): {world size: row}}, each stream with the plain loop of its precision at world size 1."""
    streams = [Stream(f"{name}-{precision}", ("--workload", "gpt-tiny", "--world-sizes", sizes, "--precision", precision,
                                              "--global-batch", "16", "--strategy", "plain,ps", *options))
               for name, (sizes, options) in LAYOUTS.items() for precision in ("fp32", "bf16")]
    rows = run_streams(tmp_path_factory.mktemp("ps"), streams)
    return {tuple(name.rsplit("-", 1)): {row.spec.world_size: row for row in stream} for name, stream in rows.items()}


def _messages(traffic):
    return {kind: (figures["calls"], figures["bytes"]) for kind, figures in traffic.items()}


@pytest.mark.launch
@pytest.mark.matrix
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_matches_the_plain_loop_and_counts_the_messages_worked_out_by_hand(ps_rows, layout, precision):
    from harness.derive.parity import NORMS, Verdict, judge
    from harness.spec import Status

    rows = ps_rows[layout, precision]
    for world_size, row in rows.items():
        if world_size == 1:
            continue
        assert row.status is Status.OK, row.message
        parity = judge([row.to_dict(), rows[1].to_dict()])[0]
        assert parity.verdict is Verdict.MATCH, (layout, precision, world_size, parity)
        assert set(NORMS) <= set(parity.deviations)
        by_rank = [_messages(traffic) for traffic in row.measurements["comm_per_step_by_rank"]]
        if layout == "colocated":
            w = world_size
            assert by_rank == [{"send": (2 * (w - 1), 2 * (w - 1) * P // w),
                                "recv": (2 * (w - 1), 2 * (w - 1) * P // w)}] * w
            continue
        s = 2 if layout == "dedicated-2" else 1
        w = world_size - s
        worker = {"send": (s, P), "recv": (s, P)}               # P in all, in S shards
        server = {"send": (w, w * P // s), "recv": (w, w * P // s)}
        assert by_rank == [worker] * w + [server] * s, (layout, world_size)


def test_the_parameter_server_matrix_gives_the_users_server_count_to_its_dedicated_layouts():
    from harness.matrix import Machine, Selection, build_matrix
    from harness.spec import DeviceKind

    def layouts(options=()):
        specs = build_matrix("parameter-server", Machine(device=DeviceKind.CPU, devices_per_node=2),
                             Selection(options=options))
        return sorted((s.strategy, tuple(sorted(s.options_dict.items())), s.world_size) for s in specs
                      if s.strategy.startswith("ps"))

    # As planned: colocated at 2 and 4 workers; 1 and 2 dedicated servers, and ps-async's one, beside them.
    assert layouts() == [("ps", (("placement", "colocated"),), 2), ("ps", (("placement", "colocated"),), 4),
                         ("ps", (("placement", "dedicated"), ("servers", 1)), 3),
                         ("ps", (("placement", "dedicated"), ("servers", 1)), 5),
                         ("ps", (("placement", "dedicated"), ("servers", 2)), 4),
                         ("ps", (("placement", "dedicated"), ("servers", 2)), 6),
                         ("ps-async", (("servers", 1),), 3), ("ps-async", (("servers", 1),), 5)]
    # --option servers=3: 3 servers beside 2 and 4 workers, for ps and ps-async; no colocated layout takes it.
    assert layouts((("servers", 3),)) == [("ps", (("placement", "dedicated"), ("servers", 3)), 5),
                                          ("ps", (("placement", "dedicated"), ("servers", 3)), 7),
                                          ("ps-async", (("servers", 3),), 5), ("ps-async", (("servers", 3),), 7)]
