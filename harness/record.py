"""The results file: append-only JSONL, one `RunResult` per line, safe for concurrent writers.

Each row is appended under an exclusive `flock`, so two harness runs appending to the same file never
interleave lines, and an append writes its whole line or nothing: a write that fails part-way (a full disk,
a quota, an I/O error) is cut back off before the error is raised (AppendError). Readers name the file and
line of anything they cannot read, except a cut-short last line (a writer killed mid-line, or a machine
that went down before the line reached the disk), which they set aside with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

from harness.spec import RunResult, SpecError, Status


class ResultsError(ValueError):
    """A results file that cannot be read; the message names the file and line."""


class AppendError(Exception):
    """A row that could not be appended (disk full, quota, I/O error). The message is one line naming the
    file and the cause; unless it says otherwise, the file was left exactly as it was."""


def append_row(path: Path, result: RunResult) -> None:
    append_line(path, result.to_dict())


def append_line(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON object as one line, atomically with respect to other appenders and to failures.

    Under the lock: remember the file's size, write the line, fsync; on any OSError cut the file back to
    the remembered size and raise AppendError. A file that does not end in a newline ends with the
    remains of an append that never finished (readers set it aside); this append first cuts that tail
    away, with a warning naming file:line, so the new row starts a line of its own and every line
    parses; no complete row is lost (should the append itself then fail, the file keeps its complete rows
    and loses that tail). The one exception is a tail that parses as JSON (a complete row whose newline
    was lost): it is kept and the new line starts with a newline.
    """
    line = (json.dumps(record, default=str) + "\n").encode("utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as error:
        raise AppendError(f"{path}: cannot open the results file to append a row ({error.strerror})") from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size, separator = _end_of_last_line(fd, path)
        try:
            _write_all(fd, separator + line)
            os.fsync(fd)
        except OSError as error:
            raise AppendError(_cut_back(fd, size, path, error)) from error
    except OSError as error:   # locking, reading or cutting the tail: nothing was written
        raise AppendError(f"{path}: could not append a row ({error.strerror}); the file was left as "
                          "it was") from error
    finally:
        os.close(fd)   # closing releases the lock


def _end_of_last_line(fd: int, path: Path) -> tuple[int, bytes]:
    """(the size the file has once a cut-short tail is cut away, what to write before the new line)."""
    size = os.fstat(fd).st_size
    if not size or os.pread(fd, 1, size - 1) == b"\n":
        return size, b""
    start = _last_line_start(fd, size)
    if _parses(os.pread(fd, size - start, start)):
        return size, b"\n"
    os.ftruncate(fd, start)
    _warn(f"{path}:{_line_number(fd, start)}: cut away the {size - start} bytes of a cut-short last line "
          "(no newline, not JSON) before appending")
    return start, b""


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written: a short write (a disk filling up) is followed by another
    write, which then raises the error."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:   # POSIX allows it; never loop on it
            raise OSError(errno.EIO, "write wrote nothing")
        view = view[written:]


def _cut_back(fd: int, size: int, path: Path, error: OSError) -> str:
    """Truncate to `size` after a failed append; the error's message, saying whether the file is intact."""
    cause = error.strerror or str(error)
    try:
        os.ftruncate(fd, size)
    except OSError as second:
        return (f"{path}: could not append a row ({cause}), nor cut the partial line back off "
                f"({second.strerror}); readers set the cut-short last line aside")
    return f"{path}: could not append a row ({cause}); the file was left as it was"


def _last_line_start(fd: int, size: int, chunk: int = 1 << 16) -> int:
    """Offset of the first byte after the last newline before `size` (0 if there is none)."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        found = os.pread(fd, end - start, start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


def _line_number(fd: int, offset: int) -> int:
    """1-based number of the line starting at `offset` (only called on the rare cut-short tail)."""
    return os.pread(fd, offset, 0).count(b"\n") + 1


def _parses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:   # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return False
    return True


def _warn(message: str) -> None:
    print(f"parbench: warning: {message}", file=sys.stderr)


COMMBENCH_KIND = "commbench"   # rows written by `python -m harness comm` carry "kind": "commbench"
# Rows written by `python -m harness project` carry "kind": "projection" (and status "projected"): predictions,
# never measurements. Like collective-benchmark rows they are read only when asked for by kind, so no reader
# of measured cell rows (summary, report, compare, resume, reproduce) ever counts one.
PROJECTION_KIND = "projection"
OTHER_KINDS = (COMMBENCH_KIND, PROJECTION_KIND)


def read_rows(paths: Iterable[Path], kind: str | None = None, *, unmeasured: bool = False) -> list[dict[str, Any]]:
    """Raw row dicts of every file, in order: cell rows, or with `kind="commbench"` the collective
    benchmark's rows, with `kind="projection"` projected rows. A malformed line raises ResultsError naming file:line, except a cut-short last line
    (no newline and not JSON: an append that never finished), which is set aside with a one-line warning
    on stderr; the next append cuts it away (append_line). A collective benchmark stopped before it measured
    anything (`harness comm` interrupted: its `status` says so, its `rows` are empty) is read only with `unmeasured`:
    every other reader of its kind reads the measurements."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8", errors="surrogateescape")
        except OSError as error:
            raise ResultsError(f"{path}: cannot read results file ({error.strerror})") from None
        lines = text.splitlines()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                if number == len(lines) and not text.endswith("\n"):
                    _warn(f"{path}:{number}: last line cut short ({len(line)} characters, no newline, not JSON: "
                          "an append that never finished); set aside, the lines before it are read")
                    continue
                raise ResultsError(f"{path}:{number}: not a JSON row ({error.msg} at column {error.colno})") from None
            if not isinstance(row, dict) or not (row.get("kind") in OTHER_KINDS or
                                                 ("spec" in row and "status" in row)):
                raise ResultsError(f"{path}:{number}: not a parbench row (no spec/status)")
            if row.get("kind") != kind:
                continue
            if kind == COMMBENCH_KIND and row.get("status", Status.OK.value) != Status.OK.value and not unmeasured:
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
