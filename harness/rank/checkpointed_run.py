"""What one launch of a `checkpoint` cell does in each rank (harness.strategies.state_checkpoint): save at step K,
stop there, or start from a save, as harness.launch.checkpointed tells it in PARBENCH_CHECKPOINT_RUN.

    PARBENCH_CHECKPOINT_RUN='{"role": "resume", "at": 2, "directory": "CELL/checkpoint"}'

roles:
- `uninterrupted`: trains every step, saving at K (before step K runs, after K updates), and where the library saves
  asynchronously (DCP's `async_save`) saving again that way while the loop goes on;
- `stop`: trains K steps, saves, and ends (the save a launch at another world size resumes from);
- `resume`: loads the save and trains steps K.. ;
- `restart`: as `uninterrupted`, and an attempt its launcher restarted (TORCHELASTIC_RESTART_COUNT > 0) loads the
  save and trains from K, as a job restarted after a failure does.
The save goes to DIRECTORY/state; rank 0 writes DIRECTORY/progress.json beside it: the step, the losses and the
step-0 norms of the steps before it, and each rank's save figures, which the resumed launch's row carries on. A
rank about to be killed by a planted fault (harness.rank.faults) first writes DIRECTORY/killed.json, the clock the
recovery time starts from.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from harness.rank.checkpoint import SavedFiles, checkpoint_method, files_by_rank
from harness.strategies.base import Trainer

RUN_ENV = "PARBENCH_CHECKPOINT_RUN"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
UNINTERRUPTED, STOP, RESUME, RESTART = ROLES = ("uninterrupted", "stop", "resume", "restart")
STATE_FOLDER, ASYNC_FOLDER, PROGRESS_FILE, KILLED_FILE = "state", "async", "progress.json", "killed.json"


def restart_count() -> int:
    """How many times the launcher has restarted this rank's group (torchrun's elastic agent sets it)."""
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


@dataclass
class CheckpointedRun:
    """One launch's part in a checkpoint cell; every rank keeps one."""

    role: str
    at: int
    directory: Path
    method_name: str
    omit_optimizer: bool = False        # the planted `checkpoint-without-optimizer` bug
    first_step: int = 0
    restored: dict[str, Any] = field(default_factory=dict)   # progress.json of the save this launch started from
    figures: dict[str, Any] = field(default_factory=dict)    # this rank's: save_s, load_s, saved files
    recovered_at: float | None = None
    # What the checkpoint's expected size is derived from (harness.derive.resume): the components it holds, the
    # model's tensors and its tied parameters; set by the worker.
    facts: dict[str, Any] = field(default_factory=dict)
    _async: tuple[Any, float, dict[str, float]] | None = None    # an asynchronous save still being written
    # Horovod Elastic (harness.rank.horovod_elastic): what commits the state in memory beside the save, and how many
    # times the job went back to that commit after losing a rank.
    commit_in_memory: Callable[[int], None] | None = None
    restored_in_memory_times: int = 0

    @classmethod
    def from_environment(cls, method_name: str, omit_optimizer: bool) -> "CheckpointedRun | None":
        text = os.environ.get(RUN_ENV)
        if not text:
            return None
        given = json.loads(text)
        if given.get("role") not in ROLES:
            raise ValueError(f"{RUN_ENV}: role {given.get('role')!r} is not one of {', '.join(ROLES)}")
        if not method_name:
            raise ValueError(f"{RUN_ENV} is set, but this strategy names no checkpoint method")
        return cls(role=given["role"], at=int(given["at"]), directory=Path(given["directory"]),
                   method_name=method_name, omit_optimizer=omit_optimizer)

    @property
    def loads(self) -> bool:
        return self.role == RESUME or (self.role == RESTART and restart_count() > 0)

    def start(self, trainer: Trainer) -> int:
        """Load the save where this launch resumes (timed, every rank between two barriers); the first step to run."""
        if not self.loads:
            return 0
        self.restored = json.loads((self.directory / PROGRESS_FILE).read_text())
        method = checkpoint_method(self.method_name)
        self.figures["load_s"] = _timed(trainer, lambda: method.load(trainer, self.directory / STATE_FOLDER,
                                                                     optimizer=not self.omit_optimizer))
        self.first_step = int(self.restored["step"])
        return self.first_step

    @property
    def resumed(self) -> bool:
        """Did this launch go on from the save (loaded from disk, or Horovod Elastic's commit in memory)?"""
        return self.loads or self.restored_in_memory_times > 0

    def saves_before(self, step: int) -> bool:
        return step == self.at and not self.resumed

    def restored_in_memory(self, step: int) -> None:
        """Horovod Elastic went back to its commit before `step` after losing a rank: the steps before it are the
        save's record, their losses over every rank that ran them (this rank's own, all it holds, are one rank's)."""
        self.restored_in_memory_times += 1
        self.first_step = step
        self.restored = json.loads((self.directory / PROGRESS_FILE).read_text())

    def save(self, trainer: Trainer, losses: list[torch.Tensor], norms: dict[str, Any]) -> None:
        """Save the state after `at` steps (every rank), then rank 0 writes progress.json: the global losses so far,
        step 0's norms and every rank's save figures. The collectives here run between steps, outside any timed
        one (K is a warm-up step)."""
        method = checkpoint_method(self.method_name)
        state = self.directory / STATE_FOLDER
        if trainer.context.rank == 0:
            state.mkdir(parents=True, exist_ok=True)
        trainer.barrier()
        with SavedFiles() as saved:
            self.figures["save_s"] = _timed(trainer, lambda: method.save(trainer, state,
                                                                         optimizer=not self.omit_optimizer))
        global_losses = trainer.global_losses(torch.stack(losses).float()).tolist()
        saved_by_rank = trainer.gather(saved.paths)
        save_by_rank = trainer.gather(self.figures["save_s"])
        if trainer.context.rank == 0:
            progress = {"step": self.at, "loss_per_step": global_losses, "norms": norms, "method": method.name,
                        "world_size": trainer.context.world_size, "save_s_by_rank": save_by_rank,
                        **files_by_rank(method, state, saved_by_rank)}
            _write_json(self.directory / PROGRESS_FILE, progress)
        trainer.barrier()
        if self.commit_in_memory is not None:
            self.commit_in_memory(self.at)
        if self.role == UNINTERRUPTED:
            self._start_async_save(method, trainer)

    def _start_async_save(self, method, trainer: Trainer) -> None:
        """Where the library saves asynchronously (DCP's `async_save`), a second save of the same state that the
        loop goes on beside: the time it blocked the loop, and the time until its files were written."""
        trainer.barrier()
        started = time.perf_counter()
        pending = method.async_save(trainer, self.directory / ASYNC_FOLDER)
        if pending is None:
            return
        self.figures["async_blocked_s"] = time.perf_counter() - started
        finished: dict[str, float] = {}
        pending.add_done_callback(lambda _: finished.setdefault("at", time.perf_counter()))
        self._async = (pending, started, finished)

    def stops_after(self, step: int) -> bool:
        return self.role == STOP and step == self.at

    def mark_kill(self, rank: int, step: int) -> None:
        """Just before a planted kill: when and where, for the recovery time and the steps recomputed."""
        _write_json(self.directory / KILLED_FILE, {"rank": rank, "step": step, "time": time.time(),
                                                   "attempt": restart_count()})

    def after_step(self, step: int, device: torch.device) -> None:
        if self.role == RESTART and self.resumed and step == self.first_step and self.recovered_at is None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.recovered_at = time.time()

    def rank_figures(self) -> dict[str, Any]:
        """This rank's figures, once a save still being written has finished (after the timed steps)."""
        if self._async is not None:
            pending, started, finished = self._async
            pending.result()
            self.figures["async_write_s"] = finished.get("at", time.perf_counter()) - started
            self._async = None
        return {**self.figures, "recovered_at": self.recovered_at}

    def measurements(self, by_rank: list[dict[str, Any]]) -> dict[str, Any]:
        """The row's `checkpoint` record (rank 0, from every rank's `rank_figures`)."""
        progress = self.restored or _read_json(self.directory / PROGRESS_FILE) or {}
        record: dict[str, Any] = {"role": self.role, "step": self.at, "method": self.method_name, **self.facts,
                                  "saved_at_world_size": progress.get("world_size"),
                                  **{key: progress.get(key) for key in ("save_s_by_rank", "bytes_by_rank",
                                                                        "files_by_rank", "tensor_bytes_by_rank")}}
        if by_rank and by_rank[0].get("async_blocked_s") is not None:
            record["async_blocked_s_by_rank"] = [figures.get("async_blocked_s") for figures in by_rank]
            record["async_write_s_by_rank"] = [figures.get("async_write_s") for figures in by_rank]
        if self.resumed:
            record["load_s_by_rank"] = [figures.get("load_s") for figures in by_rank]
            record["resumed_from_step"] = self.first_step
            record["resumed_at_world_size"] = len(by_rank)     # fewer than the cell's where a node left
        if self.omit_optimizer:
            record["planted"] = "checkpoint-without-optimizer"
        killed = _read_json(self.directory / KILLED_FILE)
        if self.restored_in_memory_times:
            record["restored_from"] = "Horovod Elastic's commit in memory"
        if self.role == RESTART:
            record["restarts"] = restart_count() or self.restored_in_memory_times
            if killed:
                recovered = [figures.get("recovered_at") for figures in by_rank]
                record["killed_rank"], record["killed_at_step"] = killed["rank"], killed["step"]
                record["steps_recomputed"] = killed["step"] - self.first_step if self.resumed else None
                # From the kill to the first step after it completed on every rank (the slowest rank's).
                record["recovery_s"] = (max(recovered) - killed["time"]
                                        if self.resumed and None not in recovered else None)
        return record

    def restored_losses(self) -> list[float]:
        return list(self.restored.get("loss_per_step", [])) if self.resumed else []

    def restored_norms(self, world_size: int) -> dict[str, Any]:
        """Step 0's norms, read by the launch that saved, where it ran at this launch's world size; where it ran at
        another, parity's step-0 quantities are not this cell's and are left out, saying why."""
        if not self.loads:
            return {}
        saved_at = self.restored.get("world_size")
        if saved_at != world_size:
            return {"norms_unavailable_because": f"steps 0 to {self.first_step - 1} ran in the launch that saved at "
                                                 f"{saved_at} ranks, not at this cell's {world_size}"}
        return dict(self.restored.get("norms", {}))


def _timed(trainer: Trainer, action: Callable[[], None]) -> float:
    """Seconds `action` blocked this rank, started after every rank met (so no rank's time includes waiting for
    another's arrival) and read once the device has finished."""
    trainer.barrier()
    device = trainer.context.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    action()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
