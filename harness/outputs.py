"""Where a command will write, checked before it runs anything: one `SpecError` line naming the path and why.

    python -m harness run --matrix smoke --out /proc/rows.jsonl     # parbench: error: --out /proc/rows.jsonl: ...

A run that could not write its results would otherwise find out after its first launch, with a traceback.
Permission bits cannot tell (root passes every access check, yet cannot create files in /proc or on a
read-only mount), so the folder is made (as the command would make it) and a file is created in it and
removed again. A results file that exists already must open for appending. Nothing else is written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from harness.spec import SpecError


def check_results_file(path: Path, flag: str) -> None:
    """`path` is a results file rows will be appended to (and its cell folders made beside): its folder can
    be made and written in, and the file, if it exists, is a file that opens for appending."""
    if path.is_dir():
        raise SpecError(f"{flag} {path} is a folder; expected a results file (.jsonl) to append rows to")
    check_folder(path.parent, flag, shown=path)
    if path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as error:
            raise SpecError(f"{flag} {path}: the results file cannot be appended to ({_why(error)})") from None


def check_folder(folder: Path, flag: str, shown: Path | None = None) -> None:
    """`folder` exists, or can be made, and a file can be created in it."""
    shown = folder if shown is None else shown
    nearest = next((path for path in (folder, *folder.parents) if path.exists()), None)
    if nearest is not None and not nearest.is_dir():
        raise SpecError(f"{flag} {shown}: {nearest} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SpecError(f"{flag} {shown}: cannot make the folder {folder} ({_why(error)})") from None
    try:
        handle, probe = tempfile.mkstemp(prefix=".parbench-write-check-", dir=folder)
    except OSError as error:
        raise SpecError(f"{flag} {shown}: cannot write in {folder} ({_why(error)})") from None
    os.close(handle)
    os.unlink(probe)


def _why(error: OSError) -> str:
    return error.strerror or type(error).__name__
