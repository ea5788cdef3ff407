"""A row's expected traffic tallied as its counted traffic is shown: {collective: {group: {"calls", "bytes"}}},
so that a test holds both to one schedule worked out by hand."""

from __future__ import annotations

from typing import Any, Mapping


def expected_by_group(measurements: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    tally: dict[str, dict[str, dict[str, float]]] = {}
    for entry in measurements["comm_expected_per_step"]["collectives"]:
        group = tally.setdefault(entry["collective"], {}).setdefault(entry["group"], {"calls": 0, "bytes": 0})
        group["calls"] += entry["calls"]
        group["bytes"] += entry["calls"] * entry["size_bytes"]
    return tally
