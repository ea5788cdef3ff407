"""A run's emulated cluster: checked when the run is planned, built around its launches, gone after.

`check_emulation` runs before anything launches (one-line SpecErrors); `emulating` builds the namespaces,
starts an sshd on each node where a launcher reaches hosts by ssh itself (horovodrun), puts the ssh
wrapper first on PATH (forwarded to every node) and yields what rows record of the network."""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Sequence

from harness.emulate.network import EmulatedNetwork, check_can_emulate, emulated_network
from harness.emulate.sshd import missing_openssh, ssh_access
from harness.launch.plan import launcher_of
from harness.spec import RunSpec, SpecError


def _needs_ssh(specs: Sequence[RunSpec]) -> list[RunSpec]:
    return [spec for spec in specs if launcher_of(spec).reaches_nodes and spec.nnodes > 1]


def check_emulation(network: EmulatedNetwork, specs: Sequence[RunSpec]) -> None:
    """SpecError where this machine cannot build the network or run the cells' launchers on it."""
    check_can_emulate()
    reaching = _needs_ssh(specs)
    missing = missing_openssh()
    if reaching and missing:
        raise SpecError(f"cell {reaching[0].label}'s launcher reaches the other nodes by ssh, and openssh is "
                        f"missing ({', '.join(missing)}): "
                        "install openssh-server (scripts/install-test-tools.sh) or leave it out with --strategy")


@contextmanager
def emulating(network: EmulatedNetwork, specs: Sequence[RunSpec]) -> Iterator[dict[str, Any]]:
    """The network built (and an sshd per node where `specs` need one) for the duration of the block."""
    with ExitStack() as stack:
        stack.enter_context(emulated_network(network))
        path = os.environ.get("PATH", "")
        if _needs_ssh(specs):
            access = stack.enter_context(ssh_access(network))
            os.environ["PATH"] = f"{access.bin_dir}:{path}"
            stack.callback(os.environ.__setitem__, "PATH", path)
        yield network.record()
