"""Megatron-style tensor parallelism of the GPT and Llama workloads' blocks with DTensor, the layout a `tp`
strategy builds on (Shoeybi et al. 2019, "Megatron-LM", sec. 3; torchtitan's `apply_tp` is the same plan).

    from harness.strategies.tensor_parallel import parallelize_blocks
    parallelize_blocks(layers, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))

Each block's attention input projection (GPT's `c_attn`, Llama's `wqkv`) and MLP input (`c_fc`, `w_gate_up`) are
column-parallel (each rank holds a slice of their output features), the two output projections (`attn_proj` and
`mlp_proj`, `wo` and `w_down`) row-parallel (a slice of their input features, the partial outputs summed by an
all-reduce). Everything else (embeddings, norms, the head) stays whole on every rank, computing the same values
from the same replicated inputs; a norm's weight gradient is then whole too, its input's gradient having been
summed over the ranks by the column-parallel layer after it.

With sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4.2.2; torchtitan's plan), the residual stream between the linear layers is split along the
sequence instead of copied: each rank holds its slice of the tokens through the layer norms, the all-reduce of
a row-parallel output becomes a reduce-scatter onto the slices, and a column-parallel layer all-gathers its
input first. The embedding's output is cut to the rank's slice (no traffic forward; backward all-gathers its
gradient) and the final norm's gathered for the head. The norms' weights then see only their rank's tokens, so
their gradients are partial sums: `reduce_partial_gradients` adds them up before the optimizer step.

With loss parallelism, the vocabulary matrices are split by rows as well: the embedding looks up each rank's
rows and sums the partial outputs, the head (tied to the embedding, or Llama's own `output`, column-parallel as
torchtitan splits it) computes each rank's slice of the logits, and the cross-entropy runs on the split logits
(torch's `loss_parallel`), never gathering b x s x vocabulary values.

The input projections are fused: `c_attn`'s rows are q, k and v one after the other, `wqkv`'s too (n_head query
heads, then n_kv_head key and n_kv_head value heads), `w_gate_up`'s gate then up, so a plain split of their rows
would hand a rank all of q and part of k, or all of gate. Their rows are reordered first so that the r-th slice
holds rank r's share of each part in turn (`fused_rows_order`): its heads' q, then their k, then their v
(`per_head_qkv_order`; under grouped-query attention its n_head / tp query heads and the n_kv_head / tp key/value
heads they read, `grouped_qkv_order`), its slice of gate then the matching slice of up (`gate_up_order`). The
blocks split their outputs in those proportions and count their heads from their own width (workloads/gpt.py,
workloads/llama.py), so that the whole model computes exactly what it did before.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from workloads.gpt import Block, FinalNorm, LMHead, TokenEmbedding
from workloads.llama import LlamaBlock, LlamaEmbedding, LlamaFinalNorm, LlamaHead, LlamaTiedHead


def fused_rows_order(part_rows: Sequence[int], tp: int) -> torch.Tensor:
    """The row order of a projection fused from parts of `part_rows` rows, one after the other, that puts the
    r-th of `tp` equal slices of every part, the parts in their order, in the r-th of `tp` equal slices of the
    whole: what a column-parallel split (`Shard(0)`, equal chunks in rank order) then hands rank r."""
    if any(rows % tp for rows in part_rows):
        raise ValueError(f"tensor parallelism of {tp} must divide each part of a fused projection "
                         f"({', '.join(map(str, part_rows))} rows)")
    starts = [sum(part_rows[:index]) for index in range(len(part_rows))]
    order: list[int] = []
    for rank in range(tp):
        for start, rows in zip(starts, part_rows):
            share = rows // tp
            order.extend(range(start + rank * share, start + (rank + 1) * share))
    return torch.tensor(order)


def per_head_qkv_order(n_embd: int, n_head: int, tp: int) -> torch.Tensor:
    """The row order of a fused q|k|v projection (3 x n_embd rows, each of q, k and v n_head heads of
    n_embd / n_head rows) that puts rank r's heads' q rows, then their k rows, then their v rows in the r-th
    of `tp` equal slices."""
    if n_embd % n_head or n_head % tp:
        raise ValueError(f"tensor parallelism of {tp} needs heads ({n_head}) divisible by it and n_embd "
                         f"({n_embd}) divisible by the heads")
    return fused_rows_order((n_embd, n_embd, n_embd), tp)      # heads are contiguous rows of each part


def grouped_qkv_order(n_head: int, n_kv_head: int, head_dim: int, tp: int) -> torch.Tensor:
    """The row order of a grouped-query fused q|k|v projection (n_head query heads of head_dim rows, then n_kv_head
    key heads, then n_kv_head value heads) that puts rank r's n_head / tp query heads, then the n_kv_head / tp
    key heads they read, then those heads' values, in the r-th of `tp` equal slices. Query head j reads key/value
    head j // (n_head / n_kv_head), so rank r's query heads read exactly key/value heads [r K / tp, (r + 1) K / tp)
    when tp divides both counts (K = n_kv_head)."""
    if n_head % tp or n_kv_head % tp:
        raise ValueError(f"tensor parallelism of {tp} must divide the {n_head} heads and {n_kv_head} key/value heads")
    return fused_rows_order((n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim), tp)


def gate_up_order(intermediate_size: int, tp: int) -> torch.Tensor:
    """The row order of a fused gate|up projection (SwiGLU's, `intermediate_size` rows each) that puts rank r's
    slice of gate, then the same slice of up, in the r-th of `tp` equal slices: silu(gate) * up pairs them."""
    return fused_rows_order((intermediate_size, intermediate_size), tp)


@dataclass(frozen=True)
class BlockLayout:
    """Megatron's plan of one family's block, by submodule name: its column-parallel input projections, its
    row-parallel output projections, its norms (split along the sequence under sequence parallelism), and
    `fused_orders(block, tp)`: the row order each fused column-parallel projection needs at degree tp."""

    column: tuple[str, ...]
    row: tuple[str, ...]
    norms: tuple[str, ...]
    fused_orders: Callable[[nn.Module, int], dict[str, torch.Tensor]]


def _gpt_fused_orders(block: Block, tp: int) -> dict[str, torch.Tensor]:
    return {"c_attn": per_head_qkv_order(block.c_attn.in_features, block.n_head, tp)}


def _llama_fused_orders(block: LlamaBlock, tp: int) -> dict[str, torch.Tensor]:
    # The head counts from the block's own shapes (it keeps no config): wo reads every query head's output, and
    # each key/value head serves `group` query heads.
    n_head = block.wo.in_features // block.head_dim
    return {"wqkv": grouped_qkv_order(n_head, n_head // block.group, block.head_dim, tp),
            "w_gate_up": gate_up_order(block.w_gate_up.out_features // 2, tp)}


GPT_BLOCK = BlockLayout(column=("c_attn", "c_fc"), row=("attn_proj", "mlp_proj"), norms=("ln_1", "ln_2"),
                        fused_orders=_gpt_fused_orders)
LLAMA_BLOCK = BlockLayout(column=("wqkv", "w_gate_up"), row=("wo", "w_down"), norms=("attention_norm", "ffn_norm"),
                          fused_orders=_llama_fused_orders)
BLOCK_LAYOUTS = {Block: GPT_BLOCK, LlamaBlock: LLAMA_BLOCK}
# The layers around the blocks, each family's, by the attribute that holds the part tensor parallelism touches: the
# embedding's vocabulary matrix, the final norm, an untied head's Linear. A tied head's `weight` is the embedding's.
EMBEDDING_TABLES = {TokenEmbedding: "wte", LlamaEmbedding: "tok_embeddings"}
FINAL_NORMS = {FinalNorm: "ln_f", LlamaFinalNorm: "norm"}
TIED_HEADS = (LMHead, LlamaTiedHead)
UNTIED_HEADS = {LlamaHead: "output"}


def block_layout(layer: nn.Module) -> BlockLayout | None:
    """The plan of `layer` if it is a block tensor parallelism splits, else None."""
    return BLOCK_LAYOUTS.get(type(layer))


def reorder_fused_rows(block: nn.Module, orders: dict[str, torch.Tensor]) -> None:
    """Put each fused projection's rows (weight, and bias where it has one) in its rank-major `orders`."""
    with torch.no_grad():
        for name, order in orders.items():
            for parameter in getattr(block, name).parameters():
                parameter.copy_(parameter[order])


def _block_plan(layout: BlockLayout, sequence_parallel: bool) -> dict:
    """`parallelize_module`'s plan of one block (fresh styles for each block)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        return {**{name: ColwiseParallel() for name in layout.column},
                **{name: RowwiseParallel() for name in layout.row}}
    tokens = Shard(1)                           # (batch, sequence, hidden): split along the sequence
    return {**{name: ColwiseParallel(input_layouts=tokens) for name in layout.column},
            **{name: RowwiseParallel(output_layouts=tokens) for name in layout.row},
            **{name: SequenceParallel() for name in layout.norms}}


def parallelize_blocks(layers: Sequence[nn.Module], mesh, sequence_parallel: bool = False,
                       loss_parallel: bool = False) -> list[nn.Module]:
    """Turn every GPT or Llama block of `layers` into its tensor-parallel form over the 1-D `mesh`, in place, and
    return them; with `sequence_parallel`, the norms too, and the embedding's output and the head's input cut and
    gathered along the sequence; with `loss_parallel`, the vocabulary matrices split by rows (module docstring).
    Every rank must hold the same whole weights before (the same seed): each keeps its own slices."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    tokens = Shard(1)                           # (batch, sequence, hidden): split along the sequence
    head_input = tokens if sequence_parallel else Replicate()
    blocks = [layer for layer in layers if block_layout(layer)]
    for block in blocks:
        layout = block_layout(block)
        reorder_fused_rows(block, layout.fused_orders(block, mesh.size()))
        parallelize_module(block, mesh, _block_plan(layout, sequence_parallel))
    embedding = next((layer for layer in layers if type(layer) in EMBEDDING_TABLES), None)
    for layer in layers:
        kind = type(layer)
        if kind in EMBEDDING_TABLES:
            if loss_parallel:       # each rank looks up its rows of the vocabulary; the partial sums all-reduced
                parallelize_module(getattr(layer, EMBEDDING_TABLES[kind]), mesh,
                                   RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
            if sequence_parallel:
                parallelize_module(layer, mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                    desired_output_layouts=tokens))
            if loss_parallel:       # after the cut above: a hook registered later runs later
                layer.register_forward_hook(_settled)
        elif kind in FINAL_NORMS and sequence_parallel:
            parallelize_module(layer, mesh, {FINAL_NORMS[kind]: SequenceParallel()})
        elif isinstance(layer, TIED_HEADS) and (sequence_parallel or loss_parallel):
            if loss_parallel:
                # The head is the embedding's matrix (tied): the same split Parameter, so that its logits come out
                # split over the vocabulary (DTensor's linear with rows Shard(0)) for loss_parallel's
                # cross-entropy, and both uses' gradients add up in one tensor as they do whole.
                layer.weight = getattr(embedding, EMBEDDING_TABLES[type(embedding)]).weight
            parallelize_module(layer, mesh, PrepareModuleInput(input_layouts=head_input,
                                                               desired_input_layouts=Replicate(),
                                                               use_local_output=not loss_parallel))
        elif kind in UNTIED_HEADS and loss_parallel:
            # A matrix of its own: column-parallel as torchtitan splits Llama's output, the logits left split over
            # the vocabulary (a DTensor) for loss_parallel's cross-entropy; its input's gradient summed backward.
            parallelize_module(getattr(layer, UNTIED_HEADS[kind]), mesh,
                               ColwiseParallel(input_layouts=head_input, output_layouts=Shard(-1),
                                               use_local_output=False))
        elif kind in UNTIED_HEADS and sequence_parallel:
            parallelize_module(layer, mesh, PrepareModuleInput(input_layouts=tokens, desired_input_layouts=Replicate(),
                                                               use_local_output=True))
    return blocks


def _settled(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output as a plain tensor. Its lookups summed over the ranks (loss parallelism) come back as
    an AsyncCollectiveTensor, a wrapper with no storage of its own until an op reads it; GPT's embedding adds its
    positions to it, but Llama's returns it as it is, and the first norm saves it for backward, where the
    saved-activation census (harness.rank.saved_activations) cannot address it. A copy of it is plain (b x s x h
    values once a micro-batch, freed as the wrapper would be)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


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
    the vocabulary matrices too (the embedding's, an untied head's), everything else whole. A tied weight counts
    once."""
    split = set()
    for layer in layers:
        if vocabulary and type(layer) in EMBEDDING_TABLES:
            split.add(id(getattr(layer, EMBEDDING_TABLES[type(layer)]).weight))
        if vocabulary and type(layer) in UNTIED_HEADS:
            split.add(id(getattr(layer, UNTIED_HEADS[type(layer)]).weight))
        layout = block_layout(layer)
        if layout:
            for name in layout.column:
                split.update(id(p) for p in getattr(layer, name).parameters())
            for name in layout.row:
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
    """Element counts of the parameters whose gradients sequence parallelism leaves partial: the norms' weights
    and biases (LayerNorm's; RMSNorm has a weight alone), whose inputs are a rank's tokens alone, the blocks' and
    the final one."""
    return [p.numel() for layer in layers for module in layer.modules()
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) for p in module.parameters()]


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
