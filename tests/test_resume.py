"""`run --resume` after an interrupted run (issue 33, finding 1): the first line counts what will be launched and
what was found recorded, recorded launches get no line of their own as if run, and a skipped cell's row is not
appended a second time. No rank is launched: the plain loop's launch is replaced by a row made here, and
DataParallel on CPU is skipped by its strategy before any process starts."""

from __future__ import annotations

import uuid

import pytest

from harness import runner
from harness.cli import main
from harness.record import read_results
from harness.spec import RunResult, Status

MATRIX = ["run", "--matrix", "wide", "--workload", "gpt-tiny", "--warmup-steps", "1", "--timed-steps", "2", "--repeats", "1"]
MEASURED = {"loss_per_step": [6.25, 6.2, 6.1], "step_time_s": [0.05, 0.05], "host_stalled_step_indices": [],
            "shared_device": False}


@pytest.fixture
def launches(monkeypatch):
    """The cells launched, in order; a plain loop's launch is a row made here, anything else runs as it
    would (DataParallel on CPU: skipped before launch)."""
    launched = []
    real = runner.run_cell

    def launch(spec, *, repeat, **kwargs):
        launched.append(spec.strategy)
        if spec.strategy != "plain":
            return real(spec, repeat=repeat, **kwargs)
        return RunResult(spec=spec, status=Status.OK, run_id=uuid.uuid4().hex, repeat=repeat,
                         measurements=MEASURED, environment=kwargs["environment"])

    monkeypatch.setattr(runner, "run_cell", launch)
    monkeypatch.setattr(runner, "capture_environment", lambda freeze_dir: {"cpu_model": "test", "cpu_count": 2})
    return launched


def _launch_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("  ")]


def test_resume_says_what_it_launches_and_lists_only_those(tmp_path, capsys, launches):
    out = tmp_path / "rows.jsonl"
    assert main([*MATRIX, "--strategy", "plain", "--out", str(out)]) == 0      # the run cut short after plain
    capsys.readouterr()
    assert main([*MATRIX, "--strategy", "plain,dataparallel", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    # 3 cells (plain at 1 rank, DataParallel at 1 and 2): plain is recorded, the 2 DataParallel cells run.
    lines = _launch_lines(err)
    assert len(lines) == 2 and all("/dataparallel/" in line and line.split()[0] == "skipped" for line in lines)
    header = next(line for line in err.splitlines() if line.startswith("parbench: 3 cells"))
    # DataParallel's launches are its skips on CPU: no seconds but the harness's own 6 (harness.run_cost).
    assert header == (f"parbench: 3 cells, 2 launches -> {out}; 1 launch already recorded there, not launched again; "
                      f"planned: about 0.1 min at the 2-core VM's launch times (harness/run_cost.py)")
    assert launches == ["plain", "dataparallel", "dataparallel"]


def test_resume_does_not_append_a_skipped_row_again(tmp_path, capsys, launches):
    out = tmp_path / "rows.jsonl"
    command = [*MATRIX, "--strategy", "plain,dataparallel", "--out", str(out)]
    assert main(command) == 0
    assert [row.status for row in read_results([out])] == [Status.OK, Status.SKIPPED, Status.SKIPPED]
    capsys.readouterr()
    assert main([*command, "--resume"]) == 0
    assert len(read_results([out])) == 3          # neither skipped cell appended a second time
    err = capsys.readouterr().err
    assert f"parbench: 3 cells, 0 launches -> {out}; 3 launches already recorded there" in err
    assert _launch_lines(err) == []
    assert launches == ["plain", "dataparallel", "dataparallel"]


def test_resume_runs_a_skipped_cell_again_once_its_reason_is_gone(tmp_path, capsys, launches, monkeypatch):
    out = tmp_path / "rows.jsonl"
    command = [*MATRIX, "--strategy", "dataparallel", "--world-sizes", "2", "--out", str(out)]
    assert main(command) == 0
    monkeypatch.setattr(runner, "_skip_reason", lambda spec: None)   # say a GPU is here now
    monkeypatch.setattr(runner, "run_cell", lambda spec, **kwargs: RunResult(
        spec=spec, status=Status.FAILED, message="ran", run_id="again", repeat=kwargs["repeat"]))
    assert main([*command, "--resume"]) == 4          # it ran again (and the stand-in failed: exit 4)
    assert [row.message for row in read_results([out])][1:] == ["ran"]


def test_a_dry_run_of_a_resume_prints_what_the_resume_would_launch_and_launches_nothing(tmp_path, capsys, launches):
    out = tmp_path / "rows.jsonl"
    assert main([*MATRIX, "--strategy", "plain", "--out", str(out)]) == 0        # the run cut short after plain
    capsys.readouterr()
    launches.clear()
    assert main([*MATRIX, "--strategy", "plain,ddp", "--out", str(out), "--resume", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    # DDP at 1 and 2 ranks, 10 s each on the 2-core VM, and the harness's own 6 s (harness.run_cost): 26 s.
    assert printed.startswith(f"parbench: 3 cells, 2 launches -> {out}; 1 launch already recorded there, not launched "
                              "again; planned: about 0.4 min at the 2-core VM's launch times (harness/run_cost.py) "
                              "(a dry run of the resume: nothing is launched or written)")
    cells = [line for line in printed.splitlines() if "/ws" in line and " x" in line]
    assert [line.split()[0] for line in cells] == ["gpt-tiny/ddp/ws1/gb16/mb4/fp32/cpu",
                                                   "gpt-tiny/ddp/ws2/gb16/mb4/fp32/cpu"]
    assert launches == [] and len(read_results([out])) == 1          # nothing launched, nothing appended
    # Everything recorded: the resume would launch nothing, and its dry run says so.
    assert main([*MATRIX, "--strategy", "plain", "--out", str(out), "--resume", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith(f"parbench: 1 cells, 0 launches -> {out}; 1 launch already recorded")


def test_a_dry_run_of_a_resume_shows_the_folders_its_launches_will_use(tmp_path, capsys, launches):
    out = tmp_path / "rows.jsonl"
    assert main([*MATRIX, "--strategy", "plain", "--out", str(out)]) == 0       # r0 recorded
    capsys.readouterr()
    assert main([*MATRIX, "--strategy", "plain", "--repeats", "3", "--out", str(out), "--resume", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    [cell] = [line for line in printed.splitlines() if line.startswith("gpt-tiny/plain/")]
    assert cell.startswith("gpt-tiny/plain/ws1/gb16/mb4/fp32/cpu x2 (launches r1, r2): ")
    # r0 is recorded: the launches left run from -r1 and -r2, never r0's folder.
    assert "-r1/spec.json" in printed and "-r0/" not in printed
