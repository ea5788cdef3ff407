"""Activation memory of a transformer block: the bytes its forward saves for backward, per micro-batch, as a
function of tensor parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", sec. 4 and Table 2), with the constants redone for the workloads' block.

Korthikanti's block (fp16, with dropout, attention scores kept) saves s b h (34 + 5 a s / h) bytes per layer,
and under tensor parallelism of t s b h (10 + 24 / t + 5 a s / (h t)). Their 34 is, in bytes of s b h: the two
layer-norm inputs 4, the QKV and MLP inputs 2 + 2, Q and K 4, V 2, the projection input 2, GeLU's input and
output 8 + 8, and two dropout masks 1 + 1; the 5 a s / h is the softmax, its dropout mask and its output.
The workloads' block (workloads/gpt.py) differs in three ways, each measured on gpt-tiny by hooking
`torch.autograd.graph.saved_tensors_hooks` (tests/test_activations.py):

- no dropout: no masks;
- `scaled_dot_product_attention` (a flash kernel) keeps no a x s x s scores: it saves q, k, v and its output
  (the projection's input is a view of it) and a log-sum-exp of a x s x b fp32 values;
- layer norms save their input and an fp32 mean and reciprocal deviation per token (2 x 2 x s b x 4 bytes).

So, with e_n the bytes of a layer norm's input (the fp32 residual stream: 4, under autocast too) and e_c those of
the compute dtype (4 in fp32, 2 under bf16 autocast), one block saves

    s b h (2 e_n + 2 e_c + 12 e_c / t) + 16 s b + 4 a s b / t

bytes: the layer-norm inputs and the column-parallel layers' inputs are whole on every tensor-parallel rank
(2 e_n + 2 e_c; Korthikanti's 10, the part sequence parallelism would split), q, k, v, the attention output and
GeLU's input and output are split (3 + 1 + 4 + 4 = 12 e_c / t; Korthikanti's 24 / t at e_c = 2). Under autocast
each linear layer also saves the bf16 copy of its weight, 2 x 12 h^2 / t bytes a block: not an activation (it
does not grow with the batch) but held until backward all the same, so it is reported beside them.

Checkpointed whole (activation checkpointing, full recomputation), a block keeps only its input: 4 s b h
bytes (`recomputed_block_activations`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

LAYER_NORM_INPUT_BYTES = 4          # the residual stream is fp32 (autocast keeps layer norms in fp32)
LAYER_NORM_STATISTICS_BYTES = 16    # two layer norms x (mean, reciprocal deviation) x fp32, per token
LOG_SUM_EXP_BYTES = 4               # fp32, per head and token


@dataclass(frozen=True, kw_only=True)
class BlockActivations:
    """Bytes one block's forward saves for backward, per micro-batch, on one tensor-parallel rank."""

    whole: float            # held whole on every tensor-parallel rank: layer-norm and column-parallel inputs
    split: float            # divided by the tensor-parallel degree: q, k, v, attention output, GeLU in and out
    statistics: float       # layer-norm statistics and the attention's log-sum-exp
    weight_copies: float    # autocast's bf16 copies of the linear weights (0 in fp32)

    @property
    def activations(self) -> float:
        return self.whole + self.split + self.statistics

    @property
    def total(self) -> float:
        return self.activations + self.weight_copies


def block_activations(*, seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                      compute_bytes: int = 4) -> BlockActivations:
    """The bytes above for a block of `hidden` features and `heads` heads on `micro_batch` samples of `seq_len`
    tokens, split over `tp` ranks, computing in `compute_bytes` per value (4: fp32, 2: bf16 autocast)."""
    if tp < 1 or heads % tp or hidden % heads:
        raise ValueError(f"tensor parallelism of {tp} must divide the {heads} heads, which must divide {hidden}")
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes must be 4 (fp32) or 2 (bf16 autocast), got {compute_bytes}")
    tokens = seq_len * micro_batch
    values = tokens * hidden
    return BlockActivations(
        whole=values * (2 * LAYER_NORM_INPUT_BYTES + 2 * compute_bytes),
        split=values * 12 * compute_bytes / tp,
        statistics=LAYER_NORM_STATISTICS_BYTES * tokens + LOG_SUM_EXP_BYTES * heads * tokens / tp,
        weight_copies=2 * 12 * hidden * hidden / tp if compute_bytes == 2 else 0.0)


def recomputed_block_activations(*, seq_len: int, micro_batch: int, hidden: int) -> float:
    """The bytes a block checkpointed whole keeps for backward, per micro-batch (full recomputation: Korthikanti
    et al. 2022, sec. 5 and Table 2, "full recompute", 2 s b h a layer at their 2-byte activations): its input
    alone, the fp32 residual stream (LAYER_NORM_INPUT_BYTES, under autocast too), whole on every
    tensor-parallel rank; everything else, the bf16 weight copies included, is made again in backward.
    Measured with torch's non-reentrant checkpoint (tests/test_activations.py)."""
    return LAYER_NORM_INPUT_BYTES * seq_len * micro_batch * hidden


def rank_activation_bytes(*, seq_len: int, micro_batch: int, hidden: int, heads: int, layers: int, compute_bytes: int,
                          tensor_parallel: int = 1, stages: int = 1, micro_batches: int = 1,
                          checkpointed: bool = False) -> float:
    """What the busiest rank's blocks hold for backward at their peak, for a layout: each block whole
    (`block_activations` at `tensor_parallel`) or, `checkpointed`, its input alone (`recomputed_block_activations`),
    times the blocks of a stage, ceil(layers / stages), times the micro-batches a stage holds in flight: under
    1F1B at most the pipeline's depth (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", sec. 2.2.1), so min(stages, micro_batches) at the first stage, the busiest;
    one without a pipeline, whose micro-batches run forward and backward one after another."""
    if checkpointed:
        per_block = recomputed_block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden)
    else:
        per_block = block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads,
                                      tp=tensor_parallel, compute_bytes=compute_bytes).total
    return -(-layers // stages) * min(stages, micro_batches) * per_block


def korthikanti_bytes_per_layer(*, seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1) -> float:
    """Korthikanti et al. 2022, Table 2, "tensor parallel (baseline)": s b h (10 + 24 / t + 5 a s / (h t)), their
    fp16 block with dropout and the attention scores kept (t = 1: their eq. 1, s b h (34 + 5 a s / h))."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def predicted_activation_bytes(row_spec: Mapping[str, Any], m: Mapping[str, Any]) -> float | None:
    """What one micro-batch's forward through a rank's transformer blocks saves for backward (`block_activations`
    x the blocks, `recomputed_block_activations` for those the row checkpointed), from the shape the row recorded
    (`workload_description`) and the tensor-parallel degree in its `strategy_config` ("tensor_parallel"; 1 where
    absent); None for rows without a transformer's shape, for
    the pipeline, whose stages hold several micro-batches in flight, for recipes that keep bf16 weights
    (DeepSpeed's bf16 section, FSDP2's MixedPrecisionPolicy: a bf16 residual stream and no weight copies, which
    the terms above do not describe), and for sequence parallelism, whose saved tensors these terms have not
    been checked against (tests/test_activations.py measures tp without it)."""
    shape = m.get("workload_description") or {}
    if shape.get("family") != "gpt" or row_spec["strategy"] == "pipeline":
        return None
    if (m.get("strategy_config") or {}).get("sequence_parallel"):
        return None
    if m.get("precision_recipe") not in ("fp32", "autocast"):
        return None
    tp = int((m.get("strategy_config") or {}).get("tensor_parallel") or 1)
    seq_len, micro_batch, hidden = int(shape["seq_len"]), int(row_spec["micro_batch"]), int(shape["n_embd"])
    block = block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=int(shape["n_head"]),
                              tp=tp, compute_bytes=2 if row_spec["precision"] == "bf16" else 4)
    checkpointed = int(m.get("activation_checkpointed_blocks") or 0)
    recomputed = recomputed_block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden)
    return (int(shape["n_layer"]) - checkpointed) * block.total + checkpointed * recomputed
