"""The row of a launch the harness did not start itself, recorded where it ran: in a Kubernetes pod, after
node 0's launcher exits (each manifest of `run --placement k8s` calls this; harness.launch.k8s_manifest), in
node 0's pod or, for an MPIJob, whose Launcher pod runs no rank, on its first Worker.

    python -m harness.launch.record_launch --cell /parbench/results/scaling-cells/<launch> --repeat 0 \\
        --exit-status 0 --wall-s 312 --timeout-s 900 --placement k8s -- torchrun --nnodes=4 ...

The outcome is read as `run_cell` reads it (harness.launch.cell.launch_outcome: rank 0's measurements, the
ranks' error reports, the launcher's logs in the cell folder), under the environment captured here, where the
ranks ran. The row goes to row.jsonl in the cell folder: a file per launch, so that launches running at once
on a shared volume never append to one file; `harness report` reads them together.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from harness.environment import capture_environment
from harness.launch.cell import launch_outcome
from harness.launch.plan import SPEC_FILE, launcher_of
from harness.record import AppendError, append_row
from harness.spec import RunResult, RunSpec, SpecError, Status

ROW_FILE = "row.jsonl"      # the launch's row, in its cell folder
# `timeout` exits 124 when it stopped the launcher, 137 (128 + SIGKILL) when it had to kill it.
TIMEOUT_STATUSES = (124, 137)


def launch_row(cell: Path, *, repeat: int, exit_status: int, wall_s: float, timeout_s: float, placement: str,
               command: Sequence[str]) -> RunResult:
    """The row of the launch whose folder is `cell` (its spec.json put there when it started)."""
    spec_path = cell / SPEC_FILE
    spec = RunSpec.from_dict(json.loads(spec_path.read_text()))
    started = datetime.fromtimestamp(spec_path.stat().st_mtime, timezone.utc)
    environment: dict[str, Any] = {**capture_environment(freeze_dir=cell.parent.parent), "placement": placement}
    common = {"spec": spec, "run_id": uuid.uuid4().hex, "repeat": repeat, "environment": environment,
              "started_at": started.isoformat(timespec="seconds"), "artifacts_dir": str(cell),
              "launch_command": list(command), "wall_time_s": round(wall_s, 3)}
    # 137 is also what a launcher killed by SIGKILL exits with: only a launch that ran its whole time timed out.
    if exit_status in TIMEOUT_STATUSES and wall_s >= timeout_s:
        return RunResult(status=Status.TIMEOUT, message=f"no result within {timeout_s:g} s; node 0's launcher was "
                         "stopped (each other node's by its own limit)", **common)
    # A pod's view of the kernel's OOM kills is the node's, not its own: a rank's own OOM report still counts.
    return launch_outcome(cell, exit_status, False, launcher_of(spec), common)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.launch.record_launch", description=__doc__.split("\n")[0])
    parser.add_argument("--cell", type=Path, required=True, help="the launch's cell folder")
    parser.add_argument("--repeat", type=int, required=True)
    parser.add_argument("--exit-status", type=int, required=True, help="node 0's launcher's exit status")
    parser.add_argument("--wall-s", type=float, required=True, help="seconds from launch to exit")
    parser.add_argument("--timeout-s", type=float, required=True, help="the launch's limit")
    parser.add_argument("--placement", required=True, help="where it ran, as rows record it")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher's argv, as run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        row = launch_row(args.cell, repeat=args.repeat, exit_status=args.exit_status, wall_s=args.wall_s,
                         timeout_s=args.timeout_s, placement=args.placement, command=command)
        append_row(args.cell / ROW_FILE, row)
    except (OSError, ValueError, KeyError, SpecError, AppendError) as error:
        print(f"parbench: error: no row for {args.cell}: {error}", file=sys.stderr)
        return 1
    print(f"parbench: {row.status.value} {row.spec.label} r{row.repeat} -> {args.cell / ROW_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
