"""The report's "memory saved, step time paid" lines: each cell run with a memory technique beside the same cell
without it, from the cell table alone (harness.derive.cells; the figures' formulas in harness.derive.techniques).

A pair is two ok cells of one comparable group (harness.report.verdicts.COMPARABLE: the same device, workload,
precision, global batch, world size and conditions) and one strategy whose options differ only in the technique.
Memory is the saved-for-backward census (the largest rank, one step's peak); the step time paid is the cells'
median steps against each other, and the recompute pass's cost, measured in the technique's own run, beside it.
"""

from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

MIB = float(1 << 20)
TECHNIQUES = ("activation_checkpointing", "activation_offload")


def technique_lines(cells: pd.DataFrame, comparable: list[str]) -> list[str]:
    """One line per cell with a technique on that has its counterpart without; [] where none has."""
    if cells.empty or not any(name in cells for name in TECHNIQUES):
        return []
    lines = []
    ok = cells[cells["status"] == "ok"]
    for _, group in ok.groupby(comparable, sort=False, dropna=False):
        records = group.to_dict("records")
        without = {_base(r): r for r in records if _setting(r) == "none"}
        for record in records:
            counterpart = without.get(_base(record))
            if _setting(record) != "none" and counterpart is not None:
                lines.append(_line(record, counterpart))
    return lines


def _setting(record: Mapping[str, Any]) -> str:
    """The techniques a cell ran with, as "name value" (joined), or "none"."""
    values = {name: record.get(name) for name in TECHNIQUES}
    on = [f"{name.replace('_', ' ')} {value}" for name, value in values.items()
          if isinstance(value, str) and value and value != "none"]
    return ", ".join(on) or "none"


def _base(record: Mapping[str, Any]) -> tuple[str, str]:
    """The cell's strategy and its options but the techniques'."""
    options = str(record.get("options") or "")
    kept = ",".join(part for part in options.split(",")
                    if part and not any(part.startswith(f"{name}=") for name in TECHNIQUES))
    return str(record["strategy"]), kept


def _line(on: Mapping[str, Any], off: Mapping[str, Any]) -> str:
    strategy, options = _base(on)
    name = f"{strategy}[{options}]" if options else strategy
    head = (f"{on['workload']} at {int(on['world_size'])} rank(s) ({on['device']}, {on['precision']}, global batch "
            f"{int(on['global_batch'])}), {name}, {_setting(on)}")
    parts = [_memory(on, off), _step(on, off), _recompute(on), _host(on)]
    return head + ": " + "; ".join(part for part in parts if part) + "."


def _memory(on: Mapping[str, Any], off: Mapping[str, Any]) -> str:
    after, before = on.get("saved_activation_bytes"), off.get("saved_activation_bytes")
    if not _present(after) or not _present(before) or before <= 0:
        return "saved-for-backward bytes not measured on both"
    return (f"saved for backward {before / MIB:.3g} -> {after / MIB:.3g} MiB per rank "
            f"({1 - after / before:.0%} less)")


def _step(on: Mapping[str, Any], off: Mapping[str, Any]) -> str:
    after, before = on.get("samples_per_s"), off.get("samples_per_s")
    if not _present(after) or not _present(before) or after <= 0:
        return ""
    return f"median step {before / after - 1:+.0%} against the cell without it"


def _host(on: Mapping[str, Any]) -> str:
    moved = on.get("host_bytes_per_step")
    return f"{moved / MIB:.3g} MiB a step to the host and back" if _present(moved) else ""


def _recompute(on: Mapping[str, Any]) -> str:
    cost = on.get("recompute_cost")
    if not _present(cost):
        return "" if on.get("activation_checkpointing") in (None, "none") else "no recompute pass"
    low, high = on.get("recompute_cost_low"), on.get("recompute_cost_high")
    spread = f", pairs {low:+.0%} to {high:+.0%}" if _present(low) and _present(high) else ""
    return f"recompute pass {cost:+.0%} forward and backward{spread}"


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)
