"""Whether a launch's ranks oversubscribed a machine's CPU cores, from what each rank recorded.

    python -c "from harness.derive.hosts import host_load; print(host_load({'ranks_on_host_by_rank': [2, 2],
        'threads_by_rank': [1, 1], 'host_cpu_cores_by_rank': [1, 1]}))"

Each rank records the cell's ranks on its host (as its launcher counts them), the cell's ranks on its machine
(every rank whose kernel has the same boot id: the nodes of an emulated cluster are network namespaces of one
machine, and their ranks share its cores), its own CPU threads and its host's cores (harness.rank.worker).
The ranks of one cell on one machine run with the same thread setting, so a machine's demand is ranks x
threads; where it exceeds the cores, the ranks take turns on them and their step times measure that sharing,
not the strategy (docs/methodology.md, "On CPU"). Rows of an emulated cluster written before the machine's
count was recorded had every rank of the cell on the one machine (environment.emulated_network), and are read
so. Rows written before any of these were recorded say nothing: None, never False.
"""

from __future__ import annotations

from typing import Any, Mapping


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def host_load(measurements: Mapping[str, Any], emulated_nodes: int = 0,
              world_size: int | None = None) -> dict[str, Any]:
    """`host_oversubscribed` (any rank's machine ran more rank threads than it has cores; None where not
    recorded) and `host_load`, the most loaded machine relative to its cores as text ("2 ranks x 1 thread on
    1 core", with "(4 emulated nodes, one machine)" where the cell's `emulated_nodes` > 1 were one machine's
    namespaces), prefixed "oversubscribed: " where it is. `world_size`: the cell's, for emulated rows that did
    not record their machine's count."""
    ranks = measurements.get("ranks_on_machine_by_rank") or measurements.get("ranks_on_host_by_rank")
    threads = measurements.get("threads_by_rank")
    cores = measurements.get("host_cpu_cores_by_rank")
    if not (ranks and threads and cores):
        return {"host_oversubscribed": None, "host_load": None}
    if emulated_nodes and world_size and not measurements.get("ranks_on_machine_by_rank"):
        ranks = [world_size] * len(ranks)
    r, t, c = max(zip(ranks, threads, cores), key=lambda load: load[0] * load[1] / load[2])
    oversubscribed = r * t > c
    text = f"{_plural(r, 'rank')} x {_plural(t, 'thread')} on {_plural(c, 'core')}"
    if emulated_nodes > 1:
        text += f" ({emulated_nodes} emulated nodes, one machine)"
    return {"host_oversubscribed": oversubscribed, "host_load": f"oversubscribed: {text}" if oversubscribed else text}


def row_host_load(row: Mapping[str, Any]) -> dict[str, Any]:
    """`host_load` of a raw row, its spec and environment saying whether its nodes were an emulation's."""
    spec = row["spec"]
    emulated = bool((row.get("environment") or {}).get("emulated_network"))
    return host_load(row.get("measurements") or {}, int(spec.get("nnodes") or 1) if emulated else 0,
                     int(spec["world_size"]))


def cell_host_load(launches: list[Mapping[str, Any]]) -> dict[str, Any]:
    """A cell's from its ok launches' `host_load` columns: oversubscribed where any launch was (its text
    then), else the first recorded launch's; None where none recorded it."""
    # A table's missing value may be None or NaN: only a real True or False was recorded.
    recorded = [launch for launch in launches if launch.get("host_oversubscribed") in (True, False)]
    if not recorded:
        return {"host_oversubscribed": None, "host_load": None}
    shown = next((launch for launch in recorded if launch["host_oversubscribed"]), recorded[0])
    return {"host_oversubscribed": bool(shown["host_oversubscribed"]), "host_load": shown["host_load"]}
