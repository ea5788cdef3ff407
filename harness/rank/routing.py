"""What an MoE model's routers chose in each step, for every strategy alike: the tokens each expert of each block
received over the whole global batch, the smallest margin of any choice and how many choices were near-ties
(workloads.moe.MoEFeedForward keeps them). Parity holds a cell's choices to the plain loop's (harness.derive.parity):
a strategy that computes the same model routes every token the same way, unless a choice was a near-tie that a
rounding could flip.

Read after each step, outside its clock. A rank's counts are its own tokens'; the ranks of one data-parallel replica
see the same tokens (tensor parallelism) or different blocks of them (a pipeline's stages), so a replica's count of a
block is the largest over its ranks, and the global batch's the sum over the replicas.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch import nn

from workloads.moe import NEAR_TIE_MARGINS, MoEFeedForward


class RoutingRecord:
    """Each step's routed tokens per block and expert, and its smallest margin, on this rank."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.routers = [module for layer in layers for module in layer.modules() if isinstance(module, MoEFeedForward)]
        self.tokens_by_step: list[list[list[int]]] = []
        self.margin_by_step: list[float | None] = []
        self.near_ties_by_step: list[list[int]] = []

    def before_step(self) -> None:
        for router in self.routers:
            router.forget_routing()

    def after_step(self) -> None:
        if not self.routers:
            return
        self.tokens_by_step.append([router.routed_tokens.tolist() for router in self.routers])
        margin = min(float(router.smallest_margin) for router in self.routers)
        self.margin_by_step.append(None if math.isinf(margin) else margin)   # None: every expert chosen (k = E)
        self.near_ties_by_step.append([sum(counts) for counts in zip(*(r.near_ties.tolist() for r in self.routers))])

    def rank_figures(self, replica: int) -> dict[str, Any] | None:
        if not self.routers:
            return None
        return {"replica": replica, "tokens": self.tokens_by_step, "margin": self.margin_by_step,
                "near_ties": self.near_ties_by_step}


def routing_measurements(by_rank: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """The row's `routing`: tokens per expert of each block in each step over the global batch, each step's smallest
    margin over every rank, and the load imbalance (the most tokens an expert received over the mean, the largest
    over blocks and steps: 1 where routing is even)."""
    figures = [f for f in by_rank if f is not None]
    if not figures:
        return {}
    replicas: dict[int, dict[str, Any]] = {}
    for rank in figures:
        held = replicas.get(rank["replica"])
        replicas[rank["replica"]] = rank if held is None else {
            "tokens": [[[max(a, b) for a, b in zip(mine, theirs)] for mine, theirs in zip(step_mine, step_theirs)]
                       for step_mine, step_theirs in zip(held["tokens"], rank["tokens"])],
            "near_ties": [[max(a, b) for a, b in zip(mine, theirs)]
                          for mine, theirs in zip(held["near_ties"], rank["near_ties"])]}
    per_replica = list(replicas.values())
    steps = range(len(per_replica[0]["tokens"]))
    tokens = [[[sum(counts) for counts in zip(*(replica["tokens"][step][block] for replica in per_replica))]
               for block in range(len(per_replica[0]["tokens"][step]))] for step in steps]
    near_ties = [[sum(counts) for counts in zip(*(replica["near_ties"][step] for replica in per_replica))]
                 for step in steps]
    margins = [min((m for m in step if m is not None), default=None) for step in zip(*(r["margin"] for r in figures))]
    imbalance = max((max(block) / (sum(block) / len(block)) for step in tokens for block in step if sum(block)),
                    default=math.nan)
    return {"routing": {"tokens_per_expert_by_step": tokens, "smallest_margin_by_step": margins,
                        "near_tie_margins": list(NEAR_TIE_MARGINS), "near_ties_by_step": near_ties,
                        "load_imbalance": imbalance}}
