"""What a launcher is: the program that starts a cell's ranks on a node, as its users run it.

A launcher only builds argvs. It is told where the launch runs (`Nodes`: the first host and its rendezvous
port, every node as host:ranks, where DeepSpeed's hostfile lies) and which node it is building for
(`Node`); a placement (harness.launch.placement) decides those values and turns the argvs into processes.
Values a placement only learns when the launch runs, such as a Slurm job's nodes, arrive as shell
expressions (`$PARBENCH_FIRST_NODE`) that the node's shell expands, so a launcher never needs to know
which placement it runs under.
"""

from __future__ import annotations

import abc
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

from harness.spec import RunSpec


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """Where one launch of a cell runs, as its launcher needs to know it."""

    spec: RunSpec
    program: tuple[str, ...]   # what each rank runs after the interpreter: -m harness.rank.worker --spec ...
    first_host: str            # the address of node 0, which serves the rendezvous
    port: str                  # the rendezvous port on the first host
    host_slots: str            # every node as host:ranks, comma-separated (horovodrun -H)
    hostfile: str              # DeepSpeed's hostfile of these nodes, `host slots=ranks` (the placement writes it)
    timeout_s: float           # the launch's limit, for launchers with a collective timeout of their own
    options: Mapping[str, Any]  # the strategy's options with its defaults (horovodrun passes its own as flags)


@dataclass(frozen=True)
class Node:
    """The node one argv is for."""

    rank: str                                # its index among the cell's nodes, or a shell expression
    address: str | None = None               # how the other nodes reach it, where the placement knows it
    # Whether it is the first host, where the placement knows it: True or False, or a shell expression that
    # gives "true" or "false" on the node (one pod template for every node).
    serves_rendezvous: bool | str | None = None


class Launcher(abc.ABC):
    """Builds the argv that starts a cell's ranks on a node. One module each, keyed in LAUNCHERS
    (harness/launch/launcher/__init__.py); a strategy names its launcher by that key."""

    name: ClassVar[str]
    # False: the launcher starts one process that uses every device itself (a cell never spans nodes).
    spans_nodes: ClassVar[bool] = True
    # True: started once, on the first host, it starts the ranks of every node itself (horovodrun, over ssh);
    # else one argv per node.
    reaches_nodes: ClassVar[bool] = False
    uses_port: ClassVar[bool] = True          # needs a free rendezvous port on the first host
    uses_hostfile: ClassVar[bool] = False     # reads a hostfile of the cell's nodes (`Nodes.hostfile`)
    # What the launcher writes to its log when one of its ranks died of SIGKILL (its own exit status then
    # says only that it failed).
    sigkill_marks: ClassVar[tuple[str, ...]] = ()
    # True: it starts a failed group of ranks again by itself (torchrun --max-restarts), which a `checkpoint` cell's
    # kill (harness.strategies.state_checkpoint) asks of it.
    restarts: ClassVar[bool] = False

    @abc.abstractmethod
    def argv(self, nodes: Nodes, node: Node) -> list[str]:
        """The command that starts this node's ranks (for a launcher that `reaches_nodes`, every node's,
        run on node 0)."""


def executable(name: str, module: str) -> list[str]:
    """A launcher's console script beside this Python (the same installation the ranks use), else on
    PATH, else `python -m module`."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return [str(beside)]
    found = shutil.which(name)
    return [found] if found else [sys.executable, "-m", module]
