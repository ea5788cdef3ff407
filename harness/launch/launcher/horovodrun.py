"""horovodrun: started once, on the first host, it starts the ranks of every host itself (ssh to the others,
with its own ssh settings: set a port or key for them in ~/.ssh/config) and runs Gloo's rendezvous on its
own ports.

    horovodrun -np W -H host1:K,host2:K --gloo python -m harness.rank.worker ...
"""

from __future__ import annotations

import sys

from harness.launch.launcher.base import Launcher, Node, Nodes, executable

# Strategy options that are horovodrun's own flags (Horovod reads them from the launcher, not in the rank).
FLAG_OPTIONS = {"fusion_threshold_mb": "--fusion-threshold-mb", "cycle_time_ms": "--cycle-time-ms"}


class Horovodrun(Launcher):
    name = "horovodrun"
    reaches_nodes = True
    uses_port = False
    # horovodrun starts each rank through a shell, which reports a rank killed by SIGKILL as 128 + 9
    # (horovod/runner/gloo_run.py: "Process N exit with status code 137.").
    sigkill_marks = ("exit with status code 137.",)

    def argv(self, nodes: Nodes, node: Node) -> list[str]:
        spec, options = nodes.spec, nodes.options
        flags = [part for option, flag in FLAG_OPTIONS.items() if option in options
                 for part in (flag, str(options[option]))]
        return [*executable("horovodrun", "horovod.runner.launch"), "-np", str(spec.world_size),
                "-H", nodes.host_slots, "--gloo", "--gloo-timeout-seconds", str(int(nodes.timeout_s)), *flags,
                sys.executable, *nodes.program]
