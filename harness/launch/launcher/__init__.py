"""Launchers, one module each, in one literal registry. A strategy names its launcher by key
(`Strategy.launcher = "torchrun"`); the strategy registry checks the key when a strategy registers.

Adding a launcher: a module here with a `Launcher` subclass, and its line below.
"""

from __future__ import annotations

from harness.launch.launcher.base import Launcher, Node, Nodes
from harness.launch.launcher.deepspeed import DeepSpeed
from harness.launch.launcher.horovodrun import Horovodrun
from harness.launch.launcher.python import Python
from harness.launch.launcher.torchrun import Torchrun
from harness.spec import SpecError

LAUNCHERS: dict[str, Launcher] = {
    "python": Python(),
    "torchrun": Torchrun(),
    "horovodrun": Horovodrun(),
    "deepspeed": DeepSpeed(),
}


def get_launcher(name: str) -> Launcher:
    try:
        return LAUNCHERS[name]
    except KeyError:
        raise SpecError(f"unknown launcher {name!r}; known: {', '.join(LAUNCHERS)}") from None


__all__ = ["LAUNCHERS", "Launcher", "Node", "Nodes", "get_launcher"]
