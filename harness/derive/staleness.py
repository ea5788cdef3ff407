"""Staleness of an asynchronous parameter server's updates (harness.strategies.parameter_server_async), read
from a row: each server records, for every update it applied, how many updates it had applied since that
worker last pulled its shard (`strategy_figures_by_rank`). 0 for every update of a synchronous server; under
asynchronous updates with W workers of equal speed, about W - 1 (Dean et al. 2012 call such a gradient
"stale").

    median, max: over every applied update of every server;
    stale share: the updates with staleness > 0, over all applied.
"""

from __future__ import annotations

from statistics import median
from typing import Any, Mapping

ASYNCHRONOUS = "asynchronous"      # what an asynchronous strategy's `strategy_config["updates"]` says


def is_asynchronous(m: Mapping[str, Any]) -> bool:
    """Whether a row's measurements are of a strategy whose updates do not wait for every worker."""
    return (m.get("strategy_config") or {}).get("updates") == ASYNCHRONOUS


def staleness_of_updates(m: Mapping[str, Any]) -> list[int]:
    """Every applied update's staleness, server by server in rank order, each server's in the order applied."""
    return [int(s) for figures in m.get("strategy_figures_by_rank") or () for s in (figures or {}).get("staleness", ())]


def staleness_summary(m: Mapping[str, Any]) -> dict[str, Any] | None:
    """{updates, median, max, stale_share} of a row's applied updates; None where it recorded none."""
    found = staleness_of_updates(m)
    if not found:
        return None
    return {"updates": len(found), "median": median(found), "max": max(found),
            "stale_share": sum(1 for s in found if s > 0) / len(found)}
