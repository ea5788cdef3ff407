"""The checkpoint table of docs/reliability.md, from rows of the fault-tolerance matrix: one line per cell, each
figure as harness.derive.resume.checkpoint_columns derives it for the report (save and load: the slowest rank's;
written: every rank's files; the plan's tensor bytes: harness.derive.resume.expected_checkpoint_bytes).

    .venv/bin/python scripts/checkpoint_table.py results/reference/fault-tolerance/ROWS.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.derive.resume import checkpoint_columns
from harness.derive.rows import label
from harness.record import read_rows

HEADER = ("cell", "save", "written", "tensor bytes against the plan", "formats' overhead", "load",
          "async_save blocked / written", "recovery", "resumed steps")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _bytes(value: float) -> str:
    return f"{value / 1e6:.2f} MB" if value >= 1e6 else f"{value / 1e3:.0f} KB"


def line(row: dict) -> str:
    c = checkpoint_columns(row)
    if not c:
        return f"| {label(row)} | {row['status']}: {row.get('message', '')[:80]} |" + " |" * (len(HEADER) - 2)
    expected, measured = c["checkpoint_bytes_expected"], c["checkpoint_tensor_bytes"]
    against = f"{measured / expected - 1:+.2%}" if expected and measured is not None else "-"
    overhead = _bytes(c["checkpoint_bytes"] - measured) if measured is not None else "-"
    asynchronous = ("-" if c["checkpoint_async_blocked_s"] is None else
                    f"{c['checkpoint_async_blocked_s']:.3f} / {c['checkpoint_async_write_s']:.3f} s")
    recovery = ("-" if c["recovery_s"] is None else
                f"{c['recovery_s']:.1f} s, {c['restarts']} restart(s), {c['steps_recomputed']} step(s) again")
    cells = (label(row), _seconds(c["checkpoint_save_s"]),
             f"{_bytes(c['checkpoint_bytes'])}, {c['checkpoint_files']} file(s)", against, overhead,
             _seconds(c["checkpoint_load_s"]), asynchronous, recovery, c["resume"])
    return "| " + " | ".join(cells) + " |"


def main(paths: list[str]) -> None:
    rows = [row for row in read_rows([Path(p) for p in paths]) if row.get("kind", "cell") == "cell"]
    print("| " + " | ".join(HEADER) + " |")
    print("|" + " --- |" * len(HEADER))
    for row in rows:
        print(line(row))


if __name__ == "__main__":
    main(sys.argv[1:])
