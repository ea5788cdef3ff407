"""Which row a launch counts by, where it was recorded more than once.

    python -c "from harness.derive.launches import last_rows; from harness.derive.rows import load_rows;
        print(len(last_rows(load_rows(['results/reference/ci-cpu/smoke.jsonl']))))"

A launch is one repeat of one cell (harness.derive.identity: its spec under its conditions) in one results file.
`run --resume` runs a launch again where its row is not ok (interrupted, failed, timed out) and appends the new row
to the same file, so a file may hold several rows of one launch: they are one launch, recorded again, and the last
to start stands for it. Counting each would make a resumed cell "partial: 1 of 2 launches ok", and taking the
last in the file would make a verdict depend on the order rows were appended in. Both `run` (the rows a resume
keeps, the summary and exit status) and every table of harness.derive.cells go through `last_rows`, so the two
always agree. Rows of different files are different launches (two runs of the same matrix, reported together).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Sequence

from harness.derive.identity import cell_identity
from harness.derive.rows import Row

EARLIEST = datetime.min.replace(tzinfo=timezone.utc)     # a row without a start time: older than any with one


def launch_of(row: Row) -> tuple[str, str, int]:
    """(results file, cell, repeat): the file from `_source` (harness.record.read_rows), "" for a row not read from
    one."""
    source = str(row.get("_source") or "")
    return source.rsplit(":", 1)[0], cell_identity(row), int(row.get("repeat") or 0)


def last_row_indices(rows: Sequence[Row]) -> list[int]:
    """The index in `rows` of each launch's last row (the latest `started_at`; of rows started in the same second,
    the later in `rows`), in the order launches first appear."""
    chosen: dict[tuple[str, str, int], int] = {}
    for index, row in enumerate(rows):
        launch = launch_of(row)
        if launch not in chosen or _started(row) >= _started(rows[chosen[launch]]):
            chosen[launch] = index
    return list(chosen.values())


def last_rows(rows: Sequence[Row]) -> list[Row]:
    """Each launch's last row (`last_row_indices`)."""
    return [rows[index] for index in last_row_indices(rows)]


def _started(row: Row) -> datetime:
    return started_at(row.get("started_at"))


def started_at(text: Any) -> datetime:
    """A row's `started_at` as an aware time (UTC where it names no zone), EARLIEST where it has none."""
    try:
        moment = datetime.fromisoformat(str(text))
    except ValueError:
        return EARLIEST
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
