"""One launch of a cell before anything runs: what the ranks run, the environment the harness gives them,
and the plan a placement makes of it (the commands started here, their clean-up, the files they read).

`plan_launch` is pure: `run_cell` (harness.launch.cell) writes the plan's files and starts its commands;
`describe_plan` (harness.launch.dry_run) prints them instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from harness.launch.launcher import Launcher, get_launcher
from harness.rank.worker import THREADS_ENV
from harness.spec import RunSpec
from harness.strategies import get_strategy, resolved_options

if TYPE_CHECKING:
    from harness.launch.placement import Placement

CELL_TOKEN_ENV = "PARBENCH_CELL_TOKEN"   # every process of a launch carries it: the local sweep finds them by it
SPEC_FILE = "spec.json"

# Environment a node's ranks need from the harness's own (DeepSpeed's launcher forwards the same families,
# deepspeed/launcher/constants.py EXPORT_ENVS): interface and library settings, threads, our own knobs.
FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "CUDA_", "HOROVOD_", "OMP_", "PARBENCH_", "PYTHON", "DS_",
                      "LD_LIBRARY_PATH", "PATH")


class LaunchError(RuntimeError):
    """A launch could not be prepared where it runs (no port could be chosen on its first host); the cell's
    row says why."""


@dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    """What a placement is asked to start."""

    spec: RunSpec
    launcher: Launcher
    cell_dir: Path
    port: str                          # the rendezvous port (or how the node's shell finds it); "" if unused
    timeout_s: float
    environment: Mapping[str, str]     # what the harness adds to the environment of every process
    options: Mapping[str, object]      # the strategy's options with its defaults

    @property
    def program(self) -> tuple[str, ...]:
        return worker_program(self.cell_dir)


@dataclass(frozen=True)
class LaunchPlan:
    """What the harness does for one launch: the files it writes, the commands it starts here (each in a
    session of its own: a node's launcher, the remote shell reaching it, or sbatch), and the commands that
    clean up after it wherever its processes ran."""

    commands: tuple[tuple[str, ...], ...]
    targets: tuple[str, ...]                          # where each command's ranks run, e.g. "node 1 (host-b)"
    cleanup: tuple[tuple[str, ...], ...] = ()
    cleanup_targets: tuple[str, ...] = ()
    files: tuple[tuple[Path, str], ...] = ()          # (path, text), written before the commands start

    def __post_init__(self) -> None:
        if len(self.targets) != len(self.commands) or len(self.cleanup_targets) != len(self.cleanup):
            raise ValueError(f"a launch plan names where each command runs: {len(self.commands)} commands, "
                             f"{len(self.targets)} targets, {len(self.cleanup)} clean-up commands, "
                             f"{len(self.cleanup_targets)} clean-up targets")


def worker_program(cell_dir: Path, spec_file: Path | None = None) -> tuple[str, ...]:
    """The rank's program after the interpreter: `-m harness.rank.worker` and its arguments. The spec is read
    from the cell folder unless `spec_file` names another copy (a Kubernetes pod's, mounted from its manifest)."""
    spec = cell_dir / SPEC_FILE if spec_file is None else spec_file
    return ("-m", "harness.rank.worker", "--spec", str(spec), "--out", str(cell_dir))


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


def launch_environment(spec: RunSpec, token: str) -> dict[str, str]:
    """What the harness adds to the environment of every process of one launch."""
    threads = str(threads_per_rank(spec))
    return {CELL_TOKEN_ENV: token, THREADS_ENV: threads, "OMP_NUM_THREADS": threads,
            "PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def forwarded_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """What a launcher on another host gets: the harness's settings for the launch and the families above."""
    own = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    return {**own, **extra}


def launcher_of(spec: RunSpec) -> Launcher:
    """The launcher the cell's strategy names."""
    return get_launcher(get_strategy(spec.strategy).launcher)


def plan_launch(spec: RunSpec, placement: Placement, *, cell_dir: Path, port: str,
                environment: Mapping[str, str], timeout_s: float) -> LaunchPlan:
    """The plan of one launch of a placed cell (`placement.place(spec)`) with the environment the harness
    adds (`launch_environment`), writing and starting nothing."""
    request = LaunchRequest(spec=spec, launcher=launcher_of(spec), cell_dir=cell_dir, port=port,
                            timeout_s=timeout_s, environment=environment, options=resolved_options(spec))
    return placement.plan(request)
