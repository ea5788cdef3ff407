"""Re-run exactly the cell behind a recorded row and say what differs.

    python -m harness reproduce RUN_ID [--results results/full-....jsonl]

The row's spec (workload, strategy, world size, batches, precision, steps, seed, options) is launched
again, once, and the new row is appended to the file the original came from. Before launching, every
recorded environment fact that differs today (versions, pip freeze hash, git SHA, host, CPU/GPU) is
printed as a warning. After, the losses are compared with the original's: on CPU in fp32 they should be
identical bit for bit, since model init and data are pure functions of the seed.

A row measured on an emulated cluster (`run --emulate-link`) runs again on a fresh one of the same nodes
and link rate (root, as for `run`). A row that ran on several real hosts is refused in one line: the hosts
are not this machine's to reach, so its cell is run again with `run --hostfile` or `--slurm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from harness.emulate.network import EmulatedNetwork, rate_text
from harness.emulate.session import check_emulation
from harness.launch.placement import EmulatedPlacement, LocalPlacement, Placement
from harness.record import ResultsError, read_rows, read_results
from harness.spec import RunResult, SpecError

COMPARED_ENVIRONMENT = ("python", "torch", "cuda", "nccl", "deepspeed", "horovod", "pip_freeze_sha256",
                        "git_sha", "git_dirty", "host", "cpu_model", "cpu_count", "gpus", "gpu_driver", "env")


@dataclass(frozen=True)
class Found:
    result: RunResult
    path: Path


def find_row(run_id: str, paths: Iterable[Path]) -> Found:
    """The row whose run_id is (or starts with) `run_id`; ResultsError when none or several match."""
    paths = list(paths)
    matches = []
    for path in paths:
        for row in read_rows([path]):
            if str(row.get("run_id", "")).startswith(run_id):
                matches.append((row, path))
    if not matches:
        raise ResultsError(f"no row with run_id {run_id!r} in {', '.join(str(p) for p in paths) or 'no files'}")
    if len({row["run_id"] for row, _ in matches}) > 1:
        raise ResultsError(f"run_id prefix {run_id!r} matches {len(matches)} rows; give more characters")
    row, path = matches[0]
    result = next(r for r in read_results([path]) if r.run_id == row["run_id"])
    return Found(result=result, path=path)


def environment_differences(recorded: dict, today: dict) -> list[str]:
    """One line per environment fact that differs between the row and this machine now."""
    lines = []
    for key in COMPARED_ENVIRONMENT:
        if recorded.get(key) != today.get(key):
            lines.append(f"{key} was {recorded.get(key)!r}, now {today.get(key)!r}")
    return lines


def same_losses(original: RunResult, again: RunResult) -> bool:
    return original.measurements.get("loss_per_step") == again.measurements.get("loss_per_step")


def placement_for(original: RunResult) -> Placement:
    """Where the row's cell runs again: this machine, or a fresh emulated cluster like the one the row
    records (checked as `run --emulate-link` checks it); SpecError for a row from several real hosts."""
    network = original.environment.get("emulated_network")
    if network:
        rate = network.get("link_rate_bits_per_s")
        emulated = EmulatedNetwork.planned(rate_text(rate) if rate else None, int(network["nodes"]))
        check_emulation(emulated, [original.spec])
        return EmulatedPlacement.of(emulated)
    if original.spec.nnodes > 1:
        raise SpecError(f"run {original.run_id[:12]} ran on {original.spec.nnodes} hosts and reproduce runs cells on "
                        f"this machine only: run its cell again with `harness run --hostfile FILE` or `--slurm`")
    return LocalPlacement()
