"""The report's "parameter server against all-reduce" lines: at each number of workers, the parameter servers'
cells beside DDP's and Horovod's on the same work (device, workload, precision, global batch, conditions), from
the cell table alone (harness.derive.cells; the links' figures in harness.derive.server_link).

A parameter server's launch holds its workers and, with dedicated servers, the server ranks beside them, so its
cells are set beside the all-reduce cells whose world size is its workers, not its world size. Where a server's
link carries more than a worker's it is named the bottleneck, with its bytes each way a step; ps-async's cells
carry the staleness of their updates (harness.derive.staleness), and their speed is all workers' together.
"""

from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

from harness.derive.server_link import SERVER_LINK

ALL_REDUCE = ("ddp", "horovod")
SAME_WORK = ["device", "workload", "precision", "global_batch", "conditions_id"]
MIB = float(1 << 20)
# The server's link is named the step's bottleneck where its bytes at the link's rate take at least this share of
# the step (the rest being compute and the workers' own messages).
BOTTLENECK_SHARE = 0.5


def parameter_server_lines(cells: pd.DataFrame) -> list[str]:
    """One line per number of workers that has a parameter server's cell; [] where none has."""
    if cells.empty or "workers" not in cells or not cells["workers"].map(_present).any():
        return []
    ok = cells[(cells["status"] == "ok") & cells["samples_per_s"].notna()]
    lines = []
    for _, group in ok.groupby(SAME_WORK, sort=False, dropna=False):
        records = group.to_dict("records")
        # A parameter server's row is one with a server's roles (harness.derive.server_link): ps, ps-async or a
        # strategy built on them.
        servers = [r for r in records if _present(r.get("workers"))]
        for workers in sorted({int(r["workers"]) for r in servers if _present(r.get("workers"))}):
            beside = [r for r in records if r["strategy"] in ALL_REDUCE and int(r["world_size"]) == workers]
            lines.append(_line(workers, group.iloc[0].to_dict(), beside
                               + [r for r in servers if _present(r.get("workers")) and int(r["workers"]) == workers]))
    return lines


def _line(workers: int, first: Mapping[str, Any], cells: list[Mapping[str, Any]]) -> str:
    ranked = sorted(cells, key=lambda r: -float(r["samples_per_s"]))
    conditions = first.get("conditions") if isinstance(first.get("conditions"), str) else ""
    speeds = ", ".join(f"{_name(r)} {float(r['samples_per_s']):.4g}" for r in ranked)
    line = (f"{first['workload']}, {workers} workers ({first['device']}, {first['precision']}, global batch "
            f"{int(first['global_batch'])}){' ' + conditions if conditions else ''}: samples/s {speeds}.")
    crowded = [_name(r) for r in ranked if r.get("host_oversubscribed") is True]
    if crowded:
        line += f" The ranks outnumbered the cores for {', '.join(crowded)}: their compute was time-sliced."
    for r in ranked:
        if r.get("busiest_link") == SERVER_LINK and _present(r.get("busiest_over_worker")) \
                and float(r["busiest_over_worker"]) > 1:
            line += f" {_name(r)}: {_server_link(r)}"
        if _present(r.get("staleness_max")):
            line += (f" {_name(r)}: updates applied as they arrive, staleness median {float(r['staleness_median']):g}, "
                     f"max {int(r['staleness_max'])} (not comparable with the synchronous cells' losses).")
    return line


def _server_link(r: Mapping[str, Any]) -> str:
    """The server's link, and whether it set the step's pace: its time at the link's recorded rate, both
    directions in turn for a synchronous server (it sends only once every gradient is in), one for ps-async's (it
    answers one worker while it receives another's), at least BOTTLENECK_SHARE of the step."""
    each_way = float(r["busiest_link_bytes_per_step"])
    carried = f"{each_way / MIB:.3g} MiB each way a step, {float(r['busiest_over_worker']):.3g}x a worker's"
    if not _spans_nodes(r):
        return f"its busiest link is the server's, {carried} (one host: a loopback, not a network's bottleneck)."
    rate = r.get("link_rate_bits_per_s")
    if not _present(rate) or not rate:
        return (f"its busiest link is the server's, {carried} (the link's rate is not recorded: whether it set the "
                "step's pace is not judged).")
    directions = 1 if _present(r.get("staleness_max")) else 2      # an asynchronous server records staleness
    link_s = directions * each_way * 8 / float(rate)
    step_s = float(r["global_batch"]) / float(r["samples_per_s"])
    timing = f"{link_s * 1e3:.3g} ms of its {step_s * 1e3:.3g} ms step at {float(rate) / 1e6:g} Mbit/s"
    if link_s >= BOTTLENECK_SHARE * step_s:
        return f"the bottleneck is the server's link, {carried}: {timing}."
    return f"its busiest link is the server's, {carried}: {timing}, under half of it."


def _name(record: Mapping[str, Any]) -> str:
    options = record.get("options") or ""
    name = f"{record['strategy']}[{options}]" if options else str(record["strategy"])
    ranks = int(record["world_size"])
    workers = record.get("workers")
    return name + (f" ({ranks} ranks)" if _present(workers) and int(workers) != ranks else "")


def _spans_nodes(record: Mapping[str, Any]) -> bool:
    nodes = record.get("nnodes")
    return _present(nodes) and int(nodes) > 1


def _present(value: Any) -> bool:
    return value is not None and value == value      # NaN is a missing value
