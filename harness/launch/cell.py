"""Launch one cell through its strategy's own launcher, where its placement puts it, and turn the outcome
into a `RunResult` whatever happens: ok, oom, failed, timeout or skipped.

    run_cell(spec, repeat=0, cell_dir=..., timeout_s=900, environment=..., placement=...)   (harness.runner loops over it)

The strategy names its launcher (harness.launch.launcher), which builds each node's argv; the placement
(harness.launch.placement) chooses the rendezvous port where it is served and turns the argvs into
commands started here, with their clean-up; harness.launch.processes runs them and leaves nothing behind.
"""

from __future__ import annotations

import json
import re
import signal
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from harness.derive.identity import conditions_of, identity_of, network_tag
from harness.launch.launcher import Launcher
from harness.launch.placement import LocalPlacement, Placement
from harness.launch.plan import CELL_TOKEN_ENV, SPEC_FILE, LaunchError, launch_environment, launcher_of, plan_launch
from harness.launch.processes import run_processes, shown_command
from harness.memory_fit import skip_reason
from harness.rank.worker import ERROR_FILE, MEASUREMENTS_FILE
from harness.spec import RunResult, RunSpec, Status
from harness.strategies import get_strategy
from harness.strategies.state_checkpoint import plan_of

__all__ = ["CELL_TOKEN_ENV", "LOG_FILE", "SPEC_FILE", "cells_dir", "launch_dir", "run_cell"]

LOG_FILE = "log.txt"


def cells_dir(results: Path) -> Path:
    """Folder of per-cell artifacts (spec, logs) beside a results file."""
    return results.with_name(results.stem + "-cells")


def launch_dir(results: Path, spec: RunSpec, repeat: int, *, environment: Mapping[str, Any]) -> Path:
    """The folder of one launch of a cell, beside the results file its row goes to: named by the cell's
    identity under the run's `environment` (harness.derive.identity), so that the same spec run at another
    link rate, placement or host type gets folders of its own instead of overwriting these."""
    spec_fields = spec.to_dict()
    tag = network_tag(conditions_of(spec_fields, environment))
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.label + tag)[:80]
    return cells_dir(results) / f"{slug}-{identity_of(spec_fields, environment)}-r{repeat}"


def run_cell(spec: RunSpec, *, repeat: int, cell_dir: Path, timeout_s: float, environment: dict[str, Any],
             placement: Placement = LocalPlacement()) -> RunResult:
    """Launch one repeat of one cell and wait for it; never raises for a failure of the cell itself."""
    run_id = uuid.uuid4().hex
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    common = {"spec": spec, "run_id": run_id, "repeat": repeat, "environment": environment,
              "started_at": started, "artifacts_dir": str(cell_dir)}

    reason = skip_reason(spec)
    if reason:
        return RunResult(status=Status.SKIPPED, message=reason, **common)

    plan = plan_of(spec) if get_strategy(spec.strategy).checkpoint_method else None
    if plan is not None:
        from harness.launch.checkpointed import run_checkpointed    # the cells of several launches

        return run_checkpointed(spec, plan, cell_dir=cell_dir, common=common,
                                launch=lambda s, d, c, env: launch_once(s, cell_dir=d, common=c, timeout_s=timeout_s,
                                                                        placement=placement, extra=env))
    return launch_once(spec, cell_dir=cell_dir, common=common, timeout_s=timeout_s, placement=placement)


def launch_once(spec: RunSpec, *, cell_dir: Path, common: dict[str, Any], timeout_s: float, placement: Placement,
                extra: Mapping[str, str] | None = None) -> RunResult:
    """One launch of `spec` from `cell_dir`, with `extra` added to its processes' environment; its row."""
    common = {**common, "spec": spec}
    cell_dir.mkdir(parents=True, exist_ok=True)
    (cell_dir / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=1))
    launcher = launcher_of(spec)
    token = uuid.uuid4().hex
    try:
        port = placement.rendezvous_port(spec) if launcher.uses_port else ""
    except LaunchError as error:
        return RunResult(status=Status.FAILED, message=str(error), **common)
    extra_env = {**launch_environment(spec, token), **(extra or {})}
    plan = plan_launch(spec, placement, cell_dir=cell_dir, port=port, environment=extra_env, timeout_s=timeout_s)
    for path, text in plan.files:
        path.write_text(text)
    common["launch_command"] = shown_command(list(plan.commands[0]), extra_env)
    if len(plan.commands) > 1:
        common["node_launch_commands"] = [list(command) for command in plan.commands]

    oom_kills_before = oom_kill_count()
    returncode, timed_out, wall = run_processes(plan, extra_env, cell_dir / LOG_FILE, timeout_s)
    common["wall_time_s"] = round(wall, 3)

    if timed_out:
        return RunResult(status=Status.TIMEOUT, message=f"no result within {timeout_s:g} s; all ranks killed",
                         **common)
    oom_killed = oom_kills_before is not None and (oom_kill_count() or 0) > oom_kills_before
    return launch_outcome(cell_dir, returncode, oom_killed, launcher, common)


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


def launch_outcome(cell_dir: Path, returncode: int, oom_killed: bool, launcher: Launcher,
                   common: dict[str, Any]) -> RunResult:
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
    if returncode == -signal.SIGKILL or any(mark in log for mark in launcher.sigkill_marks):
        return RunResult(status=Status.FAILED, message="a rank was killed by SIGKILL (not by the kernel's "
                         "out-of-memory killer, whose count did not move); see log.txt", **common)
    silent = _silent_ranks(common["spec"].world_size, errors)
    if silent and reports and all(_echoes_a_lost_peer(report["message"]) for report in reports):
        # A launcher names the kill only when it notices that rank first (DeepSpeed's logs the first
        # non-zero exit it polls, often the echo); a rank that left no report while every other rank only
        # saw a peer vanish is the root cause, whatever the launcher noticed.
        names = ", ".join(str(rank) for rank in silent)
        return RunResult(status=Status.FAILED, message=f"rank {names} died without a report of its own, as a rank "
                         "killed by a signal (SIGKILL) does; the others only saw it go: "
                         f"{reports[0]['message'][:160]}", **common)
    if reports:
        return RunResult(status=Status.FAILED, message=reports[0]["message"], **common)
    return RunResult(status=Status.FAILED, message=f"launcher exited {returncode}: {_last_lines(log)[-300:]}",
                     **common)


# What a rank reports when a peer vanished under it (gloo, NCCL, Horovod), as opposed to a fault of its own.
LOST_PEER_ECHOES = ("Connection closed by peer", "Connection reset by peer", "Horovod has been shut down",
                    "remote process exited", "Broken pipe", "Connection refused")


def _echoes_a_lost_peer(message: str) -> bool:
    return any(echo.lower() in message.lower() for echo in LOST_PEER_ECHOES)


def _silent_ranks(world_size: int, error_files: list[Path]) -> list[int]:
    """Ranks that wrote no error report (a report is rank{N}.error.json)."""
    reported = {int(re.search(r"rank(\d+)", path.name).group(1)) for path in error_files}
    return [rank for rank in range(world_size) if rank not in reported]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _last_lines(text: str, count: int = 5) -> str:
    return " | ".join([line for line in text.splitlines() if line.strip()][-count:])
