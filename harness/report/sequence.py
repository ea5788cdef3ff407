"""The report's "Long sequences" lines: each sequence-split cell's exchanges around attention (counted, its busiest
rank's) against its strategy's expectation (harness.derive.sequence), the balance of its causal work, and the bytes a
rank saves for backward against the tokens of a sample it holds, beside the same workload's cells that hold whole
samples, from the cell table alone.

The exchanges' share of the step is not shown: a rank's attention runs on what they bring, so there is no
compute-only pass to set them against, and the exposed share is not measured (`harness plan` prices it).
"""

from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

MIB = float(1 << 20)
# Counted within this of expected agrees: Ulysses' exchanges follow the shapes exactly.
AGREES = 1e-9


def sequence_lines(cells: pd.DataFrame) -> list[str]:
    """A line per ok sequence-split cell, then a line per workload and precision of the saved bytes a rank against the
    tokens it holds; [] where no cell split a sequence."""
    if cells.empty or "sequence_split" not in cells:
        return []
    ok = cells[cells["status"] == "ok"]
    split = ok[ok["sequence_split"].map(_present)]
    if split.empty:
        return []
    lines = [_line(row) for row in split.to_dict("records")]
    for (workload, precision), group in ok.groupby(["workload", "precision"], sort=False):
        if not group["sequence_split"].map(_present).any():
            continue
        seq_len = _seq_len(workload)
        by_tokens: dict[int, dict[float, list[str]]] = {}
        for row in group.to_dict("records"):
            if not _present(row.get("saved_activation_bytes")):
                continue
            degree = int(row["sequence_split"]) if _present(row.get("sequence_split")) else 1
            name = f"{row['label'].split('/')[1]} ws{int(row['world_size'])}"
            by_tokens.setdefault(seq_len // degree, {}).setdefault(float(row["saved_activation_bytes"]), []).append(name)
        shown = "; ".join(f"{tokens} tokens " + ", ".join(f"{saved / MIB:.3g} MiB ({', '.join(names)})"
                                                          for saved, names in by_saved.items())
                          for tokens, by_saved in sorted(by_tokens.items(), reverse=True))
        lines.append(f"{workload} {precision}: saved for backward a rank, by the tokens of a sample it holds: {shown}.")
    return lines


def _line(r: Mapping[str, Any]) -> str:
    what = "Ulysses' all-to-alls" if r.get("sequence_attention") == "ulysses" else "the ring's key/value passes"
    line = f"{r['label']}: a sequence over {int(r['sequence_split'])} ranks"
    if _present(r.get("causal_balance")):
        line += f", causal work balanced {float(r['causal_balance']):.3g} (busiest rank over the least busy)"
    if not _present(r.get("attention_bytes_per_step")):
        return line + "."
    counted = float(r["attention_bytes_per_step"])
    ratio = r.get("attention_counted_over_expected")
    agrees = _present(ratio) and abs(float(ratio) - 1.0) <= AGREES
    verdict = "as its strategy expects" if agrees else (
        f"EXPECTED {float(r['attention_expected_bytes_per_step']) / MIB:.4g} MiB (counted / expected "
        f"{float(ratio):.6g} on its furthest rank)" if _present(ratio) else "no expectation")
    return line + f"; {what} {counted / MIB:.4g} MiB a step on its busiest rank, {verdict}."


def _seq_len(workload: str) -> int:
    from workloads import get_workload

    return int(get_workload(workload).config.seq_len)


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)
