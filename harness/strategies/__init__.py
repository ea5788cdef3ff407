"""Parallelisation strategies, one module each, in one literal registry.

    python -m harness list
"""

from __future__ import annotations

from harness.spec import SpecError
from harness.strategies.base import Launcher, Option, PrecisionRecipe, RankContext, Strategy, Trainer
from harness.strategies.ddp import DDP
from harness.strategies.plain import Plain

STRATEGIES: dict[str, Strategy] = {
    "plain": Plain(),
    "ddp": DDP(),
}


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise SpecError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


__all__ = ["STRATEGIES", "Launcher", "Option", "PrecisionRecipe", "RankContext", "Strategy", "Trainer",
           "get_strategy"]
