"""What DeepSpeed's pipeline sends per optimizer step, stage by stage (deepspeed/runtime/pipe/engine.py and
module.py, 0.19.8), for harness.strategies.pipeline's expected traffic.

    from harness.strategies.pipeline_traffic import stage_traffic
    stage_traffic(layers, ties, stages=2, replicas=2, micro_batches=4, method="parameters", ...)

Per optimizer step of K micro-batches, on the rank of stage s of S in a replica of D:
- point to point (`p2p.send`/`p2p.recv`, torch.distributed send/recv): K activations to stage s + 1 and K
  gradients of the activations it received back to stage s - 1, and as many received, each the shape of the
  activation at that boundary (the workload's `layer_output_shapes`, from its config), in the recipe's activation
  dtype;
- the tied weights' gradients (GPT's token embedding, tied to the head) all-reduced between the first and the
  last stage (`_exec_reduce_tied_grads`), in fp32;
- every gradient of the stage's layers all-reduced among the D replicas of that stage (`_exec_reduce_grads`),
  where D > 1;
- the step's mean loss: all-reduced among the last stage's replicas where D > 1, then broadcast from the last
  stage along the pipeline (`_aggregate_total_loss`: a float32 pair, the replica's loss and the mean).
Stages are cut as DeepSpeed cuts them (`partition_balanced` over each layer's parameters, a tied layer's copy
counting its owner's, or `partition_uniform`): its two functions are written out here, step for step, so that a plan
(a dry run prices dozens of pipeline cells) does not import DeepSpeed, seconds of it; tests/test_pipeline_traffic.py
holds them to the installed DeepSpeed's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from torch import nn

LOSS_PAIR_BYTES = 8     # torch.stack([dp_group_loss, agg_loss]).float(), broadcast along the pipeline
LOSS_BYTES = 4          # the last stage's fp32 loss, all-reduced among its replicas


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_uniform (0.19.8): `num_items` cut into `num_parts` runs of equal length,
    the first `num_items % num_parts` runs one longer."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk = num_items // num_parts
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(num_items - chunk * num_parts):
        for p in range(i + 1, num_parts + 1):
            parts[p] += 1
    return parts


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_balanced (0.19.8): the cut of `weights` into `num_parts` runs whose largest
    and smallest sums differ least (the linear partition problem by dynamic programming), a later cut winning a tie,
    in float64 as its numpy arrays hold them."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + float(weight))
    dp_max[0][0] = dp_cost[0][0] = 0.0          # dp_min[0][0] stays inf, as DeepSpeed leaves it
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                max_sum, min_sum = max(dp_max[k][j - 1], run), min(dp_min[k][j - 1], run)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = cost, max_sum, min_sum, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    parts.reverse()
    return parts


def stage_boundaries(layers: Sequence[nn.Module], ties, stages: int, method: str) -> list[int]:
    """DeepSpeed's `parts`: stage s holds layers parts[s]..parts[s+1]-1 (PipelineModule._partition_layers)."""
    if method == "uniform":
        return partition_uniform(num_items=len(layers), num_parts=stages)
    counts = [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers]
    for tie in ties:         # a TiedLayerSpec builds the owner's whole module on the user's stage too
        counts[tie.user] = counts[tie.owner]
    return list(_balanced(tuple(counts), stages))


@functools.lru_cache(maxsize=256)
def _balanced(weights: tuple[int, ...], num_parts: int) -> tuple[int, ...]:
    """`partition_balanced`, once a model and stage count: a dry run cuts the same model at every world size."""
    return tuple(partition_balanced(weights, num_parts))


def boundary_bytes(shapes: Sequence[Sequence[int]], micro_batch: int, element_bytes: int) -> list[int]:
    """The bytes of each layer's output for a micro-batch of `micro_batch` samples, at `element_bytes` a value:
    `shapes` are each layer's output for one sample (`Workload.layer_output_shapes`), sizes in the dtype the
    pipeline sends."""
    return [micro_batch * math.prod(shape) * element_bytes for shape in shapes]


@dataclass(frozen=True, kw_only=True)
class StageTraffic:
    """One stage's calls and bytes per optimizer step (bytes of one call: nccl-tests sizes)."""

    stage: int
    sends: tuple[tuple[int, int], ...]          # (calls, bytes each): activations forward, gradients back
    receives: tuple[tuple[int, int], ...]
    tied_all_reduce: int                        # bytes of the tied gradients' all-reduce, 0 if none
    gradient_all_reduce: int                    # bytes of the stage's gradients reduced among its replicas
    loss_all_reduce: int                        # bytes, last stage with replicas only
    loss_broadcast: int                         # bytes, every stage of a pipeline of 2 or more


def stage_traffic(*, boundaries: Sequence[int], activation_bytes: Sequence[int], stage_gradient_bytes: Sequence[int],
                  tied_stages: Sequence[int], tied_gradient_bytes: int, replicas: int, micro_batches: int
                  ) -> list[StageTraffic]:
    """Every stage's traffic per optimizer step: `activation_bytes[i]` is layer i's output for one micro-batch,
    `stage_gradient_bytes[s]` the gradients stage s reduces among its `replicas`, `tied_stages` the stages
    holding a tied weight's copy."""
    stages = len(boundaries) - 1
    result = []
    for s in range(stages):
        forward = activation_bytes[boundaries[s + 1] - 1] if s < stages - 1 else 0     # to s + 1
        backward = activation_bytes[boundaries[s] - 1] if s > 0 else 0                 # to s - 1
        moves = tuple((micro_batches, size) for size in (forward, backward) if size)
        tied = tied_gradient_bytes if stages > 1 and s in tied_stages and len(set(tied_stages)) > 1 else 0
        result.append(StageTraffic(
            stage=s, sends=moves, receives=moves, tied_all_reduce=tied,
            gradient_all_reduce=stage_gradient_bytes[s] if replicas > 1 else 0,
            loss_all_reduce=LOSS_BYTES if s == stages - 1 and replicas > 1 else 0,
            loss_broadcast=LOSS_PAIR_BYTES if stages > 1 else 0))
    return result
