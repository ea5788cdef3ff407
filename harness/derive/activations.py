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

The Llama block (workloads/llama.py; `llama_block_activations`), measured the same way on llama-tiny
(tests/test_llama_activations.py), has a_kv key/value heads (grouped-query attention: k and v are h_kv = a_kv h / a
wide), an MLP i wide (SwiGLU), RMSNorms, rotary embeddings and no biases. One block saves

    s b h (2 e_n + 2 r e_n + 2 e_c) + s b (3 h + 3 h_kv + 4 i) e_c / t + 8 s b + 4 a s b / t + 2 s (h / a) e_c

bytes, term by term:

- 2 e_n: the two RMSNorms' inputs (the fp32 residual stream, under autocast too);
- 2 r e_n: each RMSNorm's normalised input x / rms(x), fp32, which its multiplication by the weight keeps for the
  weight's gradient. r = 1 where torch runs RMSNorm as its composite of elementwise ops (on the CPU: measured);
  r = 0 on CUDA, where `rms_norm` dispatches to the fused `_fused_rms_norm` kernel, whose backward
  (tools/autograd/derivatives.yaml) keeps only its input, its weight and the per-token statistic (not measured
  here: no GPU);
- 2 e_c: wqkv's and w_gate_up's inputs (the norms' outputs, in the compute dtype), whole on every rank as GPT's;
- 3 h + 3 h_kv, split: wqkv's whole output h + 2 h_kv, kept alive because the v that attention saves is a view of
  it, as it comes out of the split (rotation makes q and k new tensors; so v costs h + 2 h_kv, not h_kv: the
  storage it views holds q and k before rotation as well), the rotated q (h) and k (h_kv) that
  `scaled_dot_product_attention` saves (with `enable_gqa` the flash kernel reads the a_kv key/value heads
  without repeating them), and its output (h; wo's input is a view of it, as GPT's projection's is);
- 4 i, split: w_gate_up's output 2 i (`silu` keeps gate, the product keeps up: both views of it), silu(gate) i
  (kept by the product) and the product i (w_down's input); i, not GPT's 4 h;
- 8 s b: each RMSNorm's reciprocal root mean square, one fp32 a token (LayerNorm's 16 s b less the mean);
- 4 a s b / t: the log-sum-exp, one fp32 per query head and token, as GPT's;
- 2 s (h / a) e_c: the rotary cos and sin tables, s x head_dim each, computed in forward in the compute dtype and
  kept by the multiplications of q and k by them (k's `.to(k.dtype)` returns the same tensors): no batch, and
  whole on every tensor-parallel rank, each of whose heads is head_dim wide.

Tensor parallelism (harness/strategies/tensor_parallel.py: wqkv column-parallel by heads, a / t query and
a_kv / t key/value heads a rank; w_gate_up column-parallel, i / t a rank; wo and w_down row-parallel; RMSNorm
whole) divides q, k, v, the attention output, the log-sum-exp and the MLP's tensors by t and nothing else;
measured at t = 2 (tests/test_llama_activations.py, a launch). Under autocast the four linear layers' bf16
weight copies add 2 (h (h + 2 h_kv) + h h + 3 h i) / t = 2 h (2 h + 2 h_kv + 3 i) / t bytes a block. On llama-tiny
(s 64, b 4, h 64, a 4, a_kv 2, i 192) that is 1,488,896 B a block in fp32 and 976,896 B under bf16 autocast
(98,304 of them weight copies), equal to the byte on the CPU.

Not described: fp32 on CUDA with grouped-query attention, where neither the flash kernel (bf16 and fp16 only)
nor the memory-efficient one (no grouped-query attention: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)
applies and `scaled_dot_product_attention` falls back to its math kernel, which keeps the a x s x s scores.

Checkpointed whole (activation checkpointing, full recomputation), a block keeps only its input: 4 s b h
bytes (`recomputed_block_activations`), the Llama block as GPT's (measured on both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.spec import DeviceKind

LAYER_NORM_INPUT_BYTES = 4          # the residual stream is fp32 (autocast keeps layer norms in fp32)
LAYER_NORM_STATISTICS_BYTES = 16    # two layer norms x (mean, reciprocal deviation) x fp32, per token
LOG_SUM_EXP_BYTES = 4               # fp32, per head and token
RMS_NORM_STATISTICS_BYTES = 8       # two RMSNorms x a reciprocal root mean square x fp32, per token


@dataclass(frozen=True, kw_only=True)
class BlockActivations:
    """Bytes one block's forward saves for backward, per micro-batch, on one tensor-parallel rank."""

    whole: float            # held whole on every tensor-parallel rank: norm and column-parallel inputs
    split: float            # divided by the tensor-parallel degree: q, k, v, attention output, the MLP's tensors
    statistics: float       # norm statistics and the attention's log-sum-exp
    weight_copies: float    # autocast's bf16 copies of the linear weights (0 in fp32)
    rotary: float = 0.0     # a Llama block's cos and sin tables: no batch, whole on every rank (0 for GPT's)

    @property
    def activations(self) -> float:
        return self.whole + self.split + self.statistics + self.rotary

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


def llama_block_activations(*, seq_len: int, micro_batch: int, hidden: int, heads: int, kv_heads: int,
                            intermediate: int, tp: int = 1, compute_bytes: int = 4,
                            fused_norm: bool = False) -> BlockActivations:
    """The Llama block's bytes (module docstring) for `hidden` features, `heads` query heads and `kv_heads`
    key/value heads, an MLP `intermediate` wide, on `micro_batch` samples of `seq_len` tokens, split over `tp`
    ranks, computing in `compute_bytes` per value; `fused_norm` where RMSNorm is torch's fused kernel (CUDA),
    which keeps no normalised copy of its input."""
    if tp < 1 or heads % tp or kv_heads % tp or intermediate % tp:
        raise ValueError(f"tensor parallelism of {tp} must divide the {heads} heads, the {kv_heads} key/value heads "
                         f"and the MLP's width {intermediate}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"the {heads} heads must divide {hidden}, and the {kv_heads} key/value heads the heads")
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes must be 4 (fp32) or 2 (bf16 autocast), got {compute_bytes}")
    tokens = seq_len * micro_batch
    head_dim = hidden // heads
    kv_width = kv_heads * head_dim
    # wqkv's output whole (v is a view of it), the rotated q and k, the attention's output; gate|up, silu, product.
    split_width = 3 * hidden + 3 * kv_width + 4 * intermediate
    norm_input_bytes = LAYER_NORM_INPUT_BYTES * (1 if fused_norm else 2)     # x, and x / rms(x) unfused
    return BlockActivations(
        whole=tokens * hidden * (2 * norm_input_bytes + 2 * compute_bytes),
        split=tokens * split_width * compute_bytes / tp,
        statistics=RMS_NORM_STATISTICS_BYTES * tokens + LOG_SUM_EXP_BYTES * heads * tokens / tp,
        weight_copies=2 * hidden * (2 * hidden + 2 * kv_width + 3 * intermediate) / tp if compute_bytes == 2 else 0.0,
        rotary=2 * seq_len * head_dim * compute_bytes)


def block_bytes(*, seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, compute_bytes: int = 4,
                kv_heads: int | None = None, intermediate: int | None = None,
                fused_norm: bool = False) -> BlockActivations:
    """A GPT block's bytes (`block_activations`), or a Llama block's (`llama_block_activations`) where its
    `intermediate` width is given (`kv_heads` then defaulting to `heads`)."""
    if intermediate is None:
        return block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp,
                                 compute_bytes=compute_bytes)
    return llama_block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads,
                                   kv_heads=heads if kv_heads is None else kv_heads, intermediate=intermediate,
                                   tp=tp, compute_bytes=compute_bytes, fused_norm=fused_norm)


def block_sizes(shape: Mapping[str, Any], *, device: str, compute_bytes: int) -> dict[str, Any] | None:
    """`block_bytes`'s sizes from a transformer's shape (a row's `workload_description`, or a projection's shape):
    hidden and heads; for a Llama block kv_heads, intermediate and fused_norm (torch's RMSNorm on `device`) too. A
    shape without a family is GPT's (`harness project --shape` describes one). None for another family, and for a
    Llama block in fp32 on CUDA with grouped-query attention (the math attention kernel: module docstring)."""
    family = shape.get("family", "gpt")
    if family not in ("gpt", "llama"):
        return None
    sizes = {"hidden": int(shape["n_embd"]), "heads": int(shape["n_head"])}
    if family == "gpt":
        return sizes
    kv_heads, on_cuda = int(shape["n_kv_head"]), device == DeviceKind.CUDA
    if on_cuda and compute_bytes == 4 and kv_heads < sizes["heads"]:
        return None
    return {**sizes, "kv_heads": kv_heads, "intermediate": int(shape["intermediate_size"]), "fused_norm": on_cuda}


def recomputed_block_activations(*, seq_len: int, micro_batch: int, hidden: int) -> float:
    """The bytes a block checkpointed whole keeps for backward, per micro-batch (full recomputation: Korthikanti
    et al. 2022, sec. 5 and Table 2, "full recompute", 2 s b h a layer at their 2-byte activations): its input
    alone, the fp32 residual stream (LAYER_NORM_INPUT_BYTES, under autocast too), whole on every
    tensor-parallel rank; everything else, the bf16 weight copies (and a Llama block's rotary tables) included, is
    made again in backward. Measured with torch's non-reentrant checkpoint on GPT's block and Llama's
    (tests/test_activations.py, tests/test_llama_activations.py)."""
    return LAYER_NORM_INPUT_BYTES * seq_len * micro_batch * hidden


def rank_activation_bytes(*, seq_len: int, micro_batch: int, hidden: int, heads: int, layers: int, compute_bytes: int,
                          tensor_parallel: int = 1, stages: int = 1, micro_batches: int = 1,
                          checkpointed: bool = False, kv_heads: int | None = None, intermediate: int | None = None,
                          fused_norm: bool = False) -> float:
    """What the busiest rank's blocks hold for backward at their peak, for a layout: each block whole
    (`block_bytes` at `tensor_parallel`: GPT's, or Llama's where `intermediate` is given) or, `checkpointed`, its
    input alone (`recomputed_block_activations`), times the blocks of a stage, ceil(layers / stages), times the
    micro-batches a stage holds in flight: under 1F1B at most the pipeline's depth (Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2.1), so
    min(stages, micro_batches) at the first stage, the busiest; one without a pipeline, whose micro-batches run
    forward and backward one after another."""
    if checkpointed:
        per_block = recomputed_block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden)
    else:
        per_block = block_bytes(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads,
                                tp=tensor_parallel, compute_bytes=compute_bytes, kv_heads=kv_heads,
                                intermediate=intermediate, fused_norm=fused_norm).total
    return -(-layers // stages) * min(stages, micro_batches) * per_block


def korthikanti_bytes_per_layer(*, seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1) -> float:
    """Korthikanti et al. 2022, Table 2, "tensor parallel (baseline)": s b h (10 + 24 / t + 5 a s / (h t)), their
    fp16 block with dropout and the attention scores kept (t = 1: their eq. 1, s b h (34 + 5 a s / h))."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def predicted_activation_bytes(row_spec: Mapping[str, Any], m: Mapping[str, Any]) -> float | None:
    """What one micro-batch's forward through a rank's transformer blocks saves for backward (`block_bytes`, GPT's
    or Llama's, x the blocks, `recomputed_block_activations` for those the row checkpointed), from the shape the
    row recorded (`workload_description`), its device (RMSNorm's kernel: `block_sizes`) and the tensor-parallel
    degree in its `strategy_config` ("tensor_parallel"; 1 where absent); None for rows without a GPT's or a
    Llama's shape, for a Llama block in fp32 on CUDA (`block_sizes`), for
    the pipeline, whose stages hold several micro-batches in flight, for recipes that keep bf16 weights
    (DeepSpeed's bf16 section, FSDP2's MixedPrecisionPolicy: a bf16 residual stream and no weight copies, which
    the terms above do not describe), and for sequence parallelism, whose saved tensors these terms have not
    been checked against (tests/test_activations.py measures tp without it)."""
    shape = m.get("workload_description") or {}
    if shape.get("family") not in ("gpt", "llama") or row_spec["strategy"] == "pipeline":
        return None
    if (m.get("strategy_config") or {}).get("sequence_parallel"):
        return None
    if m.get("precision_recipe") not in ("fp32", "autocast"):
        return None
    tp = int((m.get("strategy_config") or {}).get("tensor_parallel") or 1)
    # Autocast computes in 2 bytes at bf16 and fp16 alike (gpt2-small's fp16 autocast row on an H200 saved what its
    # bf16 one did, 4 B apart: ../shared/gpu-h200/rows.jsonl).
    compute_bytes = 2 if row_spec["precision"] in ("bf16", "fp16") else 4
    sizes = block_sizes(shape, device=str(row_spec.get("device") or "cpu"), compute_bytes=compute_bytes)
    if sizes is None:
        return None
    seq_len, micro_batch, hidden = int(shape["seq_len"]), int(row_spec["micro_batch"]), int(shape["n_embd"])
    block = block_bytes(seq_len=seq_len, micro_batch=micro_batch, tp=tp, compute_bytes=compute_bytes, **sizes)
    checkpointed = int(m.get("activation_checkpointed_blocks") or 0)
    recomputed = recomputed_block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden)
    return (int(shape["n_layer"]) - checkpointed) * block.total + checkpointed * recomputed
