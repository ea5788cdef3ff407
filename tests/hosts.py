"""Hosts made on this machine for multi-host tests: network namespaces joined by a veth pair, each with its
own address on an interface named `pbeth`, and (fixture `ssh_hosts`) an sshd in each, listening on that
address, so that `horovodrun -H` reaches the other host by ssh as it would on a cluster.

    from hosts import namespace_hosts, ssh_hosts   # in a test module; pytest finds fixtures by name

The namespaces share this machine's filesystem and PID space: the checkout and every cell folder are seen
by both hosts (as a cluster's shared home would be), and a process "on another host" is still visible here.

Nothing touches the real ~/.ssh. ssh reads ~/.ssh from the passwd entry, not from $HOME, so the client gets
all its settings from a config of its own through an `ssh` wrapper script: put `SshHosts.bin_dir` first on
PATH (horovodrun calls `ssh` by name, and the harness forwards PATH to every node). Both keys (the host's and
the user's) are made by ssh-keygen in the fixture's temporary folder, and sshd reads only its own config.

Every process of the hosts (sshd, and whatever a test left running in them) is killed and the namespaces are
deleted whatever happens; the fixtures skip, saying why, where root, iproute2 or openssh-server is missing.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil
import pytest

INTERFACE = "pbeth"
SSHD = Path("/usr/sbin/sshd")      # sshd re-executes itself for each connection, so it needs its full path
SSHD_START_S = 20.0


@dataclass(frozen=True)
class NamespaceHosts:
    """Hosts as namespaces `<prefix><node>`, each host's address, and the remote shell reaching them."""

    prefix: str
    addresses: tuple[str, ...]

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(f"{self.prefix}{node}" for node in range(len(self.addresses)))

    @property
    def remote_shell(self) -> str:
        """The harness's --remote-shell: `{node}` picks the namespace, the node's script is the last argument."""
        return f"ip netns exec {self.prefix}{{node}} sh -c"

    def hostfile(self, folder: Path, slots: int = 1) -> Path:
        path = folder / "hosts"
        path.write_text("".join(f"{address} slots={slots}\n" for address in self.addresses))
        return path

    def shell(self, node: int, script: str) -> list[str]:
        """argv running `script` with sh on the node-th host."""
        return ["ip", "netns", "exec", self.namespaces[node], "sh", "-c", script]

    def pids(self, node: int) -> set[int]:
        """Every process living in the node-th host's network namespace."""
        listed = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True)
        return {int(pid) for pid in listed.stdout.split()}


@dataclass(frozen=True)
class SshHosts:
    """Namespace hosts each running an sshd; `bin_dir` holds the `ssh` wrapper that reaches them."""

    hosts: NamespaceHosts
    bin_dir: Path
    sshd_pids: tuple[int, ...]          # the listening sshd of each host, in host order

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
        """`ssh <target's address> command`, run on the node-th host through the wrapper."""
        script = f"PATH={self.bin_dir}:$PATH exec ssh {self.hosts.addresses[target]} {command}"
        return subprocess.run(self.hosts.shell(node, script), capture_output=True, text=True, timeout=timeout)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _kill_everything_in(hosts: NamespaceHosts) -> None:
    """SIGKILL every process in the hosts' namespaces (theirs by construction: the names are fresh)."""
    for _ in range(3):                       # a dying parent may still fork; look again
        pids = set().union(*(hosts.pids(node) for node in range(len(hosts.namespaces))))
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        psutil.wait_procs([p for p in map(_process, pids) if p], timeout=10)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


@pytest.fixture
def namespace_hosts() -> Iterator[NamespaceHosts]:
    """Two network namespaces joined by a veth pair: hosts 10.77.<n>.1 and .2 on interface pbeth."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`; this machine forbids them")
    tag = uuid.uuid4().hex[:6]
    hosts = NamespaceHosts(prefix=f"pb{tag}h",
                           addresses=tuple(f"10.77.{int(tag, 16) % 250}.{node + 1}" for node in range(2)))
    created: list[str] = []
    try:
        try:
            for name in hosts.namespaces:
                _ip("netns", "add", name)
                created.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as error:
            pytest.skip(f"cannot create network namespaces here: {error.stderr.strip()}")
        # The veth ends are made in the first namespace, so none is ever left behind in this one.
        _ip("-n", hosts.namespaces[0], "link", "add", "pbA", "type", "veth", "peer", "name", "pbB",
            "netns", hosts.namespaces[1])
        for node, (name, end) in enumerate(zip(hosts.namespaces, ("pbA", "pbB"))):
            _ip("-n", name, "link", "set", end, "name", INTERFACE)
            _ip("-n", name, "addr", "add", f"{hosts.addresses[node]}/24", "dev", INTERFACE)
            _ip("-n", name, "link", "set", INTERFACE, "up")
            _own_hosts_file(name, hosts.addresses[node])
        yield hosts
    finally:
        _kill_everything_in(hosts)
        for name in created:                 # deleting a namespace deletes its veth end, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


# `ip netns exec NS` bind-mounts each file of /etc/netns/NS over /etc, for whatever it starts (sshd included).
# /etc/netns itself is left in place afterwards: other namespaces' files may be in it at the same time.
NETNS_ETC = Path("/etc/netns")


def _own_hosts_file(namespace: str, address: str) -> None:
    """This machine's host name resolves, inside the namespace, to the namespace's own address, as a
    cluster host's name resolves to its address. Horovod needs it: its process-set gloo contexts (the global
    set included) ignore HOROVOD_GLOO_IFACE and bind the address the host name resolves to (Horovod 0.28.1,
    horovod/common/gloo/gloo_context.cc, InitializeForProcessSet), which here is otherwise 127.0.0.1."""
    folder = NETNS_ETC / namespace
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")


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


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "parbench-test", "-f", str(path)],
                   check=True, capture_output=True, text=True)


def _wait_listening(log: Path, process: subprocess.Popen, deadline: float) -> None:
    while "Server listening on" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sshd did not start: {log.read_text(errors='replace').strip()[-500:]}")
        time.sleep(0.05)


@pytest.fixture
def ssh_hosts(namespace_hosts: NamespaceHosts, tmp_path_factory) -> Iterator[SshHosts]:
    """The namespace hosts, each with an sshd on its address (port 22) letting root in with a test key."""
    missing = [tool for tool in ("ssh", "ssh-keygen") if shutil.which(tool) is None]
    if not SSHD.exists():
        missing.append(str(SSHD))
    if missing:
        pytest.skip(f"openssh is not installed ({', '.join(missing)} missing; scripts/install-test-tools.sh "
                    "installs Debian's openssh-server)")
    folder = tmp_path_factory.mktemp("ssh")
    _keygen(folder / "host_key")
    _keygen(folder / "user_key")
    shutil.copy(folder / "user_key.pub", folder / "authorized_keys")
    # sshd's privilege-separation folder; left in place afterwards, as other sshds may use it.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (folder / "ssh_config").write_text(SSH_CONFIG.format(folder=folder))
    wrapper = bin_dir / "ssh"
    real_ssh = shutil.which("ssh")            # found before any test puts the wrapper first on PATH
    client_config = shlex.quote(str(folder / "ssh_config"))
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(str(real_ssh))} -F {client_config} \"$@\"\n")
    wrapper.chmod(0o755)

    processes: list[subprocess.Popen] = []
    try:
        for node, address in enumerate(namespace_hosts.addresses):
            config = folder / f"sshd{node}.conf"
            config.write_text(SSHD_CONFIG.format(address=address, folder=folder, node=node))
            log = folder / f"sshd{node}.log"
            with open(log, "wb") as out:     # -D: stays in the foreground, so it is ours to stop; -e: log there
                processes.append(subprocess.Popen(
                    ["ip", "netns", "exec", namespace_hosts.namespaces[node], str(SSHD), "-D", "-e",
                     "-f", str(config)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            _wait_listening(log, processes[-1], time.monotonic() + SSHD_START_S)
        hosts = SshHosts(hosts=namespace_hosts, bin_dir=bin_dir, sshd_pids=tuple(p.pid for p in processes))
        for node, target in ((0, 1), (1, 0)):
            reached = hosts.ssh(node, target, "hostname")
            assert reached.returncode == 0, f"ssh from host {node} to host {target}: {reached.stderr.strip()}"
        yield hosts
    finally:
        for process in processes:           # the namespaces' own clean-up then takes any session left
            process.kill()
            process.wait()
