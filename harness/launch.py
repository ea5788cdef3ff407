"""Launch one cell through its strategy's own launcher, in its own process group, and turn the outcome
into a `RunResult` whatever happens: ok, oom, failed, timeout or skipped.

    python -c "from harness.launch import launch_command; ..."   (see harness.runner for the loop)

Every process of a cell carries a marker in its environment (PARBENCH_CELL_TOKEN). When the launcher
exits, times out or is interrupted, every process still carrying the marker is killed, so no rank outlives
its cell even if a launcher re-parented it or started it in a session of its own.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from harness.spec import RunResult, RunSpec, Status
from harness.strategies import Launcher, get_strategy
from harness.worker import ERROR_FILE, MEASUREMENTS_FILE, THREADS_ENV

CELL_TOKEN_ENV = "PARBENCH_CELL_TOKEN"
LOG_FILE = "log.txt"
SPEC_FILE = "spec.json"


@dataclass(frozen=True)
class Placement:
    """Where a cell's ranks go: this host only, or several hosts (multi-node launches)."""

    hosts: tuple[str, ...] = ()      # empty: this host only
    master_addr: str = "127.0.0.1"

    @property
    def multi_node(self) -> bool:
        return len(self.hosts) > 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, for a cell's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def threads_per_rank(spec: RunSpec) -> int:
    """CPU threads each rank may use: the user's OMP_NUM_THREADS, else one.

    One thread per rank makes a core play the part of a device: every rank runs the same kernels with the
    same threading at every world size, and N ranks use N cores, as N GPUs would, so CPU scaling figures
    compare like with like. A lone rank spreading over all cores would change its own kernels' speed
    with the world size.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return 1


def _executable(name: str, module: str) -> list[str]:
    """The launcher's console script beside this Python, else `python -m module`."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return [str(beside)]
    found = shutil.which(name)
    return [found] if found else [sys.executable, "-m", module]


def torchrun_command(nnodes: int, ranks_per_node: int, placement: Placement, port: int,
                     program: list[str]) -> list[str]:
    """torchrun with a c10d rendezvous on the given port (one per cell, so cells never meet)."""
    return [*_executable("torchrun", "torch.distributed.run"),
            f"--nnodes={nnodes}", f"--nproc-per-node={ranks_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={placement.master_addr}:{port}",
            f"--rdzv-id=parbench-{port}", "--max-restarts=0", *program]


def launch_command(spec: RunSpec, cell_dir: Path, port: int, timeout_s: float,
                   placement: Placement = Placement()) -> list[str]:
    worker = ["-m", "harness.worker", "--spec", str(cell_dir / SPEC_FILE), "--out", str(cell_dir)]
    launcher = get_strategy(spec.strategy).launcher
    if launcher is Launcher.SINGLE_PROCESS:
        return [sys.executable, *worker]
    if launcher is Launcher.TORCHRUN:
        return torchrun_command(spec.nnodes, spec.ranks_per_node, placement, port, worker)
    if launcher is Launcher.HOROVODRUN:
        options = spec.resolved_options
        hosts = ",".join(f"{h}:{spec.ranks_per_node}" for h in placement.hosts) or f"localhost:{spec.world_size}"
        return [*_executable("horovodrun", "horovod.runner.launch"), "-np", str(spec.world_size), "-H", hosts,
                "--gloo", "--gloo-timeout-seconds", str(int(timeout_s)),
                "--fusion-threshold-mb", str(options["fusion_threshold_mb"]),
                "--cycle-time-ms", str(options["cycle_time_ms"]),
                sys.executable, *worker]
    raise AssertionError(f"no command for launcher {launcher}")


def launch_environment(spec: RunSpec, token: str) -> dict[str, str]:
    threads = str(threads_per_rank(spec))
    return {CELL_TOKEN_ENV: token, THREADS_ENV: threads, "OMP_NUM_THREADS": threads,
            "PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def run_cell(spec: RunSpec, *, repeat: int, cell_dir: Path, timeout_s: float, environment: dict[str, Any],
             placement: Placement = Placement()) -> RunResult:
    """Launch one repeat of one cell and wait for it; never raises for a failure of the cell itself."""
    run_id = uuid.uuid4().hex
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    common = {"spec": spec, "run_id": run_id, "repeat": repeat, "environment": environment,
              "started_at": started, "artifacts_dir": str(cell_dir)}

    reason = get_strategy(spec.strategy).skip_reason(spec)
    if reason:
        return RunResult(status=Status.SKIPPED, message=reason, **common)

    cell_dir.mkdir(parents=True, exist_ok=True)
    (cell_dir / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=1))
    port = free_port()
    command = launch_command(spec, cell_dir, port, timeout_s, placement)
    token = uuid.uuid4().hex
    extra_env = launch_environment(spec, token)
    common["launch_command"] = shown_command(command, extra_env)

    oom_kills_before = oom_kill_count()
    returncode, timed_out, wall = run_launcher(command, extra_env, cell_dir / LOG_FILE, timeout_s)
    common["wall_time_s"] = round(wall, 3)

    if timed_out:
        return RunResult(status=Status.TIMEOUT, message=f"no result within {timeout_s:g} s; all ranks killed",
                         **common)
    oom_killed = oom_kills_before is not None and (oom_kill_count() or 0) > oom_kills_before
    return _outcome(cell_dir, returncode, oom_killed, common)


def oom_kill_count() -> int | None:
    """Processes the kernel's out-of-memory killer has killed since boot (/proc/vmstat, Linux >= 4.13)."""
    try:
        with open("/proc/vmstat") as vmstat:
            for line in vmstat:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def shown_command(command: list[str], extra_env: dict[str, str]) -> list[str]:
    """The command as a user would type it: the environment the harness adds, then the launcher."""
    return [f"{k}={v}" for k, v in extra_env.items() if k != CELL_TOKEN_ENV] + command


def run_launcher(command: list[str], extra_env: dict[str, str], log_path: Path,
                 timeout_s: float) -> tuple[int | None, bool, float]:
    """Start a launcher in a session of its own, log its output, wait at most `timeout_s`, and leave no
    process of it behind. Returns (exit status or None, timed out, wall seconds)."""
    token = extra_env[CELL_TOKEN_ENV]
    shown = shown_command(command, extra_env)
    began = time.monotonic()
    with open(log_path, "wb") as log:
        log.write(f"$ {shlex.join(shown)}\n".encode())
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **extra_env})
        try:
            returncode = process.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = None
        except BaseException:          # Ctrl-C: take the cell's processes down with us
            kill_cell(process, token)
            raise
        finally:
            kill_cell(process, token)
    return returncode, timed_out, time.monotonic() - began


def _outcome(cell_dir: Path, returncode: int, oom_killed: bool, common: dict[str, Any]) -> RunResult:
    """The row of a launch that ended on its own. A root cause beats its echoes: when one rank runs out of
    memory or is killed, its peers fail too ("connection closed by peer") and write reports of their own."""
    measurements_path = cell_dir / MEASUREMENTS_FILE
    errors = sorted(cell_dir.glob(ERROR_FILE.format(rank="*")))
    if returncode == 0 and measurements_path.exists() and not errors:
        return RunResult(status=Status.OK, measurements=json.loads(measurements_path.read_text()), **common)
    reports = [json.loads(path.read_text()) for path in errors]
    oom = [r for r in reports if r.get("status") == Status.OOM.value]
    if oom:
        return RunResult(status=Status.OOM, message=oom[0]["message"], **common)
    if oom_killed:
        return RunResult(status=Status.OOM, message="the kernel's out-of-memory killer killed a process "
                         f"while the cell ran (/proc/vmstat oom_kill); launcher exited {returncode}", **common)
    log = _read(cell_dir / LOG_FILE)
    if returncode == -signal.SIGKILL or "Signal 9 (SIGKILL)" in log:
        return RunResult(status=Status.FAILED, message="a rank was killed by SIGKILL (not by the kernel's "
                         "out-of-memory killer, whose count did not move); see log.txt", **common)
    if reports:
        return RunResult(status=Status.FAILED, message=reports[0]["message"], **common)
    return RunResult(status=Status.FAILED, message=f"launcher exited {returncode}: {_last_lines(log)[-300:]}",
                     **common)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _last_lines(text: str, count: int = 5) -> str:
    return " | ".join([line for line in text.splitlines() if line.strip()][-count:])


def kill_cell(process: subprocess.Popen, token: str) -> None:
    """Stop the launcher's process group, then every process that still carries the cell's marker."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    for stray in cell_processes(token):
        try:
            stray.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(cell_processes(token), timeout=10)


def cell_processes(token: str) -> list[psutil.Process]:
    """Processes of this user whose environment carries the cell's marker."""
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
