"""A stop signal in the middle of a launch (harness.launch.interrupt): `run`, `comm` and `ab` each get SIGTERM, SIGINT
or SIGHUP once their ranks run, and must stop them, leave none of their process tree behind, and exit 128 + the
signal; `run` records the interrupted launch as a row of its own.

The process tree is the command's own (its descendants as they were when the signal was sent), never every process
on the machine: another test's ranks may be running beside these.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.record import COMMBENCH_KIND, read_results, read_rows
from harness.launch.interrupt import Interrupted
from harness.spec import Status

ROOT = Path(__file__).resolve().parent.parent
RANK_PROGRAMS = ("harness.rank.worker", "harness.commbench")


def _interrupt(arguments: list[str], signum: int, tmp_path: Path) -> tuple[int, list[psutil.Process], str]:
    """Start `python -m harness ARGUMENTS`, wait until one of its ranks runs (its busiest moment: launcher, ranks and
    collectives all up), send `signum` to it alone, and return its exit status, its process tree as it was then, and
    what it printed."""
    log = (tmp_path / "out.log").open("w+")
    command = subprocess.Popen([sys.executable, "-m", "harness", *arguments], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT)
    me = psutil.Process(command.pid)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and command.poll() is None:
        try:
            running = [" ".join(child.cmdline()) for child in me.children(recursive=True)]
        except psutil.Error:
            running = []
        if any(program in line for line in running for program in RANK_PROGRAMS):
            break
        time.sleep(0.2)
    assert command.poll() is None, "the command ended before its ranks ran"
    time.sleep(1.5)             # the ranks past their start-up, inside their steps or collectives
    tree = me.children(recursive=True)
    command.send_signal(signum)
    status = command.wait(timeout=180)
    log.seek(0)
    return status, tree, log.read()


def _left(tree: list[psutil.Process]) -> list[str]:
    psutil.wait_procs(tree, timeout=5)
    return [" ".join(p.cmdline())[:120] for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.launch
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_run_stops_its_launch_records_it_and_exits_128_plus_the_signal(signum, tmp_path):
    out = tmp_path / "rows.jsonl"
    status, tree, printed = _interrupt(["run", "--matrix", "smoke", "--strategy", "plain,ddp", "--timed-steps", "200",
                                        "--out", str(out)], signum, tmp_path)
    assert status == 128 + signum, printed
    assert tree and not _left(tree), printed
    rows = read_results([out])
    assert rows[-1].status is Status.INTERRUPTED and signal.Signals(signum).name in rows[-1].message
    assert f"exit {128 + signum}" in printed
    assert f"recorded as interrupted: {rows[-1].spec.label} r{rows[-1].repeat} -> {out}" in printed


@pytest.mark.launch
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_comm_stops_its_ranks_and_exits_128_plus_the_signal(signum, tmp_path):
    out = tmp_path / "comm.jsonl"
    status, tree, printed = _interrupt(["comm", "--world-size", "2", "--iters", "2000", "--out", str(out)], signum,
                                       tmp_path)
    assert status == 128 + signum, printed
    assert tree and not _left(tree), printed
    # Recorded as `run` records its launch: a row of its own, which no reader of measurements sees.
    [row] = read_rows([out], kind=COMMBENCH_KIND, unmeasured=True)
    assert row["status"] == Status.INTERRUPTED.value and signal.Signals(signum).name in row["message"]
    assert read_rows([out], kind=COMMBENCH_KIND) == []
    assert f"recorded as interrupted: the collective benchmark at world size 2 -> {out}" in printed


@pytest.mark.launch
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_ab_stops_its_sides_launch_removes_its_work_tree_and_exits_128_plus_the_signal(signum, tmp_path):
    before = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    status, tree, printed = _interrupt(["ab", "--out", str(tmp_path / "ab")], signum, tmp_path)
    assert status == 128 + signum, printed
    assert tree and not _left(tree), printed
    after = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before                    # the base's checkout removed


# ---- the exit message (no process: the signal's exception raised where it would arrive) ----------------------------

@pytest.fixture
def plain_run(monkeypatch, tmp_path):
    """`run` of the plain loop's one cell into tmp_path, with the environment's capture stubbed."""
    from harness import runner

    monkeypatch.setattr(runner, "capture_environment", lambda freeze_dir: {"cpu_model": "test", "cpu_count": 2})
    out = tmp_path / "rows.jsonl"
    return ["run", "--matrix", "wide", "--workload", "gpt-tiny", "--strategy", "plain", "--world-sizes", "1",
            "--repeats", "1", "--out", str(out)], out


def _stopped(*_, **__):
    raise Interrupted(signal.SIGTERM)


def test_a_signal_before_any_launch_claims_no_interrupted_row(plain_run, monkeypatch, capsys):
    from harness import runner
    from harness.cli import main

    arguments, out = plain_run
    monkeypatch.setattr(runner, "build_before_launch", _stopped)        # SIGTERM while the cells' builds run
    assert main(arguments) == 143
    printed = capsys.readouterr().err
    assert "parbench: SIGTERM: what was running is stopped" in printed and "exit 143" in printed
    assert "recorded as interrupted" not in printed and not out.exists()


def test_a_signal_during_a_launch_names_the_row_it_recorded(plain_run, monkeypatch, capsys):
    from harness import runner
    from harness.cli import main

    arguments, out = plain_run
    monkeypatch.setattr(runner, "build_before_launch", lambda specs, say: None)
    monkeypatch.setattr(runner, "run_cell", _stopped)                   # SIGTERM while the launch runs
    assert main(arguments) == 143
    [row] = read_results([out])
    assert row.status is Status.INTERRUPTED
    assert f"recorded as interrupted: {row.spec.label} r0 -> {out}" in capsys.readouterr().err
