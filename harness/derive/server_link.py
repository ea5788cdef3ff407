"""A parameter server's links, read from a row's counted messages (harness.strategies.parameter_server): which
rank's link carries the most bytes a step, and how many times a worker's that is.

    worker link   = the bytes a worker sends (its gradient, P) and receives (the parameters, P) a step
    busiest link  = the largest of any rank's, sent and received apart (full duplex: each direction its own)
    ratio         = busiest / worker; with S dedicated servers and W workers a server carries W x P / S each
                    way, W / S times a worker's (Li et al. 2014, OSDI, "Scaling Distributed Machine Learning
                    with the Parameter Server"; the Horovod paper, Sergeev and Del Balso 2018, on why all-reduce
                    replaced it)

The server's link is named the bottleneck where it carries more than a worker's (W > S); a colocated layout
(every rank a worker and a server) has no link busier than another.
"""

from __future__ import annotations

from typing import Any, Mapping

from harness.derive.staleness import staleness_summary

SERVER_LINK, WORKER_LINK = "server", "worker"


def _each_way(counted: Mapping[str, Mapping[str, float]]) -> float:
    """The larger direction of one rank's bytes a step (what its link carries one way)."""
    return max(float((counted.get(kind) or {}).get("bytes", 0.0)) for kind in ("send", "recv"))


def dedicated_servers(m: Mapping[str, Any]) -> int:
    """The ranks of a parameter server's launch that serve and run no model (0 for any other strategy's row)."""
    config = m.get("strategy_config") or {}
    return len(set(config.get("servers_ranks") or ()) - set(config.get("workers") or ()))


def server_link_columns(m: Mapping[str, Any]) -> dict[str, Any]:
    """{workers, servers, worker_link_bytes_per_step, busiest_link, busiest_link_bytes_per_step,
    busiest_over_worker} for a parameter server's row, and its staleness (median, max) where it recorded any;
    {} for any other strategy's."""
    config = m.get("strategy_config") or {}
    by_rank = m.get("comm_per_step_by_rank")
    if "servers_ranks" not in config or not by_rank:
        return {}
    workers, servers = list(config["workers"]), list(config["servers_ranks"])
    worker = max(_each_way(by_rank[rank]) for rank in workers)
    busiest = max(range(len(by_rank)), key=lambda rank: _each_way(by_rank[rank]))
    dedicated = busiest in servers and busiest not in workers
    columns: dict[str, Any] = {
        "workers": len(workers), "servers": len(servers), "worker_link_bytes_per_step": worker,
        "busiest_link": SERVER_LINK if dedicated else WORKER_LINK,
        "busiest_link_bytes_per_step": _each_way(by_rank[busiest]),
        "busiest_over_worker": _each_way(by_rank[busiest]) / worker if worker else None,
    }
    staleness = staleness_summary(m)
    if staleness:
        columns.update(staleness_median=staleness["median"], staleness_max=staleness["max"])
    return columns
