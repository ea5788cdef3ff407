"""Where a cell's ranks run: this host, the hosts of a hostfile, or the nodes of a Slurm allocation.

    python -m harness run --matrix full --hostfile hosts --nnodes 2
    python -m harness run --matrix full --slurm --nnodes 2 --slurm-args "--partition gpu"

A hostfile is DeepSpeed's (and MPI's) format, one host per line with its slots (ranks it may run):

    node-a slots=8
    node-b slots=8

The harness starts each node's launcher (torchrun, or DeepSpeed's own launcher given the hostfile) through a
remote shell, `ssh -o BatchMode=yes {host}` unless `--remote-shell` names another (`{host}` and `{node}`, the
node's index, are filled in; the node's script is its last argument). Horovod's `horovodrun -H` reaches
the hosts itself. The checkout and the results folder must be on a filesystem every host sees, as on a
cluster's shared home: ranks read the cell's spec and write their reports there.

A cell of world size W over N hosts puts W/N ranks on each when N divides W; a smaller cell (the
single-process references, world size 1) runs on the first host alone.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from harness.spec import RunSpec, SpecError

DEFAULT_REMOTE_SHELL = "ssh -o BatchMode=yes {host}"

# Environment a node's ranks need from the harness's own (DeepSpeed's launcher forwards the same families,
# deepspeed/launcher/constants.py EXPORT_ENVS): interface and library settings, threads, our own knobs.
FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "CUDA_", "HOROVOD_", "OMP_", "PARBENCH_", "PYTHON", "DS_",
                      "LD_LIBRARY_PATH", "PATH")


@dataclass(frozen=True)
class Host:
    name: str        # how the other hosts and the remote shell reach it
    slots: int       # ranks it may run


@dataclass(frozen=True)
class Placement:
    """The hosts cells may use (none: this host only), how to reach them, or Slurm."""

    hosts: tuple[Host, ...] = ()
    remote_shell: str = DEFAULT_REMOTE_SHELL
    slurm: bool = False
    slurm_args: tuple[str, ...] = ()
    nnodes: int = 1                  # nodes a multi-rank cell spreads over

    @property
    def multi_host(self) -> bool:
        return bool(self.hosts)

    def nodes_for(self, spec: RunSpec) -> int:
        """Nodes a cell spreads over: all of them when they divide its ranks evenly, else one."""
        from harness.strategies import Launcher, get_strategy

        if get_strategy(spec.strategy).launcher is Launcher.SINGLE_PROCESS:
            return 1
        if self.nnodes > 1 and spec.world_size >= self.nnodes and spec.world_size % self.nnodes == 0:
            return self.nnodes
        return 1

    def place(self, spec: RunSpec) -> RunSpec:
        """The spec with its node count; raises SpecError where a host has too few slots."""
        placed = spec.replace(nnodes=self.nodes_for(spec))
        for host in self.hosts[: placed.nnodes]:
            if placed.ranks_per_node > host.slots:
                raise SpecError(f"cell {spec.label} needs {placed.ranks_per_node} ranks on host {host.name}, "
                                f"which has slots={host.slots} in the hostfile")
        return placed

    def hosts_for(self, spec: RunSpec) -> tuple[Host, ...]:
        return self.hosts[: spec.nnodes]


def read_hostfile(path: Path) -> tuple[Host, ...]:
    """Hosts of a DeepSpeed/MPI hostfile (`name slots=N` per line, # comments); SpecError names the line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise SpecError(f"cannot read hostfile {path}: {error.strerror}") from None
    hosts: list[Host] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if not match or int(match.group(2)) < 1:
            raise SpecError(f"hostfile {path}:{number}: expected 'HOST slots=N' with N >= 1, got {raw.strip()!r}")
        if any(h.name == match.group(1) for h in hosts):
            raise SpecError(f"hostfile {path}:{number}: host {match.group(1)} is listed twice")
        hosts.append(Host(match.group(1), int(match.group(2))))
    if not hosts:
        raise SpecError(f"hostfile {path} lists no hosts; expected lines 'HOST slots=N'")
    return tuple(hosts)


def make_placement(hostfile: Path | None, nnodes: int | None, remote_shell: str | None, slurm: bool,
                   slurm_args: str | None) -> Placement:
    """The placement a `run` asks for, checked before anything launches."""
    if hostfile and slurm:
        raise SpecError("--hostfile and --slurm exclude each other: Slurm chooses the hosts")
    if (remote_shell or slurm_args) and not (hostfile or slurm):
        raise SpecError("--remote-shell needs --hostfile, and --slurm-args needs --slurm")
    if nnodes is not None and nnodes < 1:
        raise SpecError(f"--nnodes must be >= 1, got {nnodes}")
    if hostfile:
        hosts = read_hostfile(hostfile)
        wanted = nnodes or len(hosts)
        if wanted > len(hosts):
            raise SpecError(f"--nnodes {wanted} but hostfile {hostfile} lists {len(hosts)} host(s)")
        shell = remote_shell or DEFAULT_REMOTE_SHELL
        try:
            shlex.split(shell.format(host="h", node=0))
        except (KeyError, IndexError, ValueError) as error:
            raise SpecError(f"--remote-shell {shell!r} is not a command with only {{host}} and {{node}} "
                            f"fields ({error})") from None
        return Placement(hosts=hosts[:wanted], remote_shell=shell, nnodes=wanted)
    if slurm:
        try:
            extra = tuple(shlex.split(slurm_args or ""))
        except ValueError as error:
            raise SpecError(f"--slurm-args cannot be split into arguments: {error}") from None
        return Placement(slurm=True, slurm_args=extra, nnodes=nnodes or 1)
    if nnodes and nnodes > 1:
        raise SpecError(f"--nnodes {nnodes} needs --hostfile FILE or --slurm to say where the nodes are")
    return Placement()


def forwarded_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """What a node's launcher gets: the harness's settings for the cell and the families above."""
    own = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    return {**own, **extra}


def node_script(command: list[str], environment: Mapping[str, str]) -> str:
    """A shell line that runs `command` in this checkout with `environment` on whichever host runs it."""
    assignments = [f"{k}={v}" for k, v in sorted(environment.items())]
    return f"cd {shlex.quote(os.getcwd())} && exec env {shlex.join(assignments + command)}"


def remote_command(placement: Placement, node: int, script: str) -> list[str]:
    """The remote shell's argv that runs `script` on the node-th host."""
    host = placement.hosts[node]
    return [*shlex.split(placement.remote_shell.format(host=host.name, node=node)), script]


def cleanup_script(spec_path: Path) -> str:
    """Kills what is left of a cell on a host: its launchers and ranks all name the cell's spec file."""
    pattern = "harness[.]rank[.]worker --spec " + re.escape(str(spec_path))
    return f"pkill -KILL -f {shlex.quote(pattern)} || true"
