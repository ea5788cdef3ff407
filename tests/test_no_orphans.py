"""Nothing of a launch outlives a `harness run` killed by SIGKILL (harness.launch.tether, harness.rank.parent_death).

A killed harness runs no clean-up of its own, and each launcher runs in a session of its own, outside the harness's
process group: before the tether, `kill -9 -PGID` of the harness left torchrun and both its ranks running. The
matrix-tier test starts `python -m harness run` on one 2-rank cell of each launcher in a session of its own, with a
marker of its own in its environment (every process of the launch inherits it: launchers, DeepSpeed's launch.py,
Horovod's middlemen and shells, ranks), waits until the cell's ranks exist (or step), kills the harness's process
group with SIGKILL and looks for any process of the launch: by the marker, or by the run's folder on its command
line. The tests after it hold each link on its own, with stand-in processes: the launcher's signal and the check
before it, the watcher of its process group, a rank's own signal and its watch on the harness.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from harness.launch.tether import tethered
from harness.rank.parent_death import OWNER_ENV, owner_marker

ROOT = Path(__file__).resolve().parent.parent
MARK_ENV = "PARBENCH_TEST_LAUNCH_MARK"
RANK_PROGRAM = "harness.rank.worker"
GONE_WITHIN_S = 15.0


def _processes_of(mark: str, folder: Path) -> list[psutil.Process]:
    """Live processes carrying `mark` in their environment or naming `folder` on their command line (a zombie has
    ended: only its parent's wait is left)."""
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if process.environ().get(MARK_ENV) == mark or str(folder) in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _described(processes: list[psutil.Process]) -> list[str]:
    described = []
    for process in processes:
        try:
            described.append(f"{process.pid} {' '.join(process.cmdline())[:160]}")
        except psutil.Error:
            continue
    return described


def _ranks(processes: list[psutil.Process]) -> int:
    """How many of `processes` are ranks: an interpreter running the worker module (a launcher's command line names
    it further on)."""
    count = 0
    for process in processes:
        try:
            count += RANK_PROGRAM in process.cmdline()[1:4]
        except psutil.Error:
            continue
    return count


def _kill_run_midway(strategy: str, moment: str, tmp_path: Path) -> tuple[list[str], float]:
    """Start a run of `strategy`'s 2-rank gpt-tiny cell, SIGKILL its process group at `moment` (`starting`: once both
    ranks exist, while they import; `stepping`: once both have logged their strategy started), and return what of
    the launch is left after GONE_WITHIN_S (nothing, if all is well) and the seconds until the last of it went."""
    mark = uuid.uuid4().hex
    out = tmp_path / "rows.jsonl"
    with open(tmp_path / "harness.log", "wb") as log:
        harness = subprocess.Popen([sys.executable, "-m", "harness", "run", "--matrix", "smoke", "--strategy", strategy,
                                    "--world-sizes", "2", "--timed-steps", "1000000", "--out", str(out)],
                                   cwd=ROOT, env={**os.environ, MARK_ENV: mark}, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and harness.poll() is None and not _at(moment, mark, tmp_path):
            time.sleep(0.2)
        assert harness.poll() is None and _at(moment, mark, tmp_path), (tmp_path / "harness.log").read_text()[-2000:]
        os.killpg(harness.pid, signal.SIGKILL)
        harness.wait()
        killed = time.monotonic()
        left = _processes_of(mark, tmp_path)
        while left and time.monotonic() - killed < GONE_WITHIN_S:
            time.sleep(0.1)
            left = _processes_of(mark, tmp_path)
        return _described(left), time.monotonic() - killed
    finally:
        for process in _processes_of(mark, tmp_path):     # whatever the verdict, nothing stays behind
            try:
                process.kill()
            except psutil.Error:
                pass
        if harness.poll() is None:
            os.killpg(harness.pid, signal.SIGKILL)
            harness.wait()


def _at(moment: str, mark: str, tmp_path: Path) -> bool:
    if moment == "starting":
        return _ranks(_processes_of(mark, tmp_path)) >= 2
    logs = "".join(log.read_text(errors="replace") for log in tmp_path.glob("rows-cells/*/log.txt"))
    return all(re.search(rf"\[parbench rank {rank}\] \S+ \S+ started \(", logs) for rank in (0, 1))


@pytest.mark.launch
@pytest.mark.matrix
@pytest.mark.parametrize("moment", ["starting", "stepping"])
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "horovod"])   # torchrun, deepspeed, horovodrun
def test_sigkill_to_the_run_leaves_no_process_of_its_launch(strategy, moment, tmp_path):
    if strategy == "horovod":
        pytest.importorskip("horovod.torch")
    if strategy == "zero2":
        pytest.importorskip("deepspeed")
    left, seconds = _kill_run_midway(strategy, moment, tmp_path)
    print(f"{strategy}, {moment}: the launch's last process was gone {seconds:.1f} s after the SIGKILL")
    assert left == [], f"still running {GONE_WITHIN_S:g} s after the harness was killed: {left}"


def _sleeper(parent_code: str, tmp_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """A parent python running `parent_code`, which starts the child whose pid it writes to child.pid; returns the
    parent and the child's pid once it is written."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", parent_code, str(pid_file)], cwd=ROOT,
                              env={**os.environ, **(env or {})}, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (pid_file.exists() and pid_file.read_text().endswith("\n")):
        time.sleep(0.05)
    return parent, int(pid_file.read_text())


def _gone(pid: int, within_s: float) -> bool:
    """Whether process `pid` ends within `within_s` (a zombie has ended); one still running is killed."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            process.kill()
            return False
        time.sleep(0.05)


# A rank as a launcher starts it: a child of the launcher, that calls die_with_launcher first, says it is ready,
# then works on.
RANK = ("import sys, time\n"
        "from harness.rank.parent_death import die_with_launcher\n"
        "die_with_launcher()\n"
        "open(sys.argv[1], 'a').write('ready\\n')\n"
        "time.sleep(600)\n")
LAUNCHER = ("import os, subprocess, sys, time\n"
            f"rank = subprocess.Popen([sys.executable, '-c', {RANK!r}, sys.argv[1] + '.rank'])\n"
            "while not os.path.exists(sys.argv[1] + '.rank'):\n"
            "    time.sleep(0.05)\n"
            "open(sys.argv[1], 'w').write(f'{rank.pid}\\n')\n"
            "time.sleep(600)\n")


@pytest.mark.launch
def test_a_rank_dies_with_its_launcher(tmp_path):
    launcher, rank = _sleeper(LAUNCHER, tmp_path)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert _gone(rank, 5), "the rank outlived its launcher"


@pytest.mark.launch
def test_a_rank_dies_with_the_harness_that_started_its_launch(tmp_path):
    """The launcher lives on (DeepSpeed's launch.py, once the runner above it is gone): the rank ends when the
    harness named in its environment does."""
    harness = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        marker = owner_marker(harness.pid)
        launcher, rank = _sleeper(LAUNCHER, tmp_path, env={OWNER_ENV: marker})
        time.sleep(0.5)
        assert psutil.pid_exists(rank), "the rank ended while the harness was alive"
        harness.kill()
        harness.wait()
        assert _gone(rank, 5), "the rank outlived the harness"
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.launch
def test_the_tether_runs_nothing_once_its_parent_is_gone(tmp_path):
    """The harness died between starting the tether and the tether's asking for its death signal: no signal would
    ever come, so the command must not start."""
    started = tmp_path / "started"
    command = tethered(["touch", str(started)])
    parent = command.index("--parent") + 1
    command[parent] = str(os.getpid() + 1_000_000)       # not this tether's parent, as after the harness died
    ran = subprocess.run(command, cwd=ROOT)
    assert ran.returncode != 0 and not started.exists()
    command[parent] = str(os.getpid())
    assert subprocess.run(command, cwd=ROOT).returncode == 0 and started.exists()


# A launcher that notes SIGTERM, started by a harness through the tether.
NOTES_SIGTERM = ("import os, signal, sys, time\n"
                 "signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1] + '.term', 'w').close(), sys.exit(0)))\n"
                 "open(sys.argv[1], 'w').write(f'{os.getpid()}\\n')\n"
                 "time.sleep(600)\n")
HARNESS = ("import subprocess, sys, time\n"
           "from harness.launch.tether import tethered\n"
           f"subprocess.Popen(tethered([sys.executable, '-c', {NOTES_SIGTERM!r}, sys.argv[1]]))\n"
           "time.sleep(600)\n")


@pytest.mark.launch
def test_a_tethered_launcher_gets_sigterm_when_the_harness_dies(tmp_path):
    """SIGTERM, as `kill_group` sends first: a launcher passes it on to its ranks."""
    harness, launcher = _sleeper(HARNESS, tmp_path)
    os.kill(harness.pid, signal.SIGKILL)
    harness.wait()
    assert _gone(launcher, 5), "the launcher outlived the harness"
    assert (tmp_path / "child.pid.term").exists(), "the launcher was not sent SIGTERM"


# A launcher that dies of SIGTERM at once and leaves what it started in its process group, as DeepSpeed's runner
# leaves launch.py; started by a harness through the tether, in a session of its own as a launch's commands are.
LEAVES_A_CHILD = ("import os, subprocess, sys, time\n"
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                  "open(sys.argv[1], 'w').write(f'{child.pid}\\n')\n"
                  "time.sleep(600)\n")
HARNESS_OF_A_GROUP = ("import subprocess, sys, time\n"
                      "from harness.launch.tether import tethered\n"
                      f"subprocess.Popen(tethered([sys.executable, '-c', {LEAVES_A_CHILD!r}, sys.argv[1]]),"
                      " start_new_session=True)\n"
                      "time.sleep(600)\n")


@pytest.mark.launch
def test_what_a_tethered_launcher_started_in_its_group_ends_with_the_harness(tmp_path):
    harness, child = _sleeper(HARNESS_OF_A_GROUP, tmp_path)
    os.kill(harness.pid, signal.SIGKILL)
    harness.wait()
    assert _gone(child, 5), "the launcher's child outlived the harness"


# ---- the rank's checks, in this process (nothing is started) ------------------------------------------------------

class Ended(Exception):
    """Stands for the rank's SIGKILL to itself."""


@pytest.fixture
def ends(monkeypatch):
    from harness.rank import parent_death

    def end():
        raise Ended

    monkeypatch.setattr(parent_death, "_end", end)
    monkeypatch.setattr(parent_death, "set_parent_death_signal", lambda signum: True)   # not on pytest itself
    return parent_death


def test_a_rank_whose_launcher_died_before_its_death_signal_was_set_ends_at_once(ends, monkeypatch):
    parents = iter([4242, 1])          # its launcher, then init: the launcher died between the two looks
    monkeypatch.setattr(ends.os, "getppid", lambda: next(parents))
    with pytest.raises(Ended):
        ends.die_with_launcher()


def test_a_rank_whose_launcher_lives_goes_on(ends, monkeypatch):
    monkeypatch.setattr(ends.os, "getppid", lambda: 4242)
    monkeypatch.delenv(OWNER_ENV, raising=False)
    ends.die_with_launcher()


def test_a_harness_gone_before_the_rank_looked_ends_the_rank_at_once(ends):
    pid, started, machine = owner_marker().split(":", 2)
    with pytest.raises(Ended):         # this pid, started at another time: the harness's pid, reused
        ends.watch_owner(f"{pid}:{int(started) + 1}:{machine}")


def test_a_harness_on_another_machine_is_not_watched(ends):
    pid, started, _ = owner_marker().split(":", 2)
    assert ends.watch_owner(f"{pid}:{started}:another-boot:4026531836") is None
    assert ends.watch_owner("") is None
