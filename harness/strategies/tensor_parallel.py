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


def split_parameter_count(layers: Sequence[nn.Module], tp: int) -> int:
    """Parameters one rank holds once every block of `layers` is split over `tp` ranks: the column-parallel
    layers' weights and biases and the row-parallel layers' weights divided by `tp` (RowwiseParallel keeps the
    bias whole: it is added once, after the partial outputs are summed), everything else whole. A tied weight
    counts once."""
    split = set()
    for layer in layers:
        if isinstance(layer, Block):
            for name in COLUMN_PARALLEL:
                split.update(id(p) for p in getattr(layer, name).parameters())
            for name in ROW_PARALLEL:
                split.add(id(getattr(layer, name).weight))
    parameters = {id(p): p for layer in layers for p in layer.parameters()}
    return sum(p.numel() // tp if key in split else p.numel() for key, p in parameters.items())


def activation_all_reduces(*, micro_batch: int, seq_len: int, n_embd: int, n_layer: int, micro_batches: int,
                           tp: int, bf16: bool, group: str):
    """The all-reduces tensor parallelism adds to one optimizer step of a rank (Shoeybi et al. 2019, sec. 3):
    forward sums each block's two row-parallel outputs, backward the input gradients of its two column-parallel
    layers (q, k and v are one fused layer here, so Megatron's 2 + 2), each b x s x h values among the `tp`
    ranks, for every micro-batch. Forward sums in the dtype autocast computed the outputs in (bf16), backward in
    the fp32 of the inputs (a LayerNorm's output under autocast)."""
    from harness.derive.comm import Collective
    from harness.strategies.base import ExpectedCollective

    values, calls = micro_batch * seq_len * n_embd, 2 * n_layer * micro_batches
    return (ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=values * (2 if bf16 else 4),
                               calls=calls, ranks=tp, group=group),
            ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=values * 4, calls=calls, ranks=tp,
                               group=group))


def is_split(tensor: torch.Tensor, dimension: str) -> bool:
    """Whether a (possibly DTensor) tensor is sharded over the mesh dimension named `dimension`: a rank holds a
    slice of it, not a copy."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return dimension in names and tensor.placements[names.index(dimension)].is_shard()


def local_parts(tensors: Sequence[torch.Tensor], dimension: str, coordinate: int) -> list[torch.Tensor]:
    """Each tensor as a part whose squares add up over every rank: the local piece where it is split over the
    tensor-parallel `dimension`; where every tensor-parallel rank holds the same (a layer norm, an embedding),
    the local piece at tensor-parallel `coordinate` 0 only, an empty tensor at the others."""
    from torch.distributed.tensor import DTensor

    parts = []
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        parts.append(local if is_split(tensor, dimension) or coordinate == 0 else local.new_empty(0))
    return parts


class SlicedParameters:
    """Trainer methods for a model whose split layers are DTensors over a "tp" mesh dimension (`tp`,
    `fsdp2-tp`): each parameter and gradient as a part whose squares add up over every rank (`local_parts`);
    `tp_coordinate` is the rank's place along the tensor-parallel dimension."""

    model: nn.Module
    tp_coordinate: int

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def local_parameters(self):
        return local_parts(self._trainable(), "tp", self.tp_coordinate), True

    def local_gradients(self):
        return local_parts([p.grad for p in self._trainable()], "tp", self.tp_coordinate), True
