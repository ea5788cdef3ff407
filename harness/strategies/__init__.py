"""Parallelisation strategies, one module each, in one literal registry.

    python -m harness list
"""

from __future__ import annotations

from harness.spec import SpecError
from harness.strategies.base import Launcher, Option, PrecisionRecipe, RankContext, Strategy, Trainer
from harness.strategies.dataparallel import DataParallel
from harness.strategies.ddp import DDP
from harness.strategies.fsdp2 import FSDP2
from harness.strategies.horovod import Horovod
from harness.strategies.pipeline import Pipeline
from harness.strategies.plain import Plain
from harness.strategies.zero import ZeRO

STRATEGIES: dict[str, Strategy] = {
    "plain": Plain(),
    "dataparallel": DataParallel(),
    "ddp": DDP(),
    "horovod": Horovod(),
    "zero1": ZeRO(stage=1),
    "zero2": ZeRO(stage=2),
    "zero3": ZeRO(stage=3),
    "fsdp2": FSDP2(),
    "pipeline": Pipeline(),
}


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise SpecError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


__all__ = ["STRATEGIES", "Launcher", "Option", "PrecisionRecipe", "RankContext", "Strategy", "Trainer",
           "get_strategy"]
