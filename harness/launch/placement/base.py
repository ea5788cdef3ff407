"""What a placement is: where a cell's nodes are, how the harness starts a launcher's argv on each of them,
and how it cleans up there afterwards.

A placement decides a cell's node count (`place`), chooses the rendezvous port for the host that serves it
(`rendezvous_port`), and plans a launch (`plan`): from the launcher's argv for each node it makes the
commands started here, the clean-up commands and the files the launch reads. Whatever the placement, the
harness also kills every process here that carries the launch's marker (harness.launch.processes).
"""

from __future__ import annotations

import abc
import socket
from dataclasses import dataclass
from typing import Any, ClassVar

from harness.launch.plan import LaunchPlan, LaunchRequest, launcher_of
from harness.spec import RunSpec, SpecError

HOSTFILE = "hostfile"        # DeepSpeed's hostfile of a launch's nodes, in its cell folder
# Shown instead of a port that is chosen only when the launch runs.
PORT_AT_LAUNCH = "<port>"
# One line of Python that prints a TCP port nobody listens on, run where the rendezvous will be served.
PORT_PROBE = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'


@dataclass(frozen=True)
class Host:
    name: str                 # how the other hosts and the remote shell reach it
    slots: int | None         # ranks it may run; None for a placeholder host of a dry run (not checked)


class Placement(abc.ABC):
    """Where cells run. Subclasses are frozen dataclasses with an `nnodes` field: the nodes a multi-rank
    cell spreads over."""

    name: ClassVar[str]
    nnodes: int

    def nodes_for(self, spec: RunSpec, ranks_per_node: int | None) -> int:
        """The fewest nodes that hold a cell with the same ranks on each, given how many ranks a node takes
        (None: as many as the cell has). A cell a node holds stays on one node, so its ranks talk over the
        node's own links, as a user's job of that size would; larger ones spread over just enough nodes,
        so a scaling curve shows where traffic starts to cross nodes. A single-process launcher never
        spreads."""
        if not launcher_of(spec).spans_nodes or self.nnodes == 1:
            return 1
        fewest = -(-spec.world_size // ranks_per_node) if ranks_per_node else 1
        for nodes in range(fewest, self.nnodes + 1):
            if spec.world_size % nodes == 0:
                return nodes
        raise SpecError(f"cell {spec.label} has {spec.world_size} ranks, which no count of nodes from {fewest} "
                        f"to {self.nnodes} holds evenly at <= {ranks_per_node} per node")

    def node_capacity(self, devices_per_node: int | None) -> int | None:
        """Ranks one node takes: its devices (GPUs, or CPU cores), as the run describes the machine."""
        return devices_per_node

    def place(self, spec: RunSpec, devices_per_node: int | None = None) -> RunSpec:
        """The spec with its node count; raises SpecError where the placement cannot run it. A cell that loses a node
        on purpose (harness.strategies.state_checkpoint, `leave=S`) keeps the nodes it asks for."""
        from harness.strategies.state_checkpoint import plan_of     # lazily: the registry imports the launchers

        plan = plan_of(spec) if "checkpoint" in dict(spec.options) else None
        if plan is not None and plan.leave_step is not None:
            if self.nnodes < spec.nnodes:
                raise SpecError(f"cell {spec.label} loses one of its {spec.nnodes} nodes on purpose, and this placement "
                                f"has {self.nnodes}")
            return spec
        return spec.replace(nnodes=self.nodes_for(spec, self.node_capacity(devices_per_node)))

    def recorded(self) -> dict[str, Any]:
        """What every row of a run here records of where it ran (part of each cell's identity:
        harness.derive.identity)."""
        return {"placement": self.name}

    def ranks_sharing_a_machine(self, spec: RunSpec) -> int:
        """How many of a cell's ranks share one machine's cores: those of one node."""
        return spec.ranks_per_node

    @abc.abstractmethod
    def describe(self) -> str:
        """One line: where cells go."""

    @abc.abstractmethod
    def rendezvous_port(self, spec: RunSpec) -> str:
        """A port for the launch's rendezvous, free on the host that serves it; chosen now, just before the
        launch (raises LaunchError where it cannot be)."""

    def planned_port(self) -> str:
        """The port as a plan shows it before launch."""
        return PORT_AT_LAUNCH

    @abc.abstractmethod
    def plan(self, request: LaunchRequest) -> LaunchPlan:
        """The files, commands and clean-up of one launch (writing and starting nothing)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` of this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def hostfile_text(hosts: list[str], ranks_per_node: int) -> str:
    """DeepSpeed's (and MPI's) hostfile: one `host slots=ranks` line per node, in node order."""
    return "".join(f"{host} slots={ranks_per_node}\n" for host in hosts)
