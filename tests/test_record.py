"""The results file: an append writes its whole line or leaves the file as it was, a cut-short last line
never locks the file, and a resumed run records a launch whose measurements reached its cell folder but
whose row never reached the results file, without launching it again."""

import errno
import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest

from harness import record, runner
from harness.cli import main
from harness.environment import capture_environment
from harness.launch.cell import cells_dir, launch_dir
from harness.matrix import Machine, Selection, build_matrix
from harness.record import AppendError, ResultsError, append_line, append_row, read_results, read_rows
from harness.runner import RECOVERED, RunOptions, run_specs
from harness.spec import DeviceKind, RunResult, Status


def row(number: int, padding: int = 0) -> dict:
    """A minimal cell row as read_rows accepts it (spec and status), `padding` characters long or more."""
    return {"spec": {"number": number}, "status": "ok", "run_id": f"run-{number}", "notes": "x" * padding}


def plain_spec():
    [spec] = build_matrix("smoke", Machine(device=DeviceKind.CPU, devices_per_node=2),
                          Selection(workloads=("gpt-tiny",), strategies=("plain",),
                                    overrides=(("warmup_steps", 1), ("timed_steps", 2))))
    return spec


# The environment a run captures, as a stand-in: capture_environment asks git for the checkout's state in a
# subprocess, and these tests start no process (tests/launch_guard.py).
ENVIRONMENT_NOW = {"python": "captured by this run"}
# What the run's rows record: the capture and where the cells ran (part of each cell's identity).
RUN_ENVIRONMENT = {**ENVIRONMENT_NOW, "placement": "local"}


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


def write_cell_folder(cell_dir: Path, spec, measurements: dict) -> None:
    """What a launch leaves in its folder: spec.json, log.txt (the command first) and rank 0's
    measurements.json."""
    cell_dir.mkdir(parents=True)
    (cell_dir / "spec.json").write_text(json.dumps(spec.to_dict()))
    (cell_dir / "log.txt").write_text(f"$ OMP_NUM_THREADS=1 /usr/bin/python3 -m harness.rank.worker --spec "
                                      f"'{cell_dir}/spec.json' --out '{cell_dir}'\nsteps done\n")
    (cell_dir / "measurements.json").write_text(json.dumps(measurements))


def test_resume_records_a_row_from_its_cell_folder_without_launching(tmp_path, monkeypatch):
    spec = plain_spec()
    out = tmp_path / "rows with space.jsonl"
    cell_dir = launch_dir(out, spec, 0, environment=RUN_ENVIRONMENT)
    measured = {"loss_per_step": [4.5, 4.25], "samples_per_s": 100.0, "samples_per_s_per_device": 100.0,
                "train_flops_per_sample": 1e6, "device_name": "cpu"}
    write_cell_folder(cell_dir, spec, measured)

    def no_launch(*args, **kwargs):
        raise AssertionError("the cell was launched again")

    monkeypatch.setattr(runner, "run_cell", no_launch)
    monkeypatch.setattr(runner, "capture_environment", lambda freeze_dir: ENVIRONMENT_NOW)
    [recovered] = run_specs([spec], RunOptions(results=out, resume=True))
    [recorded] = read_results([out])
    assert recorded.run_id == recovered.run_id and recorded.status is Status.OK
    assert recorded.message.startswith(f"{RECOVERED} {cell_dir}")
    assert recorded.spec == spec and recorded.artifacts_dir == str(cell_dir)
    assert {k: recorded.measurements[k] for k in measured} == measured
    assert recorded.launch_command == ["OMP_NUM_THREADS=1", "/usr/bin/python3", "-m", "harness.rank.worker",
                                       "--spec", f"{cell_dir}/spec.json", "--out", str(cell_dir)]
    assert recorded.environment == RUN_ENVIRONMENT      # the resuming run's, not the folder's


@pytest.mark.parametrize("recorded, error_report", [
    (Status.TIMEOUT, False),   # rank 0 wrote its measurements, another rank hung: the row says timeout
    (None, True),              # no row, but a rank reported an error: not a launch that succeeded
])
def test_resume_relaunches_a_cell_whose_folder_does_not_hold_a_missing_ok_row(tmp_path, monkeypatch,
                                                                               recorded, error_report):
    spec = plain_spec()
    out = tmp_path / "rows.jsonl"
    cell_dir = launch_dir(out, spec, 0, environment=RUN_ENVIRONMENT)
    write_cell_folder(cell_dir, spec, {"loss_per_step": [4.5, 4.25]})
    if error_report:
        (cell_dir / "rank1.error.json").write_text('{"status": "failed", "message": "rank 1: boom"}')
    if recorded:
        append_row(out, RunResult(spec=spec, status=recorded, message="no result", run_id="first"))
    seen_at_launch = []

    def launch(spec, *, repeat, cell_dir, **kwargs):
        seen_at_launch.append(sorted(path.name for path in cell_dir.iterdir()))
        return RunResult(spec=spec, status=Status.FAILED, message="again", run_id="second", repeat=repeat)

    monkeypatch.setattr(runner, "run_cell", launch)
    monkeypatch.setattr(runner, "capture_environment", lambda freeze_dir: ENVIRONMENT_NOW)
    run_specs([spec], RunOptions(results=out, resume=True))
    # Launched again, and without the last launch's measurements or error reports, which would otherwise
    # be read as this launch's outcome.
    assert seen_at_launch == [["log.txt", "spec.json"]]
    assert [r.run_id for r in read_results([out])] == ["first", "second"][0 if recorded else 1:]


@pytest.mark.launch
def test_a_full_disk_ends_the_run_with_one_line_and_resume_records_the_row(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        out = disk / "rows.jsonl"
        cells = tmp_path / "cells"   # on the normal disk, so that the ranks can write their measurements
        cells.mkdir()
        cells_dir(out).symlink_to(cells)
        # The run starts by writing the pip-freeze file beside the results; with the same content already
        # there, rewriting it frees and takes back the same pages of the full disk.
        capture_environment(freeze_dir=disk)
        with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError) as full:
            while True:
                filler.write(b"\0" * 65536)
        assert full.value.errno == errno.ENOSPC
        command = ["run", "--matrix", "smoke", "--strategy", "plain", "--workload", "gpt-tiny",
                   "--warmup-steps", "1", "--timed-steps", "2", "--out", str(out)]
        capsys.readouterr()

        code = main(command)
        err = capsys.readouterr().err
        [cell] = list(cells.iterdir())
        kept = cells_dir(out) / cell.name / "measurements.json"
        assert code != 0 and "Traceback" not in err
        naming = [line for line in err.splitlines() if cell.name in line]
        assert len(naming) == 1 and naming[0].startswith("parbench: error: ") and str(kept) in naming[0]
        assert os.strerror(errno.ENOSPC) in naming[0]
        assert kept.is_file() and read_rows([out]) == []
        log = cell / "log.txt"
        logged = (log.read_bytes(), log.stat().st_mtime_ns)

        (disk / "filler").unlink()
        assert main([*command, "--resume"]) == 0
        [recorded] = read_results([out])
        assert recorded.status is Status.OK and recorded.message.startswith(RECOVERED)
        measured = json.loads(kept.read_text())
        assert {k: recorded.measurements[k] for k in measured} == measured
        assert "harness.rank.worker" in recorded.launch_command
        assert list(cells.iterdir()) == [cell]                       # no second launch
        assert (log.read_bytes(), log.stat().st_mtime_ns) == logged
    finally:
        subprocess.run(["umount", str(disk)], check=False)
