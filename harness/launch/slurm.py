"""Cells submitted through Slurm: one batch job per launch, waited for with `sbatch --wait`.

    python -m harness run --matrix full --slurm --nnodes 2 --slurm-args "--partition gpu --account proj"

The job script starts the strategy's own launcher the way Slurm users start it: one torchrun per node by
`srun` (c10d rendezvous on the job's first node), `horovodrun -H` over the job's nodes from the batch
host, or `srun` of the single process. Jobs ask for whole nodes (`--exclusive`: a benchmark sharing a
node measures its neighbours) and a time limit just over the cell's timeout; the harness cancels a job
that outlives it. The job's output goes to `log-slurm.txt` in the cell folder.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Mapping

from harness.spec import DeviceKind, RunSpec

JOB_LOG = "log-slurm.txt"
JOB_SCRIPT = "job.sh"
FIRST_NODE = 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'


def job_name(token: str) -> str:
    return f"parbench-{token[:16]}"


def sbatch_command(spec: RunSpec, cell_dir: Path, token: str, timeout_s: float, extra: tuple[str, ...],
                   threads_per_rank: int) -> list[str]:
    """sbatch's argv for one launch of `spec`; the job script must already be in the cell folder."""
    resources = [f"--nodes={spec.nnodes}", "--ntasks-per-node=1",
                 f"--cpus-per-task={spec.ranks_per_node * threads_per_rank}"]
    if spec.device is DeviceKind.CUDA:
        resources.append(f"--gpus-per-node={spec.ranks_per_node}")
    minutes = math.ceil(timeout_s / 60) + 1
    return ["sbatch", "--wait", "--exclusive", f"--job-name={job_name(token)}", f"--time={minutes}",
            f"--output={cell_dir / JOB_LOG}", f"--chdir={Path.cwd()}", *resources, *extra,
            str(cell_dir / JOB_SCRIPT)]


def job_script(spec: RunSpec, launcher_command: list[str], environment: Mapping[str, str],
               per_node: bool) -> str:
    """The batch script: `launcher_command` once per node through srun (`per_node`), else once on the
    batch host. The literal `$head` in the command is the job's first node."""
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(environment.items()))
    command = " ".join(_keep_head(arg) for arg in launcher_command)
    if per_node:
        command = f"srun --nodes={spec.nnodes} --ntasks-per-node=1 --kill-on-bad-exit=1 {command}"
    return (f"#!/bin/bash\n# parbench cell {spec.label}\nset -eu\n{exports}\n{FIRST_NODE}\n"
            f'hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/:{spec.ranks_per_node}/" '
            f"| paste -sd, -)\nexec {command}\n")


def _keep_head(argument: str) -> str:
    """Quote an argument but let `$head` and `$hosts` expand in the job's shell."""
    quoted = shlex.quote(argument)
    for name in ("head", "hosts"):
        quoted = quoted.replace(f"${name}", f"'\"${name}\"'")
    return quoted


def cancel_command(token: str) -> list[str]:
    """Cancels the launch's job if it is still queued or running (timeout, Ctrl-C)."""
    return ["scancel", f"--name={job_name(token)}"]
