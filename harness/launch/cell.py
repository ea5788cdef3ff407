"""Launch one cell through its strategy's own launcher, in its own process group, and turn the outcome
into a `RunResult` whatever happens: ok, oom, failed, timeout or skipped.

    run_cell(spec, repeat=0, cell_dir=..., timeout_s=900, environment=...)   (harness.runner loops over it)

On this host a launch is one command; across a hostfile's hosts it is one command per node, each reaching
its node through the remote shell; under Slurm it is one `sbatch --wait` (harness.launch.placement, harness.launch.slurm).
Every process of a cell carries a marker in its environment (PARBENCH_CELL_TOKEN). When the launch
exits, times out or is interrupted, every process here still carrying the marker is killed, and the
launch's clean-up commands sweep the other hosts (or cancel the job), so no rank outlives its cell.
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

from harness.launch import slurm
from harness.launch.placement import Placement, cleanup_script, forwarded_environment, node_script, remote_command
from harness.spec import RunResult, RunSpec, Status
from harness.strategies import Launcher, get_strategy
from harness.rank.worker import ERROR_FILE, MEASUREMENTS_FILE, THREADS_ENV

CELL_TOKEN_ENV = "PARBENCH_CELL_TOKEN"
LOG_FILE = "log.txt"
SPEC_FILE = "spec.json"
HOSTFILE = "hostfile"         # DeepSpeed's, for a multi-node DeepSpeed cell: its hosts and ranks per host


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


def torchrun_command(nnodes: int, ranks_per_node: int, endpoint: str, program: list[str],
                     local_addr: str | None = None, hosts_store: bool | None = None) -> list[str]:
    """torchrun with a c10d rendezvous at `endpoint` (host:port, a port per cell so cells never meet).
    On a node of a multi-node launch, `local_addr` is the address the node is reached at and `hosts_store`
    says whether it is the endpoint's host: torchrun would otherwise guess both from host names, which
    fails where hosts share a name (network namespaces) or the name resolves to another interface."""
    node = [f"--local-addr={local_addr}"] if local_addr else []
    if hosts_store is not None:
        node.append(f"--rdzv-conf=is_host={str(hosts_store).lower()}")
    return [*_executable("torchrun", "torch.distributed.run"),
            f"--nnodes={nnodes}", f"--nproc-per-node={ranks_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id=parbench-{endpoint.rsplit(':', 1)[-1]}", "--max-restarts=0", *node, *program]


def horovodrun_command(spec: RunSpec, program: list[str], timeout_s: float, hosts: str) -> list[str]:
    """horovodrun over `hosts` ("host:slots,..."), reaching remote ones itself (ssh), with gloo."""
    options = spec.resolved_options
    return [*_executable("horovodrun", "horovod.runner.launch"), "-np", str(spec.world_size), "-H", hosts,
            "--gloo", "--gloo-timeout-seconds", str(int(timeout_s)),
            "--fusion-threshold-mb", str(options["fusion_threshold_mb"]),
            "--cycle-time-ms", str(options["cycle_time_ms"]),
            sys.executable, *program]


def deepspeed_command(hostfile: Path, node: int, master: str, port: int, program: list[str]) -> list[str]:
    """DeepSpeed's launcher on one node of a hostfile (`--no_ssh`: the harness has reached the node; its
    default would be pdsh). It numbers ranks node by node in hostfile order, as on a cluster."""
    return [*_executable("deepspeed", "deepspeed.launcher.runner"), f"--hostfile={hostfile}", "--no_ssh",
            f"--node_rank={node}", f"--master_addr={master}", f"--master_port={port}", "--no_local_rank",
            "--module", *program[1:]]


def worker_program(cell_dir: Path) -> list[str]:
    """The rank's program after the interpreter: `-m harness.rank.worker` and its arguments."""
    return ["-m", "harness.rank.worker", "--spec", str(cell_dir / SPEC_FILE), "--out", str(cell_dir)]


def launch_command(spec: RunSpec, cell_dir: Path, port: int, timeout_s: float) -> list[str]:
    """The one command that launches a cell on this host."""
    worker = worker_program(cell_dir)
    launcher = get_strategy(spec.strategy).launcher
    if launcher is Launcher.SINGLE_PROCESS:
        return [sys.executable, *worker]
    if launcher is Launcher.TORCHRUN:
        return torchrun_command(1, spec.world_size, f"127.0.0.1:{port}", worker)
    if launcher is Launcher.HOROVODRUN:
        return horovodrun_command(spec, worker, timeout_s, f"localhost:{spec.world_size}")
    raise AssertionError(f"no command for launcher {launcher}")


@dataclass(frozen=True)
class Launch:
    """What the harness starts for one launch of a cell: one process, or one per node (each reaching
    its node), and the commands that clean up after it wherever its processes ran."""

    commands: tuple[tuple[str, ...], ...]
    cleanup: tuple[tuple[str, ...], ...] = ()


def plan_launch(spec: RunSpec, cell_dir: Path, port: int, timeout_s: float, placement: Placement,
                extra_env: dict[str, str]) -> Launch:
    if placement.slurm:
        return _slurm_launch(spec, cell_dir, port, timeout_s, placement, extra_env)
    if placement.multi_host:
        return _multi_host_launch(spec, cell_dir, port, timeout_s, placement, extra_env)
    return Launch(commands=(tuple(launch_command(spec, cell_dir, port, timeout_s)),))


def _multi_host_launch(spec: RunSpec, cell_dir: Path, port: int, timeout_s: float, placement: Placement,
                       extra_env: dict[str, str]) -> Launch:
    hosts = placement.hosts_for(spec)
    worker = worker_program(cell_dir)
    strategy = get_strategy(spec.strategy)
    if strategy.launcher is Launcher.HOROVODRUN:   # horovodrun reaches the hosts itself
        slots = ",".join(f"{host.name}:{spec.ranks_per_node}" for host in hosts)
        return Launch(commands=(tuple(horovodrun_command(spec, worker, timeout_s, slots)),))
    if strategy.multi_node_launcher is Launcher.DEEPSPEED:
        (cell_dir / HOSTFILE).write_text("".join(f"{h.name} slots={spec.ranks_per_node}\n" for h in hosts))
    environment = forwarded_environment(extra_env)
    commands = []
    for node, host in enumerate(hosts):
        if strategy.launcher is Launcher.SINGLE_PROCESS:
            command = [sys.executable, *worker]
        elif strategy.multi_node_launcher is Launcher.DEEPSPEED:
            command = deepspeed_command(cell_dir / HOSTFILE, node, hosts[0].name, port, worker)
        else:
            command = torchrun_command(spec.nnodes, spec.ranks_per_node, f"{hosts[0].name}:{port}", worker,
                                       local_addr=host.name, hosts_store=node == 0)
        commands.append(tuple(remote_command(placement, node, node_script(command, environment))))
    cleanup = tuple(tuple(remote_command(placement, node, cleanup_script(cell_dir / SPEC_FILE)))
                    for node in range(len(hosts)))
    return Launch(commands=tuple(commands), cleanup=cleanup)


def _slurm_launch(spec: RunSpec, cell_dir: Path, port: int, timeout_s: float, placement: Placement,
                  extra_env: dict[str, str]) -> Launch:
    worker = worker_program(cell_dir)
    launcher = get_strategy(spec.strategy).launcher
    if launcher is Launcher.HOROVODRUN:
        command, per_node = horovodrun_command(spec, worker, timeout_s, "$hosts"), False
    elif launcher is Launcher.SINGLE_PROCESS:
        command, per_node = [sys.executable, *worker], True
    else:
        command, per_node = torchrun_command(spec.nnodes, spec.ranks_per_node, f"$head:{port}", worker), True
    (cell_dir / slurm.JOB_SCRIPT).write_text(
        slurm.job_script(spec, command, forwarded_environment(extra_env), per_node))
    token = extra_env[CELL_TOKEN_ENV]
    submit = slurm.sbatch_command(spec, cell_dir, token, timeout_s, placement.slurm_args,
                                  threads_per_rank(spec))
    return Launch(commands=(tuple(submit),), cleanup=(tuple(slurm.cancel_command(token)),))


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
    token = uuid.uuid4().hex
    extra_env = launch_environment(spec, token)
    launch = plan_launch(spec, cell_dir, free_port(), timeout_s, placement, extra_env)
    common["launch_command"] = shown_command(list(launch.commands[0]), extra_env)
    if len(launch.commands) > 1:
        common["node_launch_commands"] = [list(command) for command in launch.commands]

    oom_kills_before = oom_kill_count()
    returncode, timed_out, wall = run_launcher(launch, extra_env, cell_dir / LOG_FILE, timeout_s)
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


def run_launcher(launch: Launch, extra_env: dict[str, str], log_path: Path,
                 timeout_s: float) -> tuple[int | None, bool, float]:
    """Start a launch's processes, each in a session of its own, log their output, wait at most
    `timeout_s`, and leave no process of them behind. Returns (the first non-zero exit status in node order,
    else 0, or None on timeout; timed out; wall seconds)."""
    token = extra_env[CELL_TOKEN_ENV]
    began = time.monotonic()
    processes: list[subprocess.Popen] = []
    with open(log_path, "wb") as log:   # one open file: the nodes' writes share its offset, none clobbers
        try:
            for node, command in enumerate(launch.commands):
                node_note = f"  # node {node}" if len(launch.commands) > 1 else ""
                log.write(f"$ {shlex.join(shown_command(list(command), extra_env))}{node_note}\n".encode())
                log.flush()
                processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True, env={**os.environ, **extra_env}))
            codes, timed_out = _wait_all(processes, began + timeout_s)
        finally:                   # also on Ctrl-C: take the cell's processes down with us
            for process in processes:
                kill_cell(process, token)
            for command in launch.cleanup:
                subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=60, check=False)
    returncode = None if timed_out else next((code for code in codes if code), 0)
    return returncode, timed_out, time.monotonic() - began


PEER_GRACE_S = 60.0   # after one node's launcher fails, how long the others get to notice and exit


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
    log = "\n".join(_read(path) for path in sorted(cell_dir.glob("log*.txt")))
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
