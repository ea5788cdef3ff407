"""Communication figures from rows: nccl-tests' bus bandwidth, and the bytes each rank puts on the wire.

    python -c "from harness.derive.comm import wire_bytes; print(wire_bytes('all_reduce', 4e6, 8))"

Sizes. The collective counter (harness.rank.comm_counter) and the strategies' expected traffic
(`Strategy.expected_traffic`, recorded as `comm_expected_per_step`) give every collective in nccl-tests'
"size": the all-reduced tensor, the whole gathered output of an all-gather, the whole scattered input of a
reduce-scatter, the send buffer of an all-to-all, the tensor of a broadcast, reduce, send or recv. Sizes
of different collective types are not comparable: an all-reduce of S bytes moves twice what an all-gather
of S bytes moves, so sizes are never added across types here.

Bus bandwidth (nccl-tests, doc/PERFORMANCE.md, "Bus Bandwidth"): algbw = size / time, busbw = algbw x f(n),
with f from each test's `*GetBw` function (NVIDIA/nccl-tests at a0b82b2, src/all_reduce.cu
AllReduceGetBw: 2(n-1)/n; src/all_gather.cu AllGatherGetBw and src/reduce_scatter.cu ReduceScatterGetBw:
(n-1)/n with size = count x typesize x nranks, the whole buffer; src/alltoall.cu AlltoAllGetBw: (n-1)/n;
src/broadcast.cu BroadcastGetBw, src/reduce.cu ReduceGetBw, src/sendrecv.cu SendRecvGetBw: 1).

Wire bytes. The same factor turns a size into the bytes one rank sends for it under the ring algorithm
(PERFORMANCE.md derives f from exactly that count: a ring all-reduce of S bytes makes each rank send
2(n-1)/n x S; a ring all-gather or reduce-scatter (n-1)/n x S; an all-to-all sends all but the rank's
own 1/n). Assumed where the factor is a convention rather than a count: a broadcast or reduce is a
pipelined chain in which every rank but one (the last of the chain, the root of a reduce) forwards the
whole buffer, so "f = 1" is the bytes a sending rank sends and over-counts the one rank that sends
nothing; a send sends its buffer (f = 1). A recv is the far end of a peer's send: its bytes (f = 1) are
bytes this rank received, reported under `recv` but left out of a rank's total, which counts what the
rank sends (in every symmetric collective that equals what it receives). A rank's total is the sum of
its wire bytes over collective types; at n = 1 every collective's wire bytes are 0.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Mapping


class Collective(enum.StrEnum):
    """The collective types the counter records and the strategies expect."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    SEND = "send"
    RECV = "recv"


BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    Collective.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    Collective.ALL_GATHER: lambda n: (n - 1) / n,
    Collective.REDUCE_SCATTER: lambda n: (n - 1) / n,
    Collective.ALL_TO_ALL: lambda n: (n - 1) / n,
    Collective.BROADCAST: lambda n: 1.0,
    Collective.REDUCE: lambda n: 1.0,
    Collective.SEND: lambda n: 1.0,
    Collective.RECV: lambda n: 1.0,
}
RECEIVED_ONLY = frozenset({Collective.RECV})     # wire bytes another rank sent: not in a rank's total


def bus_bandwidth(collective: str, size_bytes: float, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s for one collective of `size_bytes` that took `seconds` on `ranks` ranks."""
    algbw = size_bytes / seconds
    return algbw, algbw * _factor(collective, ranks)


def wire_bytes(collective: str, size_bytes: float, ranks: int) -> float:
    """Bytes one rank sends (a recv: receives) for collectives of `size_bytes` among `ranks` ranks (ring)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1 for {collective}, got {ranks}")
    if collective in (Collective.SEND, Collective.RECV):
        return float(size_bytes)
    return size_bytes * _factor(collective, ranks) if ranks > 1 else 0.0


def _factor(collective: str, ranks: int) -> float:
    try:
        return BUSBW_FACTORS[collective](ranks)
    except KeyError:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(BUSBW_FACTORS)}") from None


# ---- counted collectives -----------------------------------------------------------------------------


def rank_wire_bytes(counted: Mapping[str, Mapping[str, Any]], ranks: int) -> dict[str, float]:
    """{collective: wire bytes per step} of one rank's counted collectives (`comm_per_step_by_rank[i]`).

    Each collective's bytes are split by the size of the group they ran in where the counter recorded it
    (`bytes_by_group_size`); rows without it (schema 1) ran every collective among `ranks` ranks."""
    wire: dict[str, float] = {}
    for collective, figures in counted.items():
        by_group = figures.get("bytes_by_group_size") or {str(ranks): figures["bytes"]}
        wire[collective] = sum(wire_bytes(collective, size, int(group)) for group, size in by_group.items())
    return wire


def group_wire_bytes(counted: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """{group label: wire bytes per step} of one rank's counted collectives, recv left out, for rows whose counter
    named its groups (`by_group` with `group_ranks`: a tensor-parallel "tp" group apart from a data-parallel
    "dp" one, the default group "world"); {} for rows without."""
    wire: dict[str, float] = {}
    for collective, figures in counted.items():
        if collective in RECEIVED_ONLY:
            continue
        ranks = figures.get("group_ranks") or {}
        for label, by_group in (figures.get("by_group") or {}).items():
            if label in ranks:
                wire[label] = wire.get(label, 0.0) + wire_bytes(collective, by_group["bytes"], ranks[label])
    return wire


def sent_total(wire: Mapping[str, float]) -> float:
    """A rank's wire bytes summed over collective types, recv left out (a peer's send counts it)."""
    return sum(value for collective, value in wire.items() if collective not in RECEIVED_ONLY)


def element_bytes(counted: Mapping[str, Mapping[str, Any]]) -> dict[str, list[int]]:
    """{collective: sorted element sizes in bytes it was seen with} (empty where the row did not record)."""
    return {collective: sorted({d["element_bytes"] for d in (figures.get("dtypes") or {}).values()})
            for collective, figures in counted.items()}


# ---- expected (analytic) collectives -----------------------------------------------------------------


def expected_wire_bytes(measurements: Mapping[str, Any]) -> dict[str, float] | None:
    """{collective: wire bytes per step per rank} of the traffic the strategy said a step should issue,
    or None where it is not modelled (or the row predates the figure).

    New rows hold `comm_expected_per_step` (each collective's nccl-tests size per call, calls per step,
    ranks); schema-1 rows hold `comm_bytes_per_step_analytic` ({collective: size per step}, fp32
    assumed, among `data_parallel` ranks)."""
    expected = measurements.get("comm_expected_per_step")
    if expected is not None:
        if expected.get("not_modelled_because"):
            return None
        wire: dict[str, float] = {}
        for entry in expected["collectives"]:
            size = entry["size_bytes"] * entry["calls"]
            wire[entry["collective"]] = wire.get(entry["collective"], 0.0) + wire_bytes(
                entry["collective"], size, entry["ranks"])
        routed = _routed_all_to_all(measurements)
        if routed:
            wire[Collective.ALL_TO_ALL.value] = wire.get(Collective.ALL_TO_ALL.value, 0.0) + wire_bytes(
                Collective.ALL_TO_ALL.value, *routed)
        return wire
    legacy = measurements.get("comm_bytes_per_step_analytic")
    if legacy is None:
        return None
    ranks = int(measurements.get("data_parallel") or 1)
    return {collective: wire_bytes(collective, size, ranks) for collective, size in legacy.items()}


def _routed_all_to_all(measurements: Mapping[str, Any]) -> tuple[float, int] | None:
    """An expert-parallel row's all-to-all, expected from what its ranks routed (harness.derive.experts): the largest
    rank's bytes per timed step and the ranks of the group it ran among; None for any other row."""
    from harness.derive.experts import ALL_TO_ALL, expected_all_to_all_by_rank

    expected = expected_all_to_all_by_rank(measurements)
    if expected is None:
        return None
    sizes = {int(size) for rank in measurements.get("comm_per_step_by_rank") or []
             for size in ((rank.get(ALL_TO_ALL) or {}).get("bytes_by_group_size") or {})}
    return max(expected), max(sizes, default=1)


def expected_not_modelled_because(measurements: Mapping[str, Any]) -> str:
    expected = measurements.get("comm_expected_per_step") or {}
    return expected.get("not_modelled_because", "")


# ---- a row's columns ---------------------------------------------------------------------------------


def comm_columns(measurements: Mapping[str, Any]) -> dict[str, Any]:
    """Scalar communication columns of one row, for tables and plots (every figure per step per rank):

    - `comm_<type>_bytes_per_step`: nccl-tests size, largest rank (as counted);
    - `comm_<type>_wire_bytes_per_step`: bytes on the wire, largest rank;
    - `comm_wire_bytes_per_step`: the largest rank's total wire bytes (recv left out);
    - `comm_expected_wire_bytes_per_step`: the same for the strategy's expected traffic;
    - `comm_wire_over_expected`: their ratio, where both exist and the expectation is not 0;
    - `comm_group_<label>_wire_bytes_per_step`: the largest rank's wire bytes in each named group (`tp`, `dp`,
      `world`: `group_wire_bytes`), so that tensor parallelism's traffic shows apart from data parallelism's."""
    by_rank = measurements.get("comm_per_step_by_rank")
    if not by_rank:
        return {}
    ranks = int(measurements.get("data_parallel") or 1)
    wire_by_rank = [rank_wire_bytes(counted, ranks) for counted in by_rank]
    collectives = sorted({c for counted in by_rank for c in counted})
    columns: dict[str, Any] = {}
    for collective in collectives:
        columns[f"comm_{collective}_bytes_per_step"] = max(c.get(collective, {}).get("bytes", 0.0) for c in by_rank)
        columns[f"comm_{collective}_wire_bytes_per_step"] = max(w.get(collective, 0.0) for w in wire_by_rank)
    counted_total = max(sent_total(wire) for wire in wire_by_rank)
    expected = expected_wire_bytes(measurements)
    expected_total = sent_total(expected) if expected is not None else None
    columns["comm_wire_bytes_per_step"] = counted_total
    columns["comm_expected_wire_bytes_per_step"] = expected_total
    columns["comm_wire_over_expected"] = counted_total / expected_total if expected_total else None
    by_group = [group_wire_bytes(counted) for counted in by_rank]
    for label in sorted({label for wire in by_group for label in wire}):
        columns[f"comm_group_{label}_wire_bytes_per_step"] = max(wire.get(label, 0.0) for wire in by_group)
    return columns
