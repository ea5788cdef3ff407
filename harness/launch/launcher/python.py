"""The plain interpreter: one process, for strategies whose cell is a single process (the plain loop, and
DataParallel, which drives every visible GPU from one process). Such a cell never spans nodes."""

from __future__ import annotations

import sys

from harness.launch.launcher.base import Launcher, Node, Nodes


class Python(Launcher):
    name = "python"
    spans_nodes = False
    uses_port = False

    def argv(self, nodes: Nodes, node: Node) -> list[str]:
        return [sys.executable, *nodes.program]
