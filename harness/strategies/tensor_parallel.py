"""Megatron-style tensor parallelism of the GPT workloads' blocks with DTensor, the layout a `tp` strategy
builds on (Shoeybi et al. 2019, "Megatron-LM", sec. 3; torchtitan's `apply_tp` is the same plan).

    from harness.strategies.tensor_parallel import parallelize_blocks
    parallelize_blocks(layers, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))

Each block's attention input projection `c_attn` and MLP input `c_fc` are column-parallel (each rank holds a
slice of their output features), the two output projections `attn_proj` and `mlp_proj` row-parallel (a slice
of their input features, the partial outputs summed by an all-reduce). Everything else (embeddings, layer
norms, the tied head) stays whole on every rank, computing the same values from the same replicated inputs.

With sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4.2.2; torchtitan's plan), the residual stream between the linear layers is split along the
sequence instead of copied: each rank holds its slice of the tokens through the layer norms, the all-reduce of
a row-parallel output becomes a reduce-scatter onto the slices, and a column-parallel layer all-gathers its
input first. The embedding's output is cut to the rank's slice (no traffic forward; backward all-gathers its
gradient) and the final norm's gathered for the head. The norms' weights then see only their rank's tokens, so
their gradients are partial sums: `reduce_partial_gradients` adds them up before the optimizer step.

With loss parallelism, the tied vocabulary matrix is split by rows as well: the embedding looks up each rank's
rows and sums the partial outputs, the head computes each rank's slice of the logits, and the cross-entropy runs
on the split logits (torch's `loss_parallel`), never gathering b x s x vocabulary values.

`c_attn` is fused: its rows are q, k and v one after the other, so a plain split of its rows would hand a rank
all of q and part of k. Its rows are reordered first so that the r-th slice holds rank r's heads' q, then
their k, then their v (`per_head_qkv_order`); the block's forward chunks its output in three and counts its
heads from it (workloads/gpt.py), so that the whole model computes exactly what it did before.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch
from torch import nn

from workloads.gpt import Block, FinalNorm, LMHead, TokenEmbedding

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


def parallelize_blocks(layers: Sequence[nn.Module], mesh, sequence_parallel: bool = False,
                       loss_parallel: bool = False) -> list[Block]:
    """Turn every GPT block of `layers` into its tensor-parallel form over the 1-D `mesh`, in place, and return
    them; with `sequence_parallel`, the norms too, and the embedding's output and the head's input cut and
    gathered along the sequence; with `loss_parallel`, the tied vocabulary matrix split by rows (module
    docstring). Every rank must hold the same whole weights before (the same seed): each keeps its own slices."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    tokens = Shard(1)                           # (batch, sequence, hidden): split along the sequence
    if sequence_parallel:
        plan = {**{name: ColwiseParallel(input_layouts=tokens) for name in COLUMN_PARALLEL},
                **{name: RowwiseParallel(output_layouts=tokens) for name in ROW_PARALLEL},
                "ln_1": SequenceParallel(), "ln_2": SequenceParallel()}
    else:
        plan = {**{name: ColwiseParallel() for name in COLUMN_PARALLEL},
                **{name: RowwiseParallel() for name in ROW_PARALLEL}}
    blocks = [layer for layer in layers if isinstance(layer, Block)]
    for block in blocks:
        order = per_head_qkv_order(block.c_attn.in_features, block.n_head, mesh.size())
        with torch.no_grad():
            block.c_attn.weight.copy_(block.c_attn.weight[order])
            block.c_attn.bias.copy_(block.c_attn.bias[order])
        parallelize_module(block, mesh, dict(plan))
    embedding = next((layer for layer in layers if isinstance(layer, TokenEmbedding)), None)
    for layer in layers:
        if isinstance(layer, TokenEmbedding):
            if loss_parallel:       # each rank looks up its rows of the vocabulary; the partial sums all-reduced
                parallelize_module(layer.wte, mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                    output_layouts=Replicate()))
            if sequence_parallel:
                parallelize_module(layer, mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                    desired_output_layouts=tokens))
        elif isinstance(layer, FinalNorm) and sequence_parallel:
            parallelize_module(layer, mesh, {"ln_f": SequenceParallel()})
        elif isinstance(layer, LMHead) and (sequence_parallel or loss_parallel):
            if loss_parallel:
                # The head is the embedding's matrix (tied): the same split Parameter, so that its logits come out
                # split over the vocabulary (DTensor's linear with rows Shard(0)) for loss_parallel's
                # cross-entropy, and both uses' gradients add up in one tensor as they do whole.
                layer.weight = embedding.wte.weight
            parallelize_module(layer, mesh, PrepareModuleInput(input_layouts=tokens if sequence_parallel else Replicate(),
                                                               desired_input_layouts=Replicate(),
                                                               use_local_output=not loss_parallel))
    return blocks


def reduce_partial_gradients(parameters: Sequence[nn.Parameter]) -> int:
    """Sum, over the tensor-parallel ranks, every gradient that backward left as a partial sum (a norm's weights
    under sequence parallelism see only their rank's tokens): one all-reduce each, before the optimizer reads
    them. Returns how many. Left partial, torch's AdamW sums each wherever it reads it (measured on gpt-tiny at
    TP 2: 54 all-reduces a step instead of these 18, the same losses) and the gradients read for parity are a
    rank's partial sums (a tensor's gradient norm 41% off the plain loop's)."""
    from torch.distributed.tensor import DTensor, Replicate

    reduced = 0
    for parameter in parameters:
        gradient = parameter.grad
        if isinstance(gradient, DTensor) and any(p.is_partial() for p in gradient.placements):
            parameter.grad = gradient.redistribute(gradient.device_mesh, [Replicate()] * gradient.device_mesh.ndim)
            reduced += 1
    return reduced


def split_parameter_count(layers: Sequence[nn.Module], tp: int, vocabulary: bool = False) -> int:
    """Parameters one rank holds once every block of `layers` is split over `tp` ranks: the column-parallel
    layers' weights and biases and the row-parallel layers' weights divided by `tp` (RowwiseParallel keeps the
    bias whole: it is added once, after the partial outputs are summed), with `vocabulary` (loss parallelism)
    the tied token matrix too, everything else whole. A tied weight counts once."""
    split = set()
    for layer in layers:
        if isinstance(layer, TokenEmbedding) and vocabulary:
            split.add(id(layer.wte.weight))
        if isinstance(layer, Block):
            for name in COLUMN_PARALLEL:
                split.update(id(p) for p in getattr(layer, name).parameters())
            for name in ROW_PARALLEL:
                split.add(id(getattr(layer, name).weight))
    parameters = {id(p): p for layer in layers for p in layer.parameters()}
    return sum(p.numel() // tp if key in split else p.numel() for key, p in parameters.items())


def activation_all_reduces(*, micro_batch: int, seq_len: int, n_embd: int, n_layer: int, micro_batches: int,
                           tp: int, half: bool, group: str):
    """The all-reduces tensor parallelism adds to one optimizer step of a rank (Shoeybi et al. 2019, sec. 3):
    forward sums each block's two row-parallel outputs, backward the input gradients of its two column-parallel
    layers (q, k and v are one fused layer here, so Megatron's 2 + 2), each b x s x h values among the `tp`
    ranks, for every micro-batch. Forward sums in the dtype autocast computed the outputs in (`half`: bf16 or
    fp16), backward in the fp32 of the inputs (a LayerNorm's output under autocast)."""
    from harness.derive.comm import Collective
    from harness.strategies.base import ExpectedCollective

    values, calls = micro_batch * seq_len * n_embd, 2 * n_layer * micro_batches
    return (ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=values * (2 if half else 4),
                               calls=calls, ranks=tp, group=group),
            ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=values * 4, calls=calls, ranks=tp,
                               group=group))


def sequence_parallel_collectives(*, micro_batch: int, seq_len: int, n_embd: int, n_layer: int, micro_batches: int,
                                  tp: int, half: bool, group: str, partial_gradients: Sequence[int]):
    """The collectives sequence parallelism adds to one optimizer step of a rank, in place of
    `activation_all_reduces` (Korthikanti et al. 2022, sec. 4.2.2: each all-reduce becomes a reduce-scatter and
    an all-gather of the same b x s x h values, nccl-tests sizes being the whole gathered buffer), for every
    micro-batch:

    - each block forward all-gathers the inputs of its two column-parallel layers (the norms' outputs, fp32
      under autocast too) and reduce-scatters the outputs of its two row-parallel ones (in autocast's bf16);
      backward reduce-scatters the gradients of the two gathered inputs (fp32) and all-gathers those of the
      two scattered outputs (bf16 under autocast);
    - the head's input, the final norm's output, is all-gathered forward (fp32); the embedding's output, cut
      to the rank's slice forward, has its gradient all-gathered backward (fp32);

    and once a step an all-reduce of each gradient backward left partial (`partial_gradients`: their element
    counts, fp32)."""
    from harness.derive.comm import Collective
    from harness.strategies.base import ExpectedCollective

    values, per_block = micro_batch * seq_len * n_embd, 2 * n_layer * micro_batches
    compute = values * (2 if half else 4)

    def each(collective, size_bytes, calls):
        return ExpectedCollective(collective=collective, size_bytes=size_bytes, calls=calls, ranks=tp, group=group)

    collectives = [each(Collective.ALL_GATHER, values * 4, per_block + 2 * micro_batches),  # norms' out, embedding
                   each(Collective.ALL_GATHER, compute, per_block),                         # row-parallel out grads
                   each(Collective.REDUCE_SCATTER, compute, per_block),                     # row-parallel outputs
                   each(Collective.REDUCE_SCATTER, values * 4, per_block)]                  # gathered input grads
    for elements, calls in sorted(Counter(partial_gradients).items()):
        collectives.append(each(Collective.ALL_REDUCE, elements * 4, calls))
    return tuple(c for c in merge_collectives(collectives) if c.calls)


def vocabulary_parallel_collectives(*, micro_batch: int, seq_len: int, n_embd: int, micro_batches: int, tp: int,
                                    group: str, sequence_parallel: bool):
    """The collectives loss parallelism adds to one optimizer step of a rank, for every micro-batch, all fp32 (the
    embedding's output, the head's input gradient cast back to its input's dtype, the loss's `.float()`):

    - the embedding's lookups, each rank's rows of the vocabulary, summed: an all-reduce of b x s x h;
    - the head's input gradient, partial over the vocabulary's rows: an all-reduce of b x s x h, or with sequence
      parallelism a reduce-scatter onto the slices its input was gathered from;
    - the cross-entropy of logits split over the vocabulary (torch's loss_parallel): 3 all-reduces of one value a
      token, b x s (the logits' maximum, the sum of their exponentials, the target's logit)."""
    from harness.derive.comm import Collective
    from harness.strategies.base import ExpectedCollective

    values, tokens = micro_batch * seq_len * n_embd, micro_batch * seq_len

    def each(collective, size_bytes, calls):
        return ExpectedCollective(collective=collective, size_bytes=size_bytes, calls=calls, ranks=tp, group=group)

    head = Collective.REDUCE_SCATTER if sequence_parallel else Collective.ALL_REDUCE
    return (each(Collective.ALL_REDUCE, values * 4, micro_batches), each(head, values * 4, micro_batches),
            each(Collective.ALL_REDUCE, tokens * 4, 3 * micro_batches))


def merge_collectives(collectives):
    """Entries of the same collective, size and group added into one (fp32 and bf16 sizes coincide in fp32)."""
    from dataclasses import replace

    merged: dict[tuple, object] = {}
    for c in collectives:
        key = (c.collective, c.size_bytes, c.ranks, c.group)
        merged[key] = replace(merged[key], calls=merged[key].calls + c.calls) if key in merged else c
    return list(merged.values())


def partial_gradient_sizes(layers: Sequence[nn.Module]) -> list[int]:
    """Element counts of the parameters whose gradients sequence parallelism leaves partial: the layer norms'
    weights and biases (their inputs are a rank's tokens alone), the blocks' and the final one."""
    return [p.numel() for layer in layers for module in layer.modules() if isinstance(module, nn.LayerNorm)
            for p in module.parameters()]


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
