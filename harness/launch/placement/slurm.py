"""Slurm: one batch job per launch, submitted with `sbatch --wait`, cancelled with `scancel` (the clean-up).

    python -m harness run --matrix full --slurm --nnodes 2 --slurm-args "--partition gpu --account proj"

The job script (`job.sh` in the cell folder) runs on the job's first node. It finds the job's nodes
(`scontrol show hostnames`), chooses the rendezvous port there, on the node that serves it, writes
DeepSpeed's hostfile of the job's nodes where the launcher reads one, and starts the launcher as Slurm users
do: `srun` of one launcher per node through `bash -c`, so that each node's shell fills in its own
`$SLURM_NODEID`, or, for a launcher that reaches the nodes itself (horovodrun), the launcher once, here.
What the launcher's argv needs of the job is exported first: PARBENCH_FIRST_NODE, PARBENCH_PORT and
PARBENCH_HOSTS (every node as host:ranks). Jobs ask for whole nodes (`--exclusive`: a benchmark sharing a
node measures its neighbours) and a time limit just over the launch's timeout. The job's output is
`log-slurm.txt` in the cell folder.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from harness.launch.launcher import Launcher, Node, Nodes
from harness.launch.placement.base import HOSTFILE, PORT_PROBE, Placement
from harness.launch.plan import CELL_TOKEN_ENV, LaunchPlan, LaunchRequest, forwarded_environment, threads_per_rank
from harness.spec import DeviceKind, RunSpec

JOB_LOG = "log-slurm.txt"
JOB_SCRIPT = "job.sh"
# Shell variables the job script sets (and a node's own, from Slurm); the only `$` expansions it lets through.
FIRST_NODE, PORT, HOSTS, NODE_ID = "PARBENCH_FIRST_NODE", "PARBENCH_PORT", "PARBENCH_HOSTS", "SLURM_NODEID"
JOB_VARIABLES = (FIRST_NODE, PORT, HOSTS, NODE_ID)


@dataclass(frozen=True)
class SlurmPlacement(Placement):
    name = "slurm"
    slurm_args: tuple[str, ...] = ()
    nnodes: int = 1

    def describe(self) -> str:
        extra = f" {shlex.join(self.slurm_args)}" if self.slurm_args else ""
        return f"Slurm: one batch job per launch (sbatch --wait{extra}), nodes as the job's"

    def rendezvous_port(self, spec: RunSpec) -> str:
        return f"${PORT}"    # chosen in the job script, on the job's first node

    def planned_port(self) -> str:
        return f"${PORT}"

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        spec, cell_dir = request.spec, request.cell_dir
        nodes = Nodes(spec=spec, program=request.program, first_host=f"${FIRST_NODE}", port=request.port,
                      host_slots=f"${HOSTS}", hostfile=str(cell_dir / HOSTFILE), timeout_s=request.timeout_s, options=request.options)
        command = request.launcher.argv(nodes, Node(f"${NODE_ID}"))
        script = job_script(spec, request.launcher, command, forwarded_environment(request.environment),
                            cell_dir / HOSTFILE)
        token = request.environment[CELL_TOKEN_ENV]
        submit = sbatch_command(spec, cell_dir, token, request.timeout_s, self.slurm_args, threads_per_rank(spec))
        return LaunchPlan(commands=(tuple(submit),), targets=(f"this host, submitting a job of {spec.nnodes} node(s)",),
                          cleanup=(tuple(cancel_command(token)),), cleanup_targets=("this host",),
                          files=((cell_dir / JOB_SCRIPT, script),))


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


def job_script(spec: RunSpec, launcher: Launcher, command: list[str], environment: Mapping[str, str],
               hostfile: Path) -> str:
    """The batch script of one launch: `command` (the launcher's argv, with JOB_VARIABLES in it) once per
    node through srun, or once here for a launcher that reaches the nodes itself."""
    k = spec.ranks_per_node
    lines = ["#!/bin/bash", f"# parbench cell {spec.label}: {launcher.name}, {spec.nnodes} node(s) x {k} rank(s)",
             "set -eu", *(f"export {name}={shlex.quote(value)}" for name, value in sorted(environment.items())),
             'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
             f'export {FIRST_NODE}=$(printf "%s\\n" "$nodes" | head -n 1)',
             f'export {HOSTS}=$(printf "%s\\n" "$nodes" | sed "s/$/:{k}/" | paste -sd, -)']
    if launcher.uses_port:   # this script runs on the job's first node, which serves the rendezvous
        lines.append(f"export {PORT}=$({shlex.quote(sys.executable)} -c {shlex.quote(PORT_PROBE)})")
    if launcher.uses_hostfile:
        lines.append(f'printf "%s\\n" "$nodes" | sed "s/$/ slots={k}/" > {shlex.quote(str(hostfile))}')
    words = shell_words(command)
    if launcher.reaches_nodes:
        lines.append(f"exec {words}")
    else:
        lines.append(f"exec srun --nodes={spec.nnodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
                     f"bash -c {shlex.quote(words)}")
    return "\n".join(lines) + "\n"


def shell_words(argv: Sequence[str], variables: Sequence[str] = JOB_VARIABLES) -> str:
    """`argv` quoted for a shell, letting only the job's `variables` expand, each as "$NAME"."""
    variable = re.compile("(" + "|".join(re.escape(f"${name}") for name in variables) + ")")
    return " ".join("".join(f'"{piece}"' if variable.fullmatch(piece) else shlex.quote(piece)
                            for piece in variable.split(argument) if piece) or "''" for argument in argv)


def cancel_command(token: str) -> list[str]:
    """Cancels the launch's job if it is still queued or running (timeout, Ctrl-C)."""
    return ["scancel", f"--name={job_name(token)}"]
