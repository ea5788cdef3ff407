"""A sequence-split cell's figures (harness.strategies.sequence_parallel: Ulysses, torch's ring), derived when rows are
read: the exchanges around attention each rank's counter saw in the sequence-parallel group beside those the strategy
expected, and the balance of the causal work between the ranks of a group.

Counted: the bytes of every collective the counter saw in the group labelled `sp` (Ulysses) or `cp` (the ring), per
timed step, each in nccl-tests' size of its own type (harness.derive.comm); expected: the strategy's collectives in
that group (`Strategy.expected_traffic`), summed the same way. Ulysses' are exact (every all-to-all's size follows the
shapes): the two agree to the byte, or the cell sent something else.

Causal balance: the query-key pairs a rank's queries attend to under the causal mask (`causal_work_by_rank`), the
largest over the smallest: 1 where every rank of a group does the same attention work (Ulysses' ranks, each running the
whole sequence for its heads; the ring's head-tail chunks), P x 2 - 1 or so for a ring's contiguous slices.
"""

from __future__ import annotations

from typing import Any, Mapping

SEQUENCE_GROUPS = ("sp", "cp")


def attention_counted_by_rank(measurements: Mapping[str, Any]) -> list[float]:
    """Each rank's counted bytes a step in its sequence-parallel group, every collective type summed."""
    return [sum(float(((figures.get("by_group") or {}).get(label) or {}).get("bytes", 0.0))
                for figures in counted.values() for label in SEQUENCE_GROUPS)
            for counted in measurements.get("comm_per_step_by_rank") or []]


def attention_expected(measurements: Mapping[str, Any]) -> float | None:
    """The strategy's expected bytes a step in the sequence-parallel group, None where it expected none."""
    collectives = (measurements.get("comm_expected_per_step") or {}).get("collectives") or []
    found = [c["size_bytes"] * c["calls"] for c in collectives if c.get("group") in SEQUENCE_GROUPS]
    return float(sum(found)) if found else None


def sequence_columns(measurements: Mapping[str, Any]) -> dict[str, Any]:
    """`sequence_split` (the ranks a sequence is split over), `sequence_attention` (ulysses, ring),
    `attention_bytes_per_step` (counted, largest rank), `attention_expected_bytes_per_step`,
    `attention_counted_over_expected` (the rank furthest from 1), `causal_balance`; {} for a row that splits no
    sequence."""
    config = measurements.get("strategy_config") or {}
    split = config.get("sequence_split")
    if not split:
        return {}
    columns: dict[str, Any] = {"sequence_split": int(split), "sequence_attention": config.get("sequence_attention")}
    figures = [(f or {}).get("sequence_parallel") or {} for f in measurements.get("strategy_figures_by_rank") or []]
    work = figures[0].get("causal_work_by_rank") if figures else None
    if work:
        columns["causal_balance"] = max(work) / min(work)
    counted, expected = attention_counted_by_rank(measurements), attention_expected(measurements)
    if counted:
        columns["attention_bytes_per_step"] = max(counted)
    if counted and expected:
        columns["attention_expected_bytes_per_step"] = expected
        columns["attention_counted_over_expected"] = max((c / expected for c in counted), key=lambda r: abs(r - 1.0))
    return columns
