"""The results file: append-only JSONL, one `RunResult` per line, safe for concurrent writers.

Each row is written with a single `write` under an exclusive `flock`, so two harness runs appending to
the same file never interleave lines. Readers name the file and line of anything they cannot read.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any, Iterable

from harness.spec import RunResult, SpecError


class ResultsError(ValueError):
    """A results file that cannot be read; the message names the file and line."""


def append_row(path: Path, result: RunResult) -> None:
    append_line(path, result.to_dict())


def append_line(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON object as one line, atomically with respect to other appenders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


COMMBENCH_KIND = "commbench"   # rows written by `python -m harness comm` carry "kind": "commbench"


def read_rows(paths: Iterable[Path], kind: str | None = None) -> list[dict[str, Any]]:
    """Raw row dicts of every file, in order: cell rows, or with `kind="commbench"` the collective
    benchmark's rows. A malformed line raises ResultsError naming file:line."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ResultsError(f"{path}: cannot read results file ({error.strerror})") from None
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ResultsError(f"{path}:{number}: not a JSON row ({error.msg} at column {error.colno})") from None
            if not isinstance(row, dict) or not (row.get("kind") == COMMBENCH_KIND or
                                                 ("spec" in row and "status" in row)):
                raise ResultsError(f"{path}:{number}: not a parbench row (no spec/status)")
            if row.get("kind") != kind:
                continue
            row["_source"] = f"{path}:{number}"
            rows.append(row)
    return rows


def read_results(paths: Iterable[Path]) -> list[RunResult]:
    results = []
    for row in read_rows(paths):
        try:
            results.append(RunResult.from_dict({k: v for k, v in row.items() if k != "_source"}))
        except (SpecError, KeyError, TypeError) as error:
            raise ResultsError(f"{row['_source']}: unreadable row ({error})") from None
    return results
