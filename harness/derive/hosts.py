"""Whether a launch's ranks oversubscribed a host's CPU cores, from what each rank recorded.

    python -c "from harness.derive.hosts import host_load; print(host_load({'ranks_on_host_by_rank': [2, 2],
        'threads_by_rank': [1, 1], 'host_cpu_cores_by_rank': [1, 1]}))"

Each rank records the cell's ranks on its host (as its launcher counts them), its own CPU threads and its
host's cores (harness.rank.worker). The ranks of one cell on one host run with the same thread setting,
so a host's demand is ranks x threads; where it exceeds the cores, the ranks take turns on them and
their step times measure that sharing, not the strategy (docs/methodology.md, "On CPU"). Rows written before these
were recorded say nothing: None, never False.
"""

from __future__ import annotations

from typing import Any, Mapping


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def host_load(measurements: Mapping[str, Any]) -> dict[str, Any]:
    """`host_oversubscribed` (any rank's host ran more rank threads than it has cores; None where not
    recorded) and `host_load`, the most loaded host relative to its cores as text ("2 ranks x 1 thread on
    1 core"), prefixed "oversubscribed: " where it is."""
    ranks = measurements.get("ranks_on_host_by_rank")
    threads = measurements.get("threads_by_rank")
    cores = measurements.get("host_cpu_cores_by_rank")
    if not (ranks and threads and cores):
        return {"host_oversubscribed": None, "host_load": None}
    r, t, c = max(zip(ranks, threads, cores), key=lambda load: load[0] * load[1] / load[2])
    oversubscribed = r * t > c
    text = f"{_plural(r, 'rank')} x {_plural(t, 'thread')} on {_plural(c, 'core')}"
    return {"host_oversubscribed": oversubscribed, "host_load": f"oversubscribed: {text}" if oversubscribed else text}


def cell_host_load(launches: list[Mapping[str, Any]]) -> dict[str, Any]:
    """A cell's from its ok launches' `host_load` columns: oversubscribed where any launch was (its text
    then), else the first recorded launch's; None where none recorded it."""
    # A table's missing value may be None or NaN: only a real True or False was recorded.
    recorded = [launch for launch in launches if launch.get("host_oversubscribed") in (True, False)]
    if not recorded:
        return {"host_oversubscribed": None, "host_load": None}
    shown = next((launch for launch in recorded if launch["host_oversubscribed"]), recorded[0])
    return {"host_oversubscribed": bool(shown["host_oversubscribed"]), "host_load": shown["host_load"]}
