"""The results file: an append writes its whole line or leaves the file as it was, and a cut-short last
line never locks the file."""

import errno
import json
import os
import resource
import signal
from pathlib import Path

import pytest

from harness import record
from harness.record import AppendError, ResultsError, append_line, read_rows


def row(number: int, padding: int = 0) -> dict:
    """A minimal cell row as read_rows accepts it (spec and status), `padding` characters long or more."""
    return {"spec": {"number": number}, "status": "ok", "run_id": f"run-{number}", "notes": "x" * padding}


def test_an_append_cut_short_by_the_file_size_limit_leaves_the_file_byte_identical(tmp_path):
    out = tmp_path / "rows.jsonl"
    append_line(out, row(1))
    before = out.read_bytes()
    # The kernel writes up to the limit (a short write), then refuses the rest with EFBIG: the same
    # sequence as a disk that fills up part-way through a row (ENOSPC).
    limit = len(before) + 4096
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # else the signal ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(AppendError) as raised:
            append_line(out, row(2, padding=9000))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert out.read_bytes() == before
    message = str(raised.value)
    assert str(out) in message and os.strerror(errno.EFBIG) in message and "\n" not in message


def test_an_append_whose_fsync_fails_is_cut_back_off(tmp_path, monkeypatch):
    out = tmp_path / "rows.jsonl"
    append_line(out, row(1))
    before = out.read_bytes()

    def failing_fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(record.os, "fsync", failing_fsync)
    with pytest.raises(AppendError, match="Input/output error"):
        append_line(out, row(2))
    assert out.read_bytes() == before


def cut_short(out: Path) -> None:
    """Rows 1 and 2, then the first 4,096 bytes of row 3: a writer that died mid-line."""
    append_line(out, row(1))
    append_line(out, row(2))
    with open(out, "ab") as handle:
        handle.write((json.dumps(row(3, padding=9000)) + "\n").encode()[:4096])


def test_a_cut_short_last_line_is_set_aside_with_one_warning(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    cut_short(out)
    assert [r["run_id"] for r in read_rows([out])] == ["run-1", "run-2"]
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and f"{out}:3:" in warnings[0] and "cut short" in warnings[0]


def test_the_next_append_after_a_cut_short_line_leaves_every_line_parseable(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    cut_short(out)
    append_line(out, row(4))
    assert f"{out}:3:" in capsys.readouterr().err
    lines = out.read_text().split("\n")
    assert lines[-1] == ""   # the file ends in a newline
    assert [json.loads(line)["run_id"] for line in lines[:-1]] == ["run-1", "run-2", "run-4"]
    assert [r["run_id"] for r in read_rows([out])] == ["run-1", "run-2", "run-4"]
    assert capsys.readouterr().err == ""


def test_a_last_row_missing_only_its_newline_is_kept_by_the_next_append(tmp_path):
    out = tmp_path / "rows.jsonl"
    out.write_text(json.dumps(row(1)) + "\n" + json.dumps(row(2)))
    append_line(out, row(3))
    assert [r["run_id"] for r in read_rows([out])] == ["run-1", "run-2", "run-3"]


@pytest.mark.parametrize("text, line", [
    ('{ROW1}\n{"spec": {}, "sta\n{ROW3}\n', 2),    # a malformed line before the last
    ('{ROW1}\n{"spec": {}, "sta\n', 2),            # a last line that ends in its newline is complete
])
def test_a_malformed_complete_line_raises_naming_file_and_line(tmp_path, text, line):
    out = tmp_path / "rows.jsonl"
    out.write_text(text.replace("{ROW1}", json.dumps(row(1))).replace("{ROW3}", json.dumps(row(3))))
    with pytest.raises(ResultsError, match=f"{out}:{line}: not a JSON row"):
        read_rows([out])
