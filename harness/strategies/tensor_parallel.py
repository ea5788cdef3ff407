"""Megatron-style tensor parallelism of the GPT workloads' blocks with DTensor, the layout a `tp` strategy
builds on (Shoeybi et al. 2019, "Megatron-LM", sec. 3; torchtitan's `apply_tp` is the same plan).

    from harness.strategies.tensor_parallel import parallelize_blocks
    parallelize_blocks(layers, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))

Each block's attention input projection `c_attn` and MLP input `c_fc` are column-parallel (each rank holds a
slice of their output features), the two output projections `attn_proj` and `mlp_proj` row-parallel (a slice
of their input features, the partial outputs summed by an all-reduce). Everything else (embeddings, layer
norms, the tied head) stays whole on every rank, computing the same values from the same replicated inputs.

`c_attn` is fused: its rows are q, k and v one after the other, so a plain split of its rows would hand a rank
all of q and part of k. Its rows are reordered first so that the r-th slice holds rank r's heads' q, then
their k, then their v (`per_head_qkv_order`); the block's forward chunks its output in three and counts its
heads from it (workloads/gpt.py), so that the whole model computes exactly what it did before.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from workloads.gpt import Block

# The Megatron plan of one block, by submodule name (column-parallel inputs, row-parallel outputs).
COLUMN_PARALLEL = ("c_attn", "c_fc")
ROW_PARALLEL = ("attn_proj", "mlp_proj")


def per_head_qkv_order(n_embd: int, n_head: int, tp: int) -> torch.Tensor:
    """The row order of a fused q|k|v projection (3 x n_embd rows, each of q, k and v n_head heads of
    n_embd / n_head rows) that puts rank r's heads' q rows, then their k rows, then their v rows in the r-th
    of `tp` equal slices."""
    if n_embd % n_head or n_head % tp:
        raise ValueError(f"tensor parallelism of {tp} needs heads ({n_head}) divisible by it and n_embd "
                         f"({n_embd}) divisible by the heads")
    head_dim, heads_per_rank = n_embd // n_head, n_head // tp
    order: list[int] = []
    for rank in range(tp):
        for part in range(3):                                   # q, k, v
            for head in range(rank * heads_per_rank, (rank + 1) * heads_per_rank):
                start = part * n_embd + head * head_dim
                order.extend(range(start, start + head_dim))
    return torch.tensor(order)


def parallelize_blocks(layers: Sequence[nn.Module], mesh) -> list[Block]:
    """Turn every GPT block of `layers` into its tensor-parallel form over the 1-D `mesh`, in place, and return
    them. Every rank must hold the same whole weights before (the same seed): each keeps its own slices."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {**{name: ColwiseParallel() for name in COLUMN_PARALLEL},
            **{name: RowwiseParallel() for name in ROW_PARALLEL}}
    blocks = [layer for layer in layers if isinstance(layer, Block)]
    for block in blocks:
        order = per_head_qkv_order(block.c_attn.in_features, block.n_head, mesh.size())
        with torch.no_grad():
            block.c_attn.weight.copy_(block.c_attn.weight[order])
            block.c_attn.bias.copy_(block.c_attn.bias[order])
        parallelize_module(block, mesh, dict(plan))
    return blocks
