"""Hosts made on this machine for multi-host tests: the harness's emulated cluster (harness.emulate) with its
links left unshaped, two network namespaces each with its own address on an interface named `pbeth`, and
(fixture `ssh_hosts`) an sshd in each, listening on that address, so that `horovodrun -H` reaches the other
host by ssh as it would on a cluster.

    from hosts import namespace_hosts, ssh_hosts   # in a test module; pytest finds fixtures by name

The namespaces share this machine's filesystem and PID space: the checkout and every cell folder are seen
by both hosts (as a cluster's shared home would be), and a process "on another host" is still visible here.
Every process of the hosts (sshd, and whatever a test left running in them) is killed and the namespaces are
deleted whatever happens; the fixtures skip, saying why, where root, iproute2 or openssh-server is missing.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from harness.emulate.network import EmulatedNetwork, check_can_emulate, emulated_network
from harness.emulate.sshd import SshAccess, missing_openssh, ssh_access
from harness.spec import SpecError

NamespaceHosts = EmulatedNetwork
SshHosts = SshAccess


@pytest.fixture
def namespace_hosts() -> Iterator[EmulatedNetwork]:
    """Two network namespaces behind an unshaped switch: hosts 10.78.<n>.1 and .2 on interface pbeth."""
    try:
        check_can_emulate()
    except SpecError as error:
        pytest.skip(f"network namespaces are not possible here: {error}")
    try:
        with emulated_network(EmulatedNetwork.planned(None, nodes=2)) as hosts:
            yield hosts
    except SpecError as error:             # raised while building, before the yield
        pytest.skip(f"cannot create network namespaces here: {error}")


@pytest.fixture
def ssh_hosts(namespace_hosts: EmulatedNetwork, tmp_path_factory) -> Iterator[SshAccess]:
    """The namespace hosts, each with an sshd on its address (port 22) letting root in with a test key."""
    missing = missing_openssh()
    if missing:
        pytest.skip(f"openssh is not installed ({', '.join(missing)} missing; scripts/install-test-tools.sh "
                    "installs Debian's openssh-server)")
    with ssh_access(namespace_hosts, tmp_path_factory.mktemp("ssh")) as access:
        yield access
