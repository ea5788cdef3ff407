"""torchrun: one elastic agent per node, meeting at a c10d rendezvous on the first host.

    torchrun --nnodes=N --nproc-per-node=K --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m harness.rank.worker ...
"""

from __future__ import annotations

from typing import Sequence

from harness.launch.launcher.base import Launcher, Node, Nodes, executable


class Torchrun(Launcher):
    name = "torchrun"
    sigkill_marks = ("Signal 9 (SIGKILL)",)   # torchrun's ChildFailedError names the signal
    restarts = True

    def argv(self, nodes: Nodes, node: Node) -> list[str]:
        spec = nodes.spec
        # Lazily: the strategies' registry imports this module.
        from harness.strategies.state_checkpoint import NONE, OPTION_NAME, checkpoint_plan

        plan = checkpoint_plan(nodes.options.get(OPTION_NAME, NONE))
        # A cell whose rank is killed on purpose is restarted once, from its save; any other cell fails on a lost rank.
        restarts = 1 if plan is not None and plan.kill_step is not None else 0
        return torchrun_argv(spec.nnodes, spec.ranks_per_node, f"{nodes.first_host}:{nodes.port}", nodes.program,
                             local_addr=node.address, serves_rendezvous=node.serves_rendezvous, max_restarts=restarts)


def torchrun_argv(nnodes: int, ranks_per_node: int, endpoint: str, program: Sequence[str],
                  local_addr: str | None = None, serves_rendezvous: bool | str | None = None,
                  max_restarts: int = 0) -> list[str]:
    """torchrun with a c10d rendezvous at `endpoint` (host:port; the rendezvous id follows the port, which is
    new for every launch, so two launches never meet). Where the placement knows them, a node is told the
    address it is reached at and whether it hosts the rendezvous store: torchrun would otherwise guess both
    from host names, which fails where hosts share a name (network namespaces) or a name resolves to another
    interface. `serves_rendezvous` may be a shell expression the node's shell expands to true or false."""
    node = [f"--local-addr={local_addr}"] if local_addr else []
    if isinstance(serves_rendezvous, bool):
        node.append(f"--rdzv-conf=is_host={str(serves_rendezvous).lower()}")
    elif serves_rendezvous is not None:
        node.append(f"--rdzv-conf=is_host={serves_rendezvous}")
    return [*executable("torchrun", "torch.distributed.run"),
            f"--nnodes={nnodes}", f"--nproc-per-node={ranks_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id=parbench-{endpoint.rsplit(':', 1)[-1]}", f"--max-restarts={max_restarts}", *node, *program]
