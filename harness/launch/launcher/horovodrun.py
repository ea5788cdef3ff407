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
# Horovod's own values of those flags since 0.21 ("Changed default cycle time from 5ms to 1ms and fusion threshold
# from 64MB to 128MB", #2468). Horovod Elastic 0.28.1 dies of SIGSEGV in `hvd.init()` after a rank is lost where both
# are set (measured here, with any values), so an elastic launch leaves out a flag at Horovod's own value.
HOROVOD_DEFAULTS = {"fusion_threshold_mb": 128, "cycle_time_ms": 1.0}


class Horovodrun(Launcher):
    name = "horovodrun"
    reaches_nodes = True
    uses_port = False
    # horovodrun starts each rank through a shell, which reports a rank killed by SIGKILL as 128 + 9
    # (horovod/runner/gloo_run.py: "Process N exit with status code 137.").
    sigkill_marks = ("exit with status code 137.",)

    # A cell that loses a rank on purpose runs under Horovod Elastic (harness.rank.horovod_elastic): the others go on.
    restarts = True

    def argv(self, nodes: Nodes, node: Node) -> list[str]:
        spec, options = nodes.spec, nodes.options
        elastic = is_elastic(nodes)
        flags = [part for option, flag in FLAG_OPTIONS.items() if option in options
                 and not (elastic and float(options[option]) == HOROVOD_DEFAULTS[option])
                 for part in (flag, str(options[option]))]
        return [*executable("horovodrun", "horovod.runner.launch"), "-np", str(spec.world_size),
                *self._hosts(nodes), "--gloo", "--gloo-timeout-seconds", str(int(nodes.timeout_s)), *flags,
                sys.executable, *nodes.program]

    def _hosts(self, nodes: Nodes) -> list[str]:
        """`-H` and its hosts; for a cell that loses a rank on purpose, Horovod Elastic's flags instead: a discovery
        command that names the hosts (a shell command: horovodrun runs it through the shell), the fewest ranks the job
        goes on with (all but one host's) and the most."""
        if not is_elastic(nodes):
            return ["-H", nodes.host_slots]
        hosts = elastic_hosts(nodes.host_slots, nodes.spec.world_size)
        fewest = nodes.spec.world_size - max(int(slots) for _, slots in hosts)
        discovery = "; ".join(f"echo {host}:{slots}" for host, slots in hosts)
        return ["--min-np", str(fewest), "--max-np", str(nodes.spec.world_size), "--host-discovery-script", discovery]


def is_elastic(nodes: Nodes) -> bool:
    """Does the cell lose a rank on purpose (harness.strategies.state_checkpoint, `kill=S`), so run under Horovod
    Elastic?"""
    from harness.strategies.state_checkpoint import NONE, OPTION_NAME, checkpoint_plan   # lazily: the registry imports this

    plan = checkpoint_plan(nodes.options.get(OPTION_NAME, NONE))
    return plan is not None and plan.kill_step is not None


def elastic_hosts(host_slots: str, world_size: int) -> list[tuple[str, str]]:
    """The hosts Horovod Elastic is told of: the cell's, or on one machine two names of it, `localhost` and
    `127.0.0.1`, each with half the ranks (Horovod starts both locally, without ssh), so that the host of a killed rank
    can leave the job and the other stay, as on two machines."""
    hosts = [tuple(entry.rsplit(":", 1)) for entry in host_slots.split(",")]
    if len(hosts) == 1 and world_size >= 2 and world_size % 2 == 0:
        return [("localhost", str(world_size // 2)), ("127.0.0.1", str(world_size // 2))]
    return hosts
