"""An emulated cluster on this machine: each node a network namespace, all joined through a switch (a Linux
bridge in a namespace of its own), each node's link shaped to one rate by `tc`'s token bucket (tbf).

    switch namespace:  bridge pbbr --+-- pbp0 ==veth== pbeth (node 0: 10.78.T.1)
                                     +-- pbp1 ==veth== pbeth (node 1: 10.78.T.2)

Every node's link is shaped in both directions: its own end (`pbeth`, what the node sends) and the
switch's end (`pbpN`, what it receives), each qdisc shaping only its own egress. That is a non-blocking
switch with a NIC of RATE per node, as on a cluster: traffic between nodes crosses two shaped links at the
same rate, traffic between ranks of one node stays on its loopback, unshaped, as NVLink is next to the
network. netem's delay is not in this kernel, so only bandwidth is emulated; latency is the veth's own.

What it is not: the nodes share this machine's cores and memory (ranks on different "nodes" compete for
the same CPUs), and the switch has no congestion of its own. `describe()` says so, and rows record it.

The names carry a random tag, so two emulations (or a test's hosts) never meet; `emulated_network` builds
it and, whatever happens, kills every process left in its namespaces and deletes them, leaving nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import psutil

from harness.spec import SpecError

INTERFACE = "pbeth"         # each node's end of its link
BRIDGE = "pbbr"
# tbf's queue: how long a packet may wait for tokens before it is dropped (a shallow switch buffer).
TBF_LATENCY = "50ms"
# tbf's bucket: at least one full 64 KiB GSO packet (a smaller bucket makes tbf split each one), and at least
# the bytes the rate adds in 4 ms (a 250 Hz kernel's tick), so that the shaper is not what limits the rate.
MIN_BURST_BYTES = 64 * 1024
BURST_SECONDS = 0.004
# TCP's congestion control inside each node, whatever the host's default. A host defaulting to BBR (as these
# machines do) paces every connection by BBR's own estimate of the bottleneck, which tbf's bucket misleads:
# FSDP2 at 2 ranks, gpt-tiny, global batch 32, stepped in 678 ms at 100 Mbit/s under BBR, 447 ms under reno
# and 438 ms under cubic; 930, 818 and 818 ms at 50 Mbit/s (2026-11-24). Under reno the step's communication
# took the same 37 Mbit of link time at 50, 100 and 125 Mbit/s; under BBR 43, 60 and 55. A loss-based
# control is what a cluster's TCP runs by default (Linux's cubic), and at these microsecond round trips reno
# and cubic behave alike; reno is the one a namespace may always choose (the kernel lets a namespace pick
# only the controls in the host's net.ipv4.tcp_allowed_congestion_control, and reno is always among them).
CONGESTION_CONTROL = "reno"
# `ip netns exec NS` bind-mounts each file of /etc/netns/NS over /etc for whatever it starts.
NETNS_ETC = Path("/etc/netns")
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
RATE_FORMAT = "a number and kbit, mbit or gbit (tc's units, bits per second), e.g. 100mbit or 1gbit"


def parse_rate(text: str) -> float:
    """Bits per second of a tc rate such as 100mbit; SpecError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)\s*", text.lower())
    if not match or float(match.group(1)) <= 0:
        raise SpecError(f"--emulate-link {text!r} is not a link rate: expected {RATE_FORMAT}")
    return float(match.group(1)) * UNITS[match.group(2)]


def rate_text(bits_per_s: float) -> str:
    """tc's spelling of a rate, in whole kbit (tc rounds finer rates anyway)."""
    return f"{round(bits_per_s / 1e3)}kbit"


def burst_bytes(bits_per_s: float) -> int:
    return max(MIN_BURST_BYTES, int(bits_per_s / 8 * BURST_SECONDS))


def check_can_emulate() -> None:
    """SpecError unless this process may build namespaces and shape links (root, iproute2's ip and tc)."""
    if os.geteuid() != 0:
        raise SpecError("--emulate-link builds network namespaces and shapes links with tc: it needs root "
                        f"(this process runs as uid {os.geteuid()})")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise SpecError(f"--emulate-link needs iproute2's {' and '.join(missing)} on PATH; install iproute2")
    if shutil.which("sysctl") is None:
        raise SpecError("--emulate-link sets the nodes' TCP congestion control with sysctl: install procps")


@dataclass(frozen=True)
class EmulatedNetwork:
    """The plan of an emulated cluster: its nodes' namespaces and addresses, before anything is built."""

    nodes: int
    rate_bits_per_s: float | None       # None: links left unshaped (a test's hosts)
    tag: str

    @classmethod
    def planned(cls, rate: str | None, nodes: int = 2) -> "EmulatedNetwork":
        if nodes < 2:
            raise SpecError(f"--emulate-nodes must be >= 2 (an emulated link joins nodes), got {nodes}")
        if nodes > 250:
            raise SpecError(f"--emulate-nodes must be <= 250 (one /24 of addresses), got {nodes}")
        return cls(nodes=nodes, rate_bits_per_s=None if rate is None else parse_rate(rate),
                   tag=uuid.uuid4().hex[:6])

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(f"pb{self.tag}n{node}" for node in range(self.nodes))

    @property
    def switch(self) -> str:
        return f"pb{self.tag}sw"

    @property
    def addresses(self) -> tuple[str, ...]:
        subnet = int(self.tag, 16) % 250
        return tuple(f"10.78.{subnet}.{node + 1}" for node in range(self.nodes))

    @property
    def remote_shell(self) -> str:
        """A hostfile placement's remote shell: `{node}` picks the namespace, the script is the last argument."""
        return f"ip netns exec pb{self.tag}n{{node}} sh -c"

    def shell(self, node: int, script: str) -> list[str]:
        """argv running `script` with sh on the node-th node."""
        return ["ip", "netns", "exec", self.namespaces[node], "sh", "-c", script]

    def nodes_for(self, world_size: int) -> int:
        """Nodes a multi-rank job spreads over: the most that divide its ranks evenly, so that traffic
        crosses the shaped links at every world size >= 2 (1 for a single rank)."""
        return next(n for n in range(min(self.nodes, world_size), 0, -1) if world_size % n == 0)

    def hostfile(self, folder: Path, slots: int = 1) -> Path:
        """A hostfile of its nodes (`ADDRESS slots=N` lines) written in `folder`."""
        path = folder / "hosts"
        path.write_text("".join(f"{address} slots={slots}\n" for address in self.addresses))
        return path

    def describe(self) -> str:
        cores = os.cpu_count() or 1
        link = (f"each node's link shaped to {self.rate_bits_per_s / 1e6:g} Mbit/s each way by tc tbf"
                if self.rate_bits_per_s else "links unshaped")
        return (f"an emulated cluster: {self.nodes} nodes (network namespaces {', '.join(self.namespaces)}) behind "
                f"a switch, {link}; ranks of one node talk over its loopback. The nodes share this machine's "
                f"{cores} cores")

    def record(self) -> dict[str, Any]:
        """What a row keeps of it."""
        shaping = ({"shaper": "tc tbf", "shaped": "each node's link, both directions",
                    "tbf_burst_bytes": burst_bytes(self.rate_bits_per_s), "tbf_latency": TBF_LATENCY}
                   if self.rate_bits_per_s else {"shaper": None})
        return {"nodes": self.nodes, "link_rate_bits_per_s": self.rate_bits_per_s, **shaping,
                "tcp_congestion_control": CONGESTION_CONTROL, "addresses": list(self.addresses),
                "shared_machine_cores": os.cpu_count() or 1,
                "note": "emulated: the nodes are network namespaces of one machine and share its cores"}

    def pids(self, node: int | None = None) -> set[int]:
        """Every process living in the node-th node's namespace, or (None) in any of its namespaces."""
        found: set[int] = set()
        for name in (*self.namespaces, self.switch) if node is None else (self.namespaces[node],):
            listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            found |= {int(pid) for pid in listed.stdout.split()}
        return found

    def existing(self) -> list[str]:
        """Its namespaces that exist now."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        present = {line.split()[0] for line in listed.splitlines() if line.strip()}
        return [name for name in (*self.namespaces, self.switch) if name in present]


def _ip(*args: str) -> None:
    ran = subprocess.run(["ip", *args], capture_output=True, text=True)
    if ran.returncode:
        raise SpecError(f"cannot build the emulated cluster: `ip {' '.join(args)}` said: {ran.stderr.strip()}")


def _shape(namespace: str, device: str, bits_per_s: float) -> None:
    command = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate",
               rate_text(bits_per_s), "burst", str(burst_bytes(bits_per_s)), "latency", TBF_LATENCY]
    ran = subprocess.run(command, capture_output=True, text=True)
    if ran.returncode:
        raise SpecError(f"cannot shape the emulated link: `{' '.join(command)}` said: {ran.stderr.strip()}")


def _set_congestion_control(namespace: str) -> None:
    command = ["ip", "netns", "exec", namespace, "sysctl", "-qw",
               f"net.ipv4.tcp_congestion_control={CONGESTION_CONTROL}"]
    ran = subprocess.run(command, capture_output=True, text=True)
    if ran.returncode:
        raise SpecError(f"cannot set the emulated nodes' TCP congestion control: `{' '.join(command)}` said: "
                        f"{ran.stderr.strip()}")


def build(network: EmulatedNetwork) -> None:
    """Namespaces, switch, links, addresses, shaping and each node's own hosts file."""
    _ip("netns", "add", network.switch)
    _ip("-n", network.switch, "link", "add", BRIDGE, "type", "bridge")
    _ip("-n", network.switch, "link", "set", BRIDGE, "up")
    for node, (name, address) in enumerate(zip(network.namespaces, network.addresses)):
        port = f"pbp{node}"
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")
        _set_congestion_control(name)
        # Made in the switch's namespace, so no end is ever left in this one.
        _ip("-n", network.switch, "link", "add", port, "type", "veth", "peer", "name", INTERFACE, "netns", name)
        _ip("-n", network.switch, "link", "set", port, "master", BRIDGE)
        _ip("-n", network.switch, "link", "set", port, "up")
        _ip("-n", name, "addr", "add", f"{address}/24", "dev", INTERFACE)
        _ip("-n", name, "link", "set", INTERFACE, "up")
        if network.rate_bits_per_s:
            _shape(name, INTERFACE, network.rate_bits_per_s)
            _shape(network.switch, port, network.rate_bits_per_s)
        _own_hosts_file(name, address)


def _own_hosts_file(namespace: str, address: str) -> None:
    """This machine's host name resolves, inside the namespace, to the node's own address, as a cluster
    host's name resolves to its address. Horovod needs it: its gloo contexts ignore HOROVOD_GLOO_IFACE and
    bind the address the host name resolves to (Horovod 0.28.1, horovod/common/gloo/gloo_context.cc,
    InitializeForProcessSet), which here would otherwise be a loopback address."""
    folder = NETNS_ETC / namespace
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")


def kill_everything_in(network: EmulatedNetwork) -> None:
    """SIGKILL every process in its namespaces (theirs by construction: the names are fresh)."""
    for _ in range(3):                       # a dying parent may still fork; look again
        pids = network.pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        processes = []
        for pid in pids:
            try:
                processes.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(processes, timeout=10)


def tear_down(network: EmulatedNetwork) -> None:
    """Every process in it killed, every namespace deleted (a namespace takes its veth ends with it), and
    each node's /etc/netns folder removed."""
    kill_everything_in(network)
    for name in (*network.namespaces, network.switch):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


@contextmanager
def emulated_network(network: EmulatedNetwork) -> Iterator[EmulatedNetwork]:
    """Builds it, yields it, and tears it down whatever happens (an error while building included)."""
    check_can_emulate()
    try:
        build(network)
        yield network
    finally:
        tear_down(network)
