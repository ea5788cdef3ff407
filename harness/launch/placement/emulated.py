"""The nodes of an emulated cluster on this machine (harness.emulate): a hostfile placement whose hosts are
network namespaces, reached through `ip netns exec`.

    python -m harness run --matrix full --workload gpt-tiny --world-sizes 1,2,4 --emulate-link 100mbit

Unlike a real cluster's hostfile, a multi-rank cell spreads over every node rather than packing onto the
fewest: the emulation exists to put the shaped link between ranks, so ranks of world size 2 sit on two nodes
and those of world size 4 two by two. A cell that no node count divides, and world size 1, runs on node 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.emulate.network import EmulatedNetwork
from harness.launch.placement.base import Host
from harness.launch.placement.hostfile import HostfilePlacement
from harness.launch.plan import launcher_of
from harness.spec import RunSpec


@dataclass(frozen=True)
class EmulatedPlacement(HostfilePlacement):
    name = "emulated"
    network: EmulatedNetwork | None = None

    @classmethod
    def of(cls, network: EmulatedNetwork) -> "EmulatedPlacement":
        return cls(hosts=tuple(Host(address, None) for address in network.addresses),
                   remote_shell=network.remote_shell, nnodes=network.nodes, network=network)

    def describe(self) -> str:
        return self.network.describe() if self.network else super().describe()

    def recorded(self) -> dict[str, Any]:
        return {**super().recorded(), **({"emulated_network": self.network.record()} if self.network else {})}

    def ranks_sharing_a_machine(self, spec: RunSpec) -> int:
        # Every node is a namespace of this one machine: all the cell's ranks share its cores.
        return spec.world_size

    def nodes_for(self, spec: RunSpec, ranks_per_node: int | None) -> int:
        if not launcher_of(spec).spans_nodes or self.network is None:
            return 1
        return self.network.nodes_for(spec.world_size)
