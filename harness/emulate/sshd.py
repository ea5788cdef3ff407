"""An sshd on each node of an emulated cluster, so that a launcher that reaches hosts by ssh itself
(horovodrun) reaches the other nodes as it would on a cluster.

Nothing touches the real ~/.ssh. ssh reads ~/.ssh from the passwd entry, not from $HOME, so the client gets
all its settings from a config of its own through an `ssh` wrapper script in `SshAccess.bin_dir`: put it
first on PATH (horovodrun calls `ssh` by name, and the harness forwards PATH to every node). Both keys (the
hosts' and the user's) are made by ssh-keygen in a temporary folder, and sshd reads only its own config.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import psutil

from harness.launch.tether import tethered

SSHD = Path("/usr/sbin/sshd")      # sshd re-executes itself for each connection, so it needs its full path
SSHD_START_S = 20.0

SSHD_CONFIG = """\
ListenAddress {address}
Port 22
HostKey {folder}/host_key
AuthorizedKeysFile {folder}/authorized_keys
PidFile {folder}/sshd{node}.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
"""

# IdentitiesOnly: only our key, never an agent's. The known-hosts files are /dev/null: the host key is
# fresh each time, and nothing is written anywhere. With -F, ssh reads no other config and makes no ~/.ssh.
SSH_CONFIG = """\
Host *
    IdentityFile {folder}/user_key
    IdentitiesOnly yes
    UserKnownHostsFile /dev/null
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking no
    BatchMode yes
    LogLevel ERROR
"""


class Nodes(Protocol):
    """Network-namespace nodes: their addresses and a shell on each (EmulatedNetwork, a test's hosts)."""

    @property
    def addresses(self) -> tuple[str, ...]: ...

    @property
    def namespaces(self) -> tuple[str, ...]: ...

    def shell(self, node: int, script: str) -> list[str]: ...


@dataclass(frozen=True)
class SshAccess:
    """The nodes, each running an sshd; `bin_dir` holds the `ssh` wrapper that reaches them."""

    hosts: Nodes
    bin_dir: Path
    sshd_pids: tuple[int, ...]          # the listening sshd of each node, in node order

    def sessions(self) -> set[int]:
        """Processes sshd started for connections (one per ssh session, and whatever runs in it)."""
        found: set[int] = set()
        for pid in self.sshd_pids:
            try:
                found |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                continue
        return found

    def ssh(self, node: int, target: int, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """`ssh <target's address> command`, run on the node-th node through the wrapper."""
        script = f"PATH={self.bin_dir}:$PATH exec ssh {self.hosts.addresses[target]} {command}"
        return subprocess.run(self.hosts.shell(node, script), capture_output=True, text=True, timeout=timeout)


def missing_openssh() -> list[str]:
    """The openssh pieces this machine lacks (Debian's openssh-server brings them all)."""
    missing = [tool for tool in ("ssh", "ssh-keygen") if shutil.which(tool) is None]
    return missing + ([str(SSHD)] if not SSHD.exists() else [])


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "parbench", "-f", str(path)],
                   check=True, capture_output=True, text=True)


def _wait_listening(log: Path, process: subprocess.Popen, deadline: float) -> None:
    while "Server listening on" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sshd did not start: {log.read_text(errors='replace').strip()[-500:]}")
        time.sleep(0.05)


@contextmanager
def ssh_access(nodes: Nodes, folder: Path | None = None) -> Iterator[SshAccess]:
    """An sshd on every node (port 22 of its address) letting root in with a key made here, checked from
    each node to the next; every sshd is stopped afterwards. Raises RuntimeError where openssh is missing
    or an sshd does not start."""
    missing = missing_openssh()
    if missing:
        raise RuntimeError(f"openssh is not installed ({', '.join(missing)} missing; Debian's openssh-server "
                           "brings them)")
    with tempfile.TemporaryDirectory(prefix="parbench-ssh-", dir=folder) as made:
        yield from _serving(nodes, Path(made))


def _serving(nodes: Nodes, folder: Path) -> Iterator[SshAccess]:
    _keygen(folder / "host_key")
    _keygen(folder / "user_key")
    shutil.copy(folder / "user_key.pub", folder / "authorized_keys")
    # sshd's privilege-separation folder; left in place afterwards, as other sshds may use it.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (folder / "ssh_config").write_text(SSH_CONFIG.format(folder=folder))
    wrapper = bin_dir / "ssh"
    real_ssh = shutil.which("ssh")            # found before the wrapper is put first on PATH
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(str(real_ssh))} -F "
                       f"{shlex.quote(str(folder / 'ssh_config'))} \"$@\"\n")
    wrapper.chmod(0o755)
    processes: list[subprocess.Popen] = []
    try:
        for node, address in enumerate(nodes.addresses):
            config = folder / f"sshd{node}.conf"
            config.write_text(SSHD_CONFIG.format(address=address, folder=folder, node=node))
            log = folder / f"sshd{node}.log"
            # -D: stays in the foreground, so it is ours to stop; -e: log there. Tethered: a harness killed by SIGKILL
            # stops nothing, and sshd would listen on (`ip netns exec` becomes sshd, which keeps the tether's signal;
            # the ranks its sessions run end with the harness on their own, harness.rank.parent_death).
            with open(log, "wb") as out:
                processes.append(subprocess.Popen(tethered(
                    ["ip", "netns", "exec", nodes.namespaces[node], str(SSHD), "-D", "-e", "-f", str(config)],
                    group=False), stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            _wait_listening(log, processes[-1], time.monotonic() + SSHD_START_S)
        access = SshAccess(hosts=nodes, bin_dir=bin_dir, sshd_pids=tuple(p.pid for p in processes))
        _check_reachable(access, len(nodes.addresses))
        yield access
    finally:
        for process in processes:           # the namespaces' own clean-up then takes any session left
            process.kill()
            process.wait()


def _check_reachable(access: SshAccess, count: int) -> None:
    for node in range(count):
        target = (node + 1) % count
        reached = access.ssh(node, target, "hostname")
        if reached.returncode != 0:
            raise RuntimeError(f"ssh from node {node} to node {target} failed: {reached.stderr.strip()}")

