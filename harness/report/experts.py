"""The report's "Experts" lines: each MoE cell's all-to-all bytes a step (the largest rank's, counted) against those
its ranks' routing expects (harness.derive.experts), and the router's load imbalance, from the cell table alone.

The all-to-all's share of the step is not shown: expert parallelism has no compute-only pass to set it against (a
rank's experts compute on the tokens the all-to-all brings), so its exposed share is not measured.
"""

from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

MIB = float(1 << 20)
# A counted all-to-all within this of its expectation agrees: the expectation is exact (whole rows, whole counts),
# and the mean over timed steps is taken the same way on both sides.
AGREES = 1e-9


def expert_lines(cells: pd.DataFrame) -> list[str]:
    """One line per ok cell of an MoE model (a load imbalance recorded); [] where none ran."""
    if cells.empty or "load_imbalance" not in cells:
        return []
    ok = cells[(cells["status"] == "ok") & cells["load_imbalance"].map(_present)]
    return [_line(row) for row in ok.to_dict("records")]


def _line(r: Mapping[str, Any]) -> str:
    line = f"{r['label']}: load imbalance {float(r['load_imbalance']):.3g} (the busiest expert's tokens over the mean)"
    if not _present(r.get("all_to_all_bytes_per_step")):
        return line + "; experts replicated, no all-to-all."
    counted, expected = float(r["all_to_all_bytes_per_step"]), float(r["all_to_all_expected_bytes_per_step"])
    ratio = r.get("all_to_all_counted_over_expected")
    agrees = _present(ratio) and abs(float(ratio) - 1.0) <= AGREES
    verdict = ("as its routing expects" if agrees else
               f"ROUTING EXPECTS {expected / MIB:.4g} MiB (counted / expected {float(ratio):.6g} on its furthest rank)")
    return line + f"; all-to-all {counted / MIB:.4g} MiB a step on its busiest rank, {verdict}."


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)
