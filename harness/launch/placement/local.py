"""This host: the launcher's one argv is the launch's one process, started here.

    python -m harness run --matrix smoke

Its clean-up is the sweep every launch gets (harness.launch.processes): every process here that carries
the launch's marker is killed when the launcher exits, times out or is interrupted.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.launch.launcher import Node, Nodes
from harness.launch.placement.base import HOSTFILE, Placement, free_port, hostfile_text
from harness.launch.plan import LaunchPlan, LaunchRequest
from harness.spec import RunSpec

LOOPBACK = "127.0.0.1"   # the rendezvous stays on this host's loopback


@dataclass(frozen=True)
class LocalPlacement(Placement):
    name = "local"
    nnodes: int = 1

    def describe(self) -> str:
        return "this host"

    def rendezvous_port(self, spec: RunSpec) -> str:
        return str(free_port(LOOPBACK))

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        # Every rank here, whatever node count the spec was placed with elsewhere (`reproduce` of a row
        # recorded across nodes runs it on this host).
        spec = request.spec.replace(nnodes=1)
        hostfile = request.cell_dir / HOSTFILE
        nodes = Nodes(spec=spec, program=request.program, first_host=LOOPBACK, port=request.port,
                      host_slots=f"localhost:{spec.world_size}", hostfile=str(hostfile), timeout_s=request.timeout_s, options=request.options)
        # The node is this host at the loopback address and serves the rendezvous itself: torchrun would
        # otherwise look its own host name up to decide both, which fails where the name does not resolve (a
        # container with its own host name and no network) and leaves the agent waiting out its join timeout.
        command = request.launcher.argv(nodes, Node("0", address=LOOPBACK, serves_rendezvous=True))
        files = ((hostfile, hostfile_text(["localhost"], spec.world_size)),) if request.launcher.uses_hostfile else ()
        return LaunchPlan(commands=(tuple(command),), targets=("this host",), files=files)
