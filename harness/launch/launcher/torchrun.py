"""torchrun: one elastic agent per node, meeting at a c10d rendezvous on the first host.

    torchrun --nnodes=N --nproc-per-node=K --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m harness.rank.worker ...
"""

from __future__ import annotations

from typing import Sequence

from harness.launch.launcher.base import Launcher, Node, Nodes, executable


# Seconds a new rendezvous of an elastic cell waits for more nodes once it has its fewest.
LAST_CALL_S = 5


class Torchrun(Launcher):
    name = "torchrun"
    sigkill_marks = ("Signal 9 (SIGKILL)",)   # torchrun's ChildFailedError names the signal
    restarts = True

    def argv(self, nodes: Nodes, node: Node) -> list[str]:
        spec = nodes.spec
        # Lazily: the strategies' registry imports this module.
        from harness.strategies.state_checkpoint import NONE, OPTION_NAME, checkpoint_plan

        plan = checkpoint_plan(nodes.options.get(OPTION_NAME, NONE))
        # A cell that loses a rank or a node on purpose is restarted once, from its save; any other cell fails on a
        # lost rank. One that loses a node goes on with one node fewer (elastic: --nnodes=MIN:MAX), and its new
        # rendezvous waits LAST_CALL_S, not torch's 30 s, for a node that is not coming back.
        restarts = 1 if plan is not None and plan.failure_step is not None else 0
        elastic = plan is not None and plan.leave_step is not None
        return torchrun_argv(f"{spec.nnodes - 1}:{spec.nnodes}" if elastic else spec.nnodes, spec.ranks_per_node,
                             f"{nodes.first_host}:{nodes.port}", nodes.program, local_addr=node.address,
                             serves_rendezvous=node.serves_rendezvous, max_restarts=restarts,
                             last_call_s=LAST_CALL_S if elastic else None)


def torchrun_argv(nnodes: int | str, ranks_per_node: int, endpoint: str, program: Sequence[str],
                  local_addr: str | None = None, serves_rendezvous: bool | str | None = None,
                  max_restarts: int = 0, last_call_s: int | None = None) -> list[str]:
    """torchrun with a c10d rendezvous at `endpoint` (host:port; the rendezvous id follows the port, which is
    new for every launch, so two launches never meet). Where the placement knows them, a node is told the
    address it is reached at and whether it hosts the rendezvous store: torchrun would otherwise guess both
    from host names, which fails where hosts share a name (network namespaces) or a name resolves to another
    interface. `serves_rendezvous` may be a shell expression the node's shell expands to true or false."""
    node = [f"--local-addr={local_addr}"] if local_addr else []
    conf = [f"last_call_timeout={last_call_s}"] if last_call_s is not None else []
    if isinstance(serves_rendezvous, bool):
        conf.insert(0, f"is_host={str(serves_rendezvous).lower()}")
    elif serves_rendezvous is not None:
        conf.insert(0, f"is_host={serves_rendezvous}")
    if conf:
        node.append(f"--rdzv-conf={','.join(conf)}")
    return [*executable("torchrun", "torch.distributed.run"),
            f"--nnodes={nnodes}", f"--nproc-per-node={ranks_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id=parbench-{endpoint.rsplit(':', 1)[-1]}", f"--max-restarts={max_restarts}", *node, *program]
