"""The launches of one `checkpoint` cell (harness.strategies.state_checkpoint), and the one row they make.

    checkpoint=at:K          uninterrupted (saves at K)            -> resume (new processes, from that save)
    checkpoint=at:K:from=W   uninterrupted at the cell's world size, stop (W ranks, saves at K) -> resume
    checkpoint=at:K:kill=S   uninterrupted (saves at K)            -> restart (saves at K, a rank killed at S,
                                                                       the launcher restarts the group, it resumes)
    checkpoint=at:K:leave=S  uninterrupted (saves at K)            -> restart (saves at K, the last node killed at
                                                                       S, the nodes left go on without it, resumed)

Each launch has a folder of its own under the cell's (spec.json, log.txt, the save), the launch under test the
cell's own folder, so the row is that launch's, carrying the uninterrupted launch's losses and its step-K norms
(`resume_reference`), which harness.derive.resume holds the resumed steps against, and every launch's command.
A launch that fails ends the cell: its row is that failure, named by the launch's role.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

from harness.rank.checkpointed_run import RESTART, RESUME, RUN_ENV, STOP, UNINTERRUPTED
from harness.rank.faults import FAULT_ENV, KILL_NODE
from harness.rank.worker import ERROR_FILE, MEASUREMENTS_FILE
from harness.spec import RunResult, RunSpec, Status
from harness.strategies.state_checkpoint import OPTION_NAME, CheckpointPlan, saving_spec

Launch = Callable[[RunSpec, Path, dict[str, Any], Mapping[str, str]], RunResult]
CHECKPOINT_FOLDER = "checkpoint"
# torchrun's agent shares its rendezvous TCPStore with the workers (torch 2.13, dynamic_rendezvous.py `use_agent_store`)
# and keeps it across a restart, so the restarted ranks read the killed attempt's gloo addresses from it and fail
# ("Connection refused"); without the sharing, rank 0 of each attempt serves a store of its own.
RESTARTED_GROUPS_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def run_checkpointed(spec: RunSpec, plan: CheckpointPlan, *, cell_dir: Path, common: dict[str, Any],
                     launch: Launch) -> RunResult:
    """Run the cell's launches in turn (`launch(spec, folder, common, environment)` runs one); the row."""
    cell_dir.mkdir(parents=True, exist_ok=True)
    for stale in (cell_dir / UNINTERRUPTED, cell_dir / STOP, cell_dir / CHECKPOINT_FOLDER):
        shutil.rmtree(stale, ignore_errors=True)       # a save or row of an earlier launch of this cell
    launches: list[dict[str, Any]] = []

    def run(role: str, launch_spec: RunSpec, folder: Path, saves_in: Path, extra: Mapping[str, str] = {}) -> RunResult:
        environment = {RUN_ENV: json.dumps({"role": role, "at": plan.at, "directory": str(saves_in)}), **extra}
        result = launch(launch_spec, folder, common, environment)
        launches.append({"role": role, "world_size": launch_spec.world_size, "status": result.status.value,
                         "launch_command": result.launch_command, "wall_time_s": result.wall_time_s})
        return result

    # The uninterrupted run at the cell's world size: the reference, and the save where no other launch makes one.
    reference_spec = spec.replace(options={**dict(spec.options), OPTION_NAME: f"at:{plan.at}"})
    reference_saves = cell_dir / UNINTERRUPTED / CHECKPOINT_FOLDER
    reference = run(UNINTERRUPTED, reference_spec, cell_dir / UNINTERRUPTED, reference_saves)
    if reference.status is not Status.OK:
        return _failed(reference, common, f"the uninterrupted launch {reference.status.value}", launches)
    saves_in = reference_saves
    if plan.from_world_size is not None:
        saves_in = cell_dir / STOP / CHECKPOINT_FOLDER
        saved = run(STOP, saving_spec(spec, plan), cell_dir / STOP, saves_in)
        if saved.status is not Status.OK:
            return _failed(saved, common, f"the launch that saves at {plan.from_world_size} ranks "
                           f"{saved.status.value}", launches)
    if plan.failure_step is None:
        tested = run(RESUME, spec, cell_dir, saves_in)
    else:
        kind = "kill" if plan.kill_step is not None else KILL_NODE
        rank = plan.killed_rank(spec.world_size)
        tested = run(RESTART, spec, cell_dir, cell_dir / CHECKPOINT_FOLDER,
                     {FAULT_ENV: f"{kind}:rank={rank}:step={plan.failure_step}", **RESTARTED_GROUPS_STORE})
        if plan.leave_step is not None:
            tested = _without_the_node_that_left(tested, cell_dir)
    if tested.status is not Status.OK:
        return _failed(tested, common, _failure_of(spec, plan, tested), launches)
    measurements = {**tested.measurements, "checkpoint_launches": launches,
                    "resume_reference": _reference_of(reference)}
    # The cell's folder keeps the whole row's measurements, so a resumed run that recovers the row from the folder
    # (harness.runner.recover_from_cell_dir) recovers what it is held against as well.
    (cell_dir / MEASUREMENTS_FILE).write_text(json.dumps(measurements, indent=1, default=str))
    return RunResult(**{**common, "spec": spec, "status": Status.OK, "measurements": measurements,
                        "launch_command": tested.launch_command, "node_launch_commands": tested.node_launch_commands,
                        "wall_time_s": round(sum(entry["wall_time_s"] for entry in launches), 3)})


def _without_the_node_that_left(tested: RunResult, cell_dir: Path) -> RunResult:
    """The launch a node left on purpose: its launcher there exits killed, which is the cell working as planned where
    the nodes left finished (rank 0's measurements written, no rank's report of this attempt)."""
    measurements = cell_dir / MEASUREMENTS_FILE
    if tested.status is Status.OK or tested.status is Status.TIMEOUT or not measurements.is_file() \
            or any(cell_dir.glob(ERROR_FILE.format(rank="*"))):
        return tested
    return dataclasses.replace(tested, status=Status.OK, message="",
                               measurements=json.loads(measurements.read_text()))


def _reference_of(reference: RunResult) -> dict[str, Any]:
    """What the resumed steps are held against: the uninterrupted launch's losses, its norms of step K, and its save."""
    m = reference.measurements
    return {"world_size": reference.spec.world_size, "loss_per_step": m.get("loss_per_step"),
            "probe": m.get("checkpoint_probe"), "checkpoint": m.get("checkpoint"),
            "gradient_reduce_dtypes": m.get("gradient_reduce_dtypes"), "precision_recipe": m.get("precision_recipe")}


def _failure_of(spec: RunSpec, plan: CheckpointPlan, tested: RunResult) -> str:
    """What ended the launch under test: for a kill, the kill, and whether its launcher could restart it."""
    if plan.failure_step is None:
        return f"the resumed launch {tested.status.value}"
    from harness.launch.plan import launcher_of

    launcher = launcher_of(spec)
    restart = ("restarted it once (torchrun --max-restarts 1), and it still" if launcher.restarts else
               f"restarts nothing ({launcher.name} has no restart of a failed rank), so it")
    lost = (f"rank {plan.killed_rank(spec.world_size)} was killed" if plan.kill_step is not None
            else "the last node's agent and ranks were killed")
    return f"{lost} (SIGKILL, planted) at step {plan.failure_step}; its launcher {restart} {tested.status.value}"


def _failed(result: RunResult, common: dict[str, Any], what: str, launches: list[dict[str, Any]]) -> RunResult:
    message = f"{what}: {result.message}" if result.message else what
    return RunResult(**{**common, "status": result.status, "message": message[:600],
                        "measurements": {"checkpoint_launches": launches},
                        "launch_command": result.launch_command, "wall_time_s": result.wall_time_s})
