"""DeepSpeed's own launcher, given a hostfile of the cell's nodes and started on every node (`--no_ssh`:
the placement has reached the node already, where DeepSpeed would reach the others with pdsh).

    deepspeed --hostfile=H --no_ssh --node_rank=I --master_addr=FIRST --master_port=PORT --module harness.rank.worker ...

It numbers ranks node by node in hostfile order, tells each rank CROSS_RANK (its node), LOCAL_SIZE and the
usual RANK/WORLD_SIZE/MASTER_*, and sets CUDA_VISIBLE_DEVICES on the node to its slots, 0..K-1 (replacing
any the user set). Ranks sharing one GPU still work: CUDA exposes the devices of that list up to the first
index that does not exist, so K ranks on a one-GPU node all see device 0 (strategies/base.py place_rank).
"""

from __future__ import annotations

from typing import Sequence

from harness.launch.launcher.base import Launcher, Node, Nodes, executable


class DeepSpeed(Launcher):
    name = "deepspeed"
    uses_hostfile = True
    # launch.py logs `<cmd> exits with return code = -9` for a rank killed by SIGKILL, then exits 247
    # (sys.exit(-9)), so its own exit status does not show the signal.
    sigkill_marks = ("exits with return code = -9",)

    def argv(self, nodes: Nodes, node: Node) -> list[str]:
        return [*executable("deepspeed", "deepspeed.launcher.runner"), f"--hostfile={nodes.hostfile}", "--no_ssh",
                f"--node_rank={node.rank}", f"--master_addr={nodes.first_host}", f"--master_port={nodes.port}",
                "--no_local_rank", *_script(nodes.program)]


def _script(program: Sequence[str]) -> list[str]:
    """The rank's program as DeepSpeed's launcher takes it: `--module NAME args` for `-m NAME args`."""
    if program and program[0] == "-m":
        return ["--module", *program[1:]]
    return list(program)
