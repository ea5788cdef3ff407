"""The processes of one launch: start a plan's commands here, each in a session of its own, wait for them,
and leave nothing of them behind.

Every process of a launch carries a marker in its environment (CELL_TOKEN_ENV). When the launch exits,
times out or is interrupted, each command's process group is stopped, every process here that still
carries the marker is killed, and the plan's clean-up commands sweep the other hosts (or cancel the job).
A harness killed by SIGKILL does none of that: each command is started through harness.launch.tether, which
has it sent SIGTERM when the harness dies, and its processes carry the harness's own marker (OWNER_ENV), on
which the ranks end with it (harness.rank.parent_death).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import psutil

from harness.launch.plan import CELL_TOKEN_ENV, LaunchPlan
from harness.launch.tether import tethered
from harness.rank.parent_death import OWNER_ENV, owner_marker

PEER_GRACE_S = 60.0   # after one node's launcher fails, how long the others get to notice and exit
CLEANUP_TIMEOUT_S = 60.0


def shown_command(command: list[str], extra_env: dict[str, str]) -> list[str]:
    """The command as a user would type it: the environment the harness adds, then the launcher."""
    return [f"{k}={v}" for k, v in extra_env.items() if k != CELL_TOKEN_ENV] + command


def run_processes(plan: LaunchPlan, extra_env: dict[str, str], log_path: Path,
                  timeout_s: float) -> tuple[int | None, bool, float]:
    """Start a plan's commands, log their output, wait at most `timeout_s`, and leave no process of them
    behind. Returns (the first non-zero exit status in node order, else 0, or None on timeout; timed out;
    wall seconds)."""
    token = extra_env[CELL_TOKEN_ENV]
    environment = {**os.environ, **extra_env, OWNER_ENV: owner_marker() or ""}   # "": nothing to watch
    began = time.monotonic()
    processes: list[subprocess.Popen] = []
    with open(log_path, "wb") as log:   # one open file: the nodes' writes share its offset, none clobbers
        try:
            for command, target in zip(plan.commands, plan.targets):
                note = f"  # {target}" if len(plan.commands) > 1 else ""
                log.write(f"$ {shlex.join(shown_command(list(command), extra_env))}{note}\n".encode())
                log.flush()
                # Tethered in this thread, which outlives the launch (the `finally` below stops it first).
                processes.append(subprocess.Popen(tethered(command), stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True, env=environment))
            codes, timed_out = _wait_all(processes, began + timeout_s)
        finally:                   # also on Ctrl-C: take the launch's processes down with us
            for process in processes:
                kill_group(process)
            sweep(token)
            for command in plan.cleanup:
                try:
                    subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=CLEANUP_TIMEOUT_S,
                                   check=False)
                except (OSError, subprocess.TimeoutExpired) as error:   # one unreachable host must not stop the rest
                    log.write(f"clean-up {shlex.join(command)} failed: {error}\n".encode())
    returncode = None if timed_out else next((code for code in codes if code), 0)
    return returncode, timed_out, time.monotonic() - began


def _wait_all(processes: list[subprocess.Popen], deadline: float) -> tuple[list[int | None], bool]:
    """Wait for every process until `deadline`; once one fails, the rest get PEER_GRACE_S more at most
    (a rank blocked in a collective on a dead peer may only notice at its own timeout)."""
    while True:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes):
            return codes, False
        if any(codes):
            deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        if time.monotonic() >= deadline:   # a timeout only if nobody failed; else the failure is the news
            return codes, not any(codes)
        time.sleep(0.2)


def kill_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a command's process group: SIGTERM (launchers pass it on to their ranks), then SIGKILL after `grace_s`."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def stop_process_tree(process: subprocess.Popen, grace_s: float) -> None:
    """Stop a child that runs launches of its own (a `harness run` of the A/B tier): SIGTERM to its process group, on
    which it stops and records its launch, then SIGKILL after `grace_s` to whatever is left of its process tree as
    it was before the signal (its launches run in sessions of their own, outside its group, and a child of an older
    commit may not clean up after itself)."""
    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    kill_group(process, grace_s)
    for stray in tree:
        try:
            stray.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(tree, timeout=10)


def sweep(token: str) -> None:
    """Kill every process here that still carries the launch's marker, wherever it moved (a rank that
    left its launcher's session or process group)."""
    for stray in cell_processes(token):
        try:
            stray.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(cell_processes(token), timeout=10)


def cell_processes(token: str) -> list[psutil.Process]:
    """Processes of this user whose environment carries the launch's marker."""
    found = []
    me = os.getpid()
    for candidate in psutil.process_iter(["pid"]):
        if candidate.pid == me:
            continue
        try:
            if candidate.environ().get(CELL_TOKEN_ENV) == token:
                found.append(candidate)
        except psutil.Error:
            continue
    return found
