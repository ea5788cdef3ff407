"""An MoE cell's expert figures, derived when rows are read: the all-to-all bytes each rank's counter saw beside those
the rows it routed make it expect, and the load imbalance of the router's choices.

An expert-parallel rank's all-to-all traffic follows the routing, so its strategy cannot state it before the run as it
states an all-reduce's. Each rank records instead, per step, the rows it sent and received and the bytes they make its
counter expect (harness.strategies.expert_parallel.expected_all_to_all_bytes: per block and micro-batch
(2 T k + 2 R) x d x the element size + 8 E), and the mean over the timed steps, the steps the counter counts. The two
must agree to the byte: a dispatch that sent more or other rows than its routing asked for shows as a ratio off 1.

Load imbalance (harness.rank.routing): the most tokens an expert of a block received in a step over the mean, the
largest over blocks and steps; 1 where the router spread the tokens evenly. Expert parallelism's step waits for its
busiest expert's rank.
"""

from __future__ import annotations

from typing import Any, Mapping

ALL_TO_ALL = "all_to_all"


def expected_all_to_all_by_rank(measurements: Mapping[str, Any]) -> list[float] | None:
    """Each rank's expected all-to-all bytes per timed step, from what it routed; None where the row routed none."""
    figures = measurements.get("strategy_figures_by_rank") or []
    expected = [(f or {}).get("expert_parallel", {}).get("expected_all_to_all_bytes_per_timed_step") for f in figures]
    if not expected or any(value is None for value in expected):
        return None
    return [float(value) for value in expected]


def expert_columns(measurements: Mapping[str, Any]) -> dict[str, Any]:
    """`all_to_all_bytes_per_step` (counted, largest rank), `all_to_all_expected_bytes_per_step` (from the routing,
    largest rank), `all_to_all_counted_over_expected` (the rank furthest from 1), `load_imbalance`; {} for a row that
    neither routed tokens nor exchanged them."""
    columns: dict[str, Any] = {}
    routing = measurements.get("routing")
    if routing:
        columns["load_imbalance"] = routing.get("load_imbalance")
    expected = expected_all_to_all_by_rank(measurements)
    if expected is None:
        return columns
    counted = [float((rank.get(ALL_TO_ALL) or {}).get("bytes", 0.0))
               for rank in measurements.get("comm_per_step_by_rank") or []]
    columns["all_to_all_bytes_per_step"] = max(counted, default=None)
    columns["all_to_all_expected_bytes_per_step"] = max(expected)
    ratios = [c / e for c, e in zip(counted, expected) if e]
    columns["all_to_all_counted_over_expected"] = max(ratios, key=lambda r: abs(r - 1.0), default=None)
    return columns
