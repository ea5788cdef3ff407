"""A compiled cell's figures where a reader sees them: rows.csv, the cell table and a verdict line.

The ranks record them (harness.strategies.compiling.compile_figures, per rank): the seconds compiling and the
frames compiled before the first timed step (the warm-up absorbs them), the frames compiled inside the timed steps
(a recompile there is in some step's time) and the graph breaks. A launch shows its slowest rank's seconds and
its largest counts; a cell, the median launch's seconds and its worst launch's counts, as its parity is its worst
launch's: one launch that recompiled in its timed steps is a cell whose step times may hold a compile.
"""

from __future__ import annotations

from statistics import median
from typing import Any, Mapping, Sequence

# Column: the per-rank list it reads (harness.strategies.compiling.compile_figures).
COUNTS = {"compiled_frames": "compiled_frames_by_rank", "graph_breaks": "graph_breaks_by_rank",
          "recompiles_in_timed_steps": "recompiles_in_timed_steps_by_rank"}
SECONDS = "compile_seconds"
COMPILE_COLUMNS = (SECONDS, *COUNTS)


def compile_columns(m: Mapping[str, Any]) -> dict[str, Any]:
    """A launch's compile figures: its slowest rank's seconds and largest counts; None where it did not compile
    or stopped before its timed steps."""
    seconds = m.get("compile_seconds_by_rank") if m.get("compiled") else None
    if not seconds:
        return dict.fromkeys(COMPILE_COLUMNS)
    return {SECONDS: max(seconds), **{column: max(m.get(key) or [0]) for column, key in COUNTS.items()}}


def cell_compile(launches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A cell's compile figures from its ok launches' (`compile_columns`): the median seconds, the worst counts."""
    compiled = [launch for launch in launches if _present(launch.get(SECONDS))]
    if not compiled:
        return dict.fromkeys(COMPILE_COLUMNS)
    return {SECONDS: median(float(launch[SECONDS]) for launch in compiled),
            **{column: int(max(float(launch[column]) for launch in compiled)) for column in COUNTS}}


def compile_line(name: str, line: Mapping[str, Any]) -> str:
    """The verdict line of a compiled cell named `name`; "" where it has no compile figures."""
    if not _present(line.get(SECONDS)):
        return ""
    breaks, recompiles = int(line["graph_breaks"]), int(line["recompiles_in_timed_steps"])
    text = (f"{name} compiled in {float(line[SECONDS]):.1f} s before its timed steps ({_count(line['compiled_frames'], 'frame')}"
            f", {_count(breaks, 'graph break')})")
    if recompiles:
        return text + (f"; its timed steps recompiled {_count(recompiles, 'frame')}: their step times include "
                       "compiling.")
    return text + "; its timed steps recompiled nothing."


def _count(value: Any, noun: str) -> str:
    count = int(value)
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _present(value: Any) -> bool:
    return value is not None and value == value        # NaN: a cell that did not compile, in a table with one that did
