"""The hosts of a hostfile, each reached through a remote shell.

    python -m harness run --matrix full --hostfile hosts --nnodes 2
    python -m harness run --matrix full --hostfile hosts --remote-shell "ssh -p 2222 {host}"

A hostfile is DeepSpeed's (and MPI's) format, one host per line with its slots (ranks it may run):

    node-a slots=8
    node-b slots=8

Every command runs on its host through the remote shell, `ssh -o BatchMode=yes {host}` unless
`--remote-shell` names another (`{host}` and `{node}`, the node's index, are filled in; the command is its
last argument), in this checkout's path and with the harness's environment (FORWARDED_PREFIXES): each
node's launcher, or, for a launcher that reaches the hosts itself (horovodrun), its one command on the first
host, so that its driver and every host it reaches are where the ranks run. The rendezvous port is probed on
the first host through the same shell. Afterwards every host of the cell is swept through it: whatever
still names the cell's spec file (launchers and ranks alike) is killed. The checkout and the results
folder must be on a filesystem every host sees, as on a cluster's shared home: ranks read the cell's spec
and write their reports there.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from harness.launch.launcher import Node, Nodes
from harness.launch.placement.base import HOSTFILE, PORT_PROBE, Host, Placement, hostfile_text
from harness.launch.plan import SPEC_FILE, LaunchError, LaunchPlan, LaunchRequest, forwarded_environment
from harness.spec import RunSpec, SpecError

DEFAULT_REMOTE_SHELL = "ssh -o BatchMode=yes {host}"
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class HostfilePlacement(Placement):
    name = "hostfile"
    hosts: tuple[Host, ...]
    remote_shell: str = DEFAULT_REMOTE_SHELL
    nnodes: int = 1
    placeholder: bool = False      # hosts made up for a dry run that named no hostfile

    def describe(self) -> str:
        names = ", ".join(host.name for host in self.hosts)
        where = (f"{len(self.hosts)} placeholder hosts ({names}): no --hostfile or --slurm was given, so the "
                 "plan stands a hostfile's hosts in for the nodes" if self.placeholder
                 else f"{len(self.hosts)} hosts of a hostfile ({names})")
        return f"{where}; commands reach them through {self.remote_shell!r}"

    def node_capacity(self, devices_per_node: int | None) -> int | None:
        """The hostfile's slots where it gives them (the fewest of its hosts'), else the machine's devices."""
        slots = [host.slots for host in self.hosts if host.slots is not None]
        return min(slots) if slots else devices_per_node

    def place(self, spec: RunSpec, devices_per_node: int | None = None) -> RunSpec:
        placed = super().place(spec, devices_per_node)
        for host in self.hosts[: placed.nnodes]:
            if host.slots is not None and placed.ranks_per_node > host.slots:
                raise SpecError(f"cell {spec.label} needs {placed.ranks_per_node} ranks on host {host.name}, "
                                f"which has slots={host.slots} in the hostfile")
        return placed

    def rendezvous_port(self, spec: RunSpec) -> str:
        """A port free on the first host, which serves the rendezvous: probed there, through the remote shell."""
        host = self.hosts[0].name
        probe = self.remote_command(0, f"{shlex.quote(sys.executable)} -c {shlex.quote(PORT_PROBE)}")
        try:
            ran = subprocess.run(probe, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise LaunchError(f"could not choose a rendezvous port on {host} ({shlex.join(probe)}): {error}") from None
        answer = ran.stdout.split()
        if ran.returncode != 0 or not answer or not answer[-1].isdigit():
            said = " | ".join(ran.stderr.strip().splitlines()[-2:]) or ran.stdout.strip()
            raise LaunchError(f"could not choose a rendezvous port on {host}: {shlex.join(probe)} exited "
                              f"{ran.returncode}: {said[-300:]}")
        return answer[-1]

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        spec, launcher = request.spec, request.launcher
        hosts = self.hosts[: spec.nnodes]
        hostfile = request.cell_dir / HOSTFILE
        nodes = Nodes(spec=spec, program=request.program, first_host=hosts[0].name, port=request.port,
                      host_slots=",".join(f"{host.name}:{spec.ranks_per_node}" for host in hosts),
                      hostfile=str(hostfile), timeout_s=request.timeout_s, options=request.options)
        environment = forwarded_environment(request.environment)
        started = range(1) if launcher.reaches_nodes else range(len(hosts))
        commands = tuple(tuple(self.remote_command(node, node_script(
            launcher.argv(nodes, Node(str(node), hosts[node].name, node == 0)), environment))) for node in started)
        targets = tuple(f"node {node} ({hosts[node].name})" for node in started)
        if launcher.reaches_nodes and len(hosts) > 1:
            targets = (f"{targets[0]}, reaching {', '.join(host.name for host in hosts[1:])} itself",)
        # Every host of the cell, whoever started its processes (a launcher that reaches the hosts itself too).
        cleanup = tuple(tuple(self.remote_command(node, cleanup_script(request.cell_dir / SPEC_FILE)))
                        for node in range(len(hosts)))
        files = ((hostfile, hostfile_text([host.name for host in hosts], spec.ranks_per_node)),) \
            if launcher.uses_hostfile else ()
        return LaunchPlan(commands=commands, targets=targets, cleanup=cleanup,
                          cleanup_targets=tuple(f"node {node} ({host.name})" for node, host in enumerate(hosts)),
                          files=files)

    def remote_command(self, node: int, script: str) -> list[str]:
        """The remote shell's argv that runs `script` on the node-th host."""
        return [*shell_words(self.remote_shell.format(host=self.hosts[node].name, node=node)), script]


@functools.lru_cache(maxsize=1024)
def shell_words(command: str) -> tuple[str, ...]:
    """shlex.split, once a command: a dry run asks for each node's remote shell thousands of times."""
    return tuple(shlex.split(command))


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


def check_remote_shell(shell: str) -> None:
    """SpecError unless `shell` is a command template with only {host} and {node} fields."""
    try:
        shlex.split(shell.format(host="h", node=0))
    except (KeyError, IndexError, ValueError) as error:
        raise SpecError(f"--remote-shell {shell!r} is not a command with only {{host}} and {{node}} "
                        f"fields ({error})") from None


def node_script(command: list[str], environment: Mapping[str, str]) -> str:
    """A shell line that runs `command` in this checkout with `environment` on whichever host runs it."""
    assignments = [f"{k}={v}" for k, v in sorted(environment.items())]
    return f"cd {shlex.quote(os.getcwd())} && exec env {shlex.join(assignments + command)}"


def cleanup_script(spec_path: Path) -> str:
    """Kills what is left of a cell on a host: its launchers and ranks all name the cell's spec file. The
    pattern's `[.]` keeps it from matching the shell that runs it."""
    pattern = "harness[.]rank[.]worker --spec " + re.escape(str(spec_path))
    return f"pkill -KILL -f {shlex.quote(pattern)} || true"
