"""The parameter server's links and the report's lines on them, from rows built by hand: P = 947,712 B (gpt-tiny's
236,928 fp32 parameters), W workers and S dedicated servers; a worker sends and receives P a step, a server W x P / S
each way (harness.derive.server_link)."""

import pandas as pd

from harness.derive.server_link import server_link_columns
from harness.report.parameter_server import parameter_server_lines

P = 947_712


def _counted(sent, received):
    return {"send": {"calls": 1, "bytes": sent}, "recv": {"calls": 1, "bytes": received}}


def test_a_dedicated_server_carries_w_over_s_times_a_workers_bytes_and_is_named():
    # W = 4, S = 1: ranks 0-3 workers (P each way), rank 4 the server (4 P each way).
    m = {"strategy_config": {"workers": [0, 1, 2, 3], "servers_ranks": [4]},
         "comm_per_step_by_rank": [_counted(P, P)] * 4 + [_counted(4 * P, 4 * P)]}
    assert server_link_columns(m) == {"workers": 4, "servers": 1, "worker_link_bytes_per_step": P,
                                      "busiest_link": "server", "busiest_link_bytes_per_step": 4 * P,
                                      "busiest_over_worker": 4.0}


def test_a_colocated_layout_has_no_link_busier_than_a_workers():
    # W = S = 2: each rank sends its peer a gradient shard and a parameter shard, P / 2 each: P a step each way.
    m = {"strategy_config": {"workers": [0, 1], "servers_ranks": [0, 1]},
         "comm_per_step_by_rank": [_counted(P, P)] * 2}
    columns = server_link_columns(m)
    assert columns["busiest_link"] == "worker" and columns["busiest_over_worker"] == 1.0


def test_other_strategies_have_no_server_link_and_staleness_joins_where_recorded():
    assert server_link_columns({"strategy_config": {}, "comm_per_step_by_rank": [_counted(P, P)]}) == {}
    m = {"strategy_config": {"workers": [0, 1], "servers_ranks": [2], "updates": "asynchronous"},
         "comm_per_step_by_rank": [_counted(P, P)] * 2 + [_counted(2 * P, 2 * P)],
         "strategy_figures_by_rank": [{}, {}, {"staleness": [0, 1, 3, 1]}]}
    # staleness 0, 1, 1, 3: median 1, max 3.
    assert server_link_columns(m)["staleness_median"] == 1 and server_link_columns(m)["staleness_max"] == 3


def _cell(strategy, world_size, samples, nnodes=1, options="", **extra):
    return {"device": "cpu", "workload": "gpt-tiny", "precision": "fp32", "global_batch": 32, "conditions_id": "c",
            "conditions": "", "strategy": strategy, "options": options, "world_size": world_size, "nnodes": nnodes,
            "status": "ok", "samples_per_s": samples, **extra}


def test_the_report_sets_a_parameter_server_beside_all_reduce_at_its_workers_and_names_the_server_link():
    server = dict(workers=4, servers=1, busiest_link="server", busiest_link_bytes_per_step=4 * P,
                  busiest_over_worker=4.0)
    cells = pd.DataFrame([_cell("ddp", 4, 500.0, nnodes=4), _cell("ddp", 5, 400.0, nnodes=5),
                          _cell("ps", 5, 40.0, nnodes=5, options="servers=1", link_rate_bits_per_s=100e6, **server)])
    [line] = parameter_server_lines(cells)
    # Beside DDP at 4 ranks (its 4 workers), not at 5 (its world size); 4 P = 3,790,848 B = 3.62 MiB.
    assert line.startswith("gpt-tiny, 4 workers (cpu, fp32, global batch 32): samples/s ddp 500, "
                           "ps[servers=1] (5 ranks) 40.")
    # At 100 Mbit/s the server's link takes 2 directions x 3,790,848 B x 8 / 1e8 = 606.5 ms of the 32 / 40 = 800 ms
    # step: more than half, the bottleneck.
    assert ("ps[servers=1] (5 ranks): the bottleneck is the server's link, 3.62 MiB each way a step, 4x a worker's: "
            "607 ms of its 800 ms step at 100 Mbit/s.") in line
    # At 1000 Mbit/s the same bytes take 60.65 ms of the 800: under half, named but not the bottleneck.
    faster = cells.assign(link_rate_bits_per_s=[None, None, 1e9])
    assert "its busiest link is the server's, 3.62 MiB each way a step, 4x a worker's: 60.7 ms of its 800 ms step " \
           "at 1000 Mbit/s, under half of it." in parameter_server_lines(faster)[0]
    # ps-async answers one worker while it receives another's: one direction, 303.3 ms of 800, under half.
    asynchronous = cells.assign(strategy=["ddp", "ddp", "ps-async"], staleness_median=[None, None, 3.0],
                                staleness_max=[None, None, 4.0])
    assert "303 ms of its 800 ms step at 100 Mbit/s, under half of it." in parameter_server_lines(asynchronous)[0]
    # Across real hosts, with no rate recorded, the share is not judged; on one host the link is a loopback.
    unrecorded = cells.assign(link_rate_bits_per_s=[None, None, None])
    assert "(the link's rate is not recorded: whether it set the step's pace is not judged)" in \
        parameter_server_lines(unrecorded)[0]
    local = pd.DataFrame([_cell("ddp", 4, 500.0), _cell("ps", 5, 250.0, options="servers=1", **server)])
    assert "its busiest link is the server's, 3.62 MiB each way a step, 4x a worker's (one host" in \
        parameter_server_lines(local)[0]
    assert parameter_server_lines(pd.DataFrame([_cell("ddp", 4, 500.0)])) == []
