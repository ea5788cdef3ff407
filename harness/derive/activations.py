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

Recipes that keep bf16 weights (DeepSpeed's bf16 section, FSDP2's MixedPrecisionPolicy; `bf16_weights`) run the
blocks on bf16 parameters without autocast: the residual stream is bf16, the norms get bf16 input, and there are no
weight copies. Measured on the CPU, to the byte, on gpt-tiny's and llama-tiny's blocks and on a second shape each,
`.to(torch.bfloat16)` and fed bf16 input (tests/test_activations.py, tests/test_llama_activations.py):

- GPT's block: the layer norms save their bf16 input (e_n = 2 where autocast's is 4) and every other term is
  autocast's at e_c = 2, but for the norms' statistics: `layer_norm_cpu` keeps its mean and reciprocal deviation in
  its parameters' dtype, bf16 (8 s b where autocast's fp32 ones are 16 s b), where `layer_norm_cuda` keeps them in
  the input's accumulate type, fp32 (aten/src/ATen/native/cuda/layer_norm_kernel.cu; read from code, not measured:
  `fused_norm`, CUDA's kernels). So s b h (4 + 4 + 24 / t) + 8 s b + 4 a s b / t on the CPU, 16 s b on CUDA;
- Llama's block on the CPU: autocast's bf16 terms exactly, less the weight copies. The composite RMSNorm
  (`rms_norm_composite`, aten/src/ATen/native/layer_norm.cpp) upcasts its input to fp32 and multiplies x / rms(x)
  by its weight in fp32, so it keeps an fp32 copy of its bf16 input and the fp32 x / rms(x), the 2 x 4 bytes a value
  autocast's fp32 input costs. On CUDA (`fused_norm`; read from code, not measured) `rms_norm` calls the fused
  kernel, the weight's dtype being the input's, whose backward keeps its bf16 input, its weight and the per-token
  statistic (assumed fp32, the accumulate type `layer_norm_cuda` keeps; its kernel was not read): 2 bytes a value
  for each norm's input, no normalised copy;
- checkpointed, a block keeps its bf16 input: 2 s b h bytes (measured on both; torch's checkpoint is the same code
  on CUDA).

Attention's terms are those above at e_c = 2 on both devices: the CUDA flash kernel saves q, k, v, its output and
the fp32 log-sum-exp as the CPU's does (and two int64 random-number offsets, 16 B a block, which the H200's census
shows and these terms leave out). Tensor parallelism splits the same terms as under autocast (read from the plan in
harness/strategies/tensor_parallel.py; not measured with bf16 weights).

The logits and the loss (`loss_bytes`), measured on the CPU on gpt-tiny's and llama-tiny's heads (fp32, bf16 autocast;
tests/test_loss_memory.py). `Workload.loss` is `cross_entropy(outputs.flatten(0, -2).float(), targets.flatten())`,
which torch runs as `log_softmax` then `nll_loss`, and `accumulate` (harness/strategies/base.py) holds the logits
(`outputs`) while backward runs. With T tokens a micro-batch and V logit columns (the padded vocabulary rows):

- held, from the loss's forward through its backward: the fp32 log-probabilities, 4 T V, which `_log_softmax` saves
  (its derivative reads its result) and `nll_loss` saves again (the same tensor: one storage); and the logits the
  caller holds, e_c T V (2 under autocast or bf16 weights, 4 in fp32, where `.float()` returns the same tensor and
  makes nothing). The fp32 copy `.float()` makes under autocast is saved by nobody and freed with the forward. The
  caller's logits stay held through the blocks' backward too; the log-probabilities go with the loss's backward;
- transient, the loss backward's peak beyond that: `nll_loss_backward`'s gradient, a zeroed 4 T V, and
  `_log_softmax_backward_data`'s output, 4 T V, alive at once: 8 T V. The cast of that gradient back to bf16 under
  autocast (2 T V, `_to_copy`'s backward) comes after both the log-probabilities and nll_loss's gradient are freed,
  so it raises no peak (logits, fp32 gradient and bf16 gradient, 8 T V, under the 6 + 8 T V before it).

Measured on the CPU at T 192, V 512 (micro-batch 3 of gpt-tiny's and llama-tiny's 64 tokens, their padded
vocabularies), with saved_tensors_hooks and a live-tensor tracker: the loss saves 393,216 B (4 T V) and nll_loss's
4-byte total_weight, and the peak of what the head and the loss make, from the head's forward through the loss's
backward, is held + transient to the byte besides the head's own tensors and two fp32 scalars: 1,572,872 B in fp32
(16 T V + 8), 1,466,376 B under autocast (14 T V + 8 + the head's bf16 copies of its input and weight, 2 T h + 2 V h).
Not measured on CUDA, where the loss runs the same ops; an H200 row agrees (gpt2-small, plain loop, bf16 autocast,
T = 16 x 1024, V 50,257 unpadded then: ../shared/gpu-h200/rows.jsonl at a3663fd): its saved-activation census is,
to the byte, the blocks' terms, the 4 T V and total_weight, the position indices, the final norm's and the head's
saved tensors and the flash kernel's offsets (tests/test_loss_memory.py), and its peak allocated bytes are its
weights, its optimizer states, the census and 2 T V + 8 T V to 0.45% of the peak (84 MB above them: 1.02% of the
2 T V + 8 T V, not accounted for).

**A sequence split over ranks** (`cp` ranks: Ulysses, harness/strategies/ulysses.py; torch's ring attention,
harness/strategies/cp.py). A rank holds s / cp of every sample's tokens, and every term above is of its tokens: s / cp
in place of s, the rotary tables too (computed from the rank's positions). Ulysses adds one tensor and drops one:
its core runs on the all-to-alls' q, k and v (every token, a / cp heads: as many values as the rank's tokens' q, k,
v) and saves them and its output; the projection's input is the output's all-to-all back, a tensor of its own (GPT's
12 h becomes 13 h); on the Llama block v is no longer a view keeping wqkv's whole output alive, the all-to-all having
copied it (3 h + 3 h_kv becomes 3 h + 2 h_kv). Measured on the CPU, to the byte, at cp = 2 and 4 on gpt-tiny-long
and at 2 on llama-tiny-long, fp32, whole models (tests/test_long_context_cells.py): the blocks at these terms, the
final norm, head and loss at the rank's s / cp tokens, and the loss's 4-byte total weight. Under autocast the head's
bf16 weight copy does not shrink with the tokens (2 V h bytes). The ring (cp) is at s / cp with nothing added: read
from torch's ring, which saves each rank's q, k, v and output (`_templated_ring_attention`), not measured (no CPU
kernel runs it).

**An MLP of another width, sequence parallelism** (for layouts `harness plan` describes and published runs it lays
out; not measured here). A GPT-style block whose MLP is f wide instead of 4 h (`ffn`) saves GeLU's input and output at
f each: its split term is s b (4 h + 2 f) e_c / t, 12 h at f = 4 h. Under Megatron's sequence parallelism
(Korthikanti et al. 2022, sec. 4.2.2 and Table 2, "tensor + sequence parallel": s b h (34 / t + 5 a s / (h t))) the
norms and the column-parallel layers' inputs, and the norms' per-token statistics, are split along the sequence
over the t ranks as well (`sequence_parallel`: whole / t, the norms' statistics / t); the rest as above.

Under tensor parallelism with `loss_parallel` (harness/strategies/tensor_parallel.py: the head column-parallel, its
logits a DTensor split over the vocabulary) every one of these tensors is T x V / t on each rank, and torch's
loss_parallel (torch/distributed/tensor/parallel/loss.py) computes the loss on the local columns with all-reduces
of one value a token: its log-softmax saves its T x V / t result, and its backward, fused into nll_loss's
(`_nll_loss_and_log_softmax_backward`), keeps a zeroed gradient, exp(log-probabilities) and their sum alive at once,
then the gradient, the sum and their product: 12 T V / t transient, not 8. Measured at t = 2 on the CPU, as rank 0
of torch's FakeProcessGroup (collectives that move nothing: a rank's bytes, not its values), with the CPU allocator's
events: 4 T V / t saved to the byte, and a peak of held + transient + the head's copies and 6,348 B (33 B a token)
of the per-token index and mask tensors loss_parallel adds, which the terms leave out. Without `loss_parallel` the
head and its logits are whole on every tensor-parallel rank: t = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.spec import DeviceKind

LAYER_NORM_INPUT_BYTES = 4          # the residual stream is fp32 (autocast keeps layer norms in fp32)
LAYER_NORM_STATISTICS_BYTES = 16    # two layer norms x (mean, reciprocal deviation) x fp32, per token
LOG_SUM_EXP_BYTES = 4               # fp32, per head and token
RMS_NORM_STATISTICS_BYTES = 8       # two RMSNorms x a reciprocal root mean square x fp32, per token
BF16_BYTES = 2                      # under bf16 weights: the residual stream, the norms' inputs, every activation
LOG_PROBS_BYTES = 4                 # the loss's log-softmax output: fp32 (`.float()` before cross_entropy)
LOSS_BACKWARD_TRANSIENT = 8         # nll_loss's zeroed gradient + log_softmax backward's output, fp32, per logit
LOSS_PARALLEL_TRANSIENT = 12        # loss_parallel's fused backward: gradient, exp(log-probs), their sum, per logit


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


def _check_bf16_weights(bf16_weights: bool, compute_bytes: int) -> None:
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes must be 4 (fp32) or 2 (bf16 autocast), got {compute_bytes}")
    if bf16_weights and compute_bytes != BF16_BYTES:
        raise ValueError(f"bf16_weights computes in bf16: compute_bytes must be 2, got {compute_bytes}")


def block_activations(*, seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                      compute_bytes: int = 4, bf16_weights: bool = False, fused_norm: bool = False,
                      ffn: int | None = None, sequence_parallel: bool = False, cp: int = 1,
                      ulysses: bool = False) -> BlockActivations:
    """The bytes above for a block of `hidden` features and `heads` heads on `micro_batch` samples of `seq_len`
    tokens, split over `tp` ranks, computing in `compute_bytes` per value (4: fp32, 2: bf16 autocast, or bf16 weights
    where `bf16_weights`: a bf16 residual stream and no weight copies). `fused_norm` where the layer norms are CUDA's
    kernel, which keeps its statistics in fp32 under bf16 weights too (the CPU's keeps them in bf16); it changes
    nothing in fp32 or under autocast. `ffn`: the MLP's width (None: 4 h, the workloads'); `sequence_parallel`:
    Megatron's, splitting the whole terms and the norms' statistics over the `tp` ranks (module docstring); `cp`: the
    ranks the sequence is split over (context parallelism, module docstring's "A sequence split over ranks"), with
    `ulysses` where DeepSpeed-Ulysses' all-to-alls surround the attention core."""
    if tp < 1 or heads % tp or hidden % heads:
        raise ValueError(f"tensor parallelism of {tp} must divide the {heads} heads, which must divide {hidden}")
    _check_bf16_weights(bf16_weights, compute_bytes)
    _check_split(seq_len, cp, heads if ulysses else cp)
    tokens = seq_len // cp * micro_batch
    values = tokens * hidden
    norm_input_bytes = BF16_BYTES if bf16_weights else LAYER_NORM_INPUT_BYTES
    # The CPU's layer norm keeps its statistics in its parameters' dtype: half of the fp32 ones under bf16 weights.
    norm_statistics = LAYER_NORM_STATISTICS_BYTES // (2 if bf16_weights and not fused_norm else 1)
    width = 4 * hidden if ffn is None else ffn
    along_sequence = tp if sequence_parallel else 1
    return BlockActivations(
        whole=values * (2 * norm_input_bytes + 2 * compute_bytes) / along_sequence,
        split=tokens * (4 * hidden + 2 * width + (hidden if ulysses else 0)) * compute_bytes / tp,
        statistics=norm_statistics * tokens / along_sequence + LOG_SUM_EXP_BYTES * heads * tokens / tp,
        weight_copies=2 * (4 * hidden + 2 * width) * hidden / tp if compute_bytes == 2 and not bf16_weights else 0.0)


def _check_split(seq_len: int, cp: int, heads: int) -> None:
    if cp < 1 or seq_len % cp or heads % cp:
        raise ValueError(f"a sequence split over cp = {cp} ranks must divide its {seq_len} tokens (and, under "
                         f"Ulysses, the {heads} heads)")


def llama_block_activations(*, seq_len: int, micro_batch: int, hidden: int, heads: int, kv_heads: int,
                            intermediate: int, tp: int = 1, compute_bytes: int = 4, fused_norm: bool = False,
                            bf16_weights: bool = False, sequence_parallel: bool = False, cp: int = 1,
                            ulysses: bool = False) -> BlockActivations:
    """The Llama block's bytes (module docstring) for `hidden` features, `heads` query heads and `kv_heads`
    key/value heads, an MLP `intermediate` wide, on `micro_batch` samples of `seq_len` tokens, split over `tp`
    ranks, computing in `compute_bytes` per value; `fused_norm` where RMSNorm is torch's fused kernel (CUDA),
    which keeps no normalised copy of its input; `bf16_weights` where the block's parameters are bf16 and no
    autocast runs (no weight copies; the fused kernel's input bf16, the composite's fp32 copies as under
    autocast); `sequence_parallel`, `cp` and `ulysses` as `block_activations` takes them."""
    if tp < 1 or heads % tp or kv_heads % tp or intermediate % tp:
        raise ValueError(f"tensor parallelism of {tp} must divide the {heads} heads, the {kv_heads} key/value heads "
                         f"and the MLP's width {intermediate}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"the {heads} heads must divide {hidden}, and the {kv_heads} key/value heads the heads")
    _check_bf16_weights(bf16_weights, compute_bytes)
    _check_split(seq_len, cp, kv_heads if ulysses else cp)
    tokens = seq_len // cp * micro_batch
    head_dim = hidden // heads
    kv_width = kv_heads * head_dim
    # wqkv's output whole (v is a view of it), the rotated q and k, the attention's output; gate|up, silu, product.
    # Under Ulysses the core saves the all-to-alls' q, k and v, wo's input is the output's exchange, not a view.
    split_width = (3 * hidden + 2 * kv_width if ulysses else 3 * hidden + 3 * kv_width) + 4 * intermediate
    # The composite upcasts a bf16 input to fp32 (x and x / rms(x), fp32, on either recipe); the fused kernel keeps
    # its input as it came: the fp32 residual stream under autocast, the bf16 one under bf16 weights.
    if fused_norm:
        norm_input_bytes = BF16_BYTES if bf16_weights else LAYER_NORM_INPUT_BYTES
    else:
        norm_input_bytes = 2 * LAYER_NORM_INPUT_BYTES
    copies = 2 * hidden * (2 * hidden + 2 * kv_width + 3 * intermediate) / tp
    along_sequence = tp if sequence_parallel else 1
    return BlockActivations(
        whole=tokens * hidden * (2 * norm_input_bytes + 2 * compute_bytes) / along_sequence,
        split=tokens * split_width * compute_bytes / tp,
        statistics=RMS_NORM_STATISTICS_BYTES * tokens / along_sequence + LOG_SUM_EXP_BYTES * heads * tokens / tp,
        weight_copies=copies if compute_bytes == 2 and not bf16_weights else 0.0,
        rotary=2 * seq_len // cp * head_dim * compute_bytes)


def block_bytes(*, seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, compute_bytes: int = 4,
                kv_heads: int | None = None, intermediate: int | None = None, fused_norm: bool = False,
                bf16_weights: bool = False, ffn: int | None = None,
                sequence_parallel: bool = False, cp: int = 1, ulysses: bool = False) -> BlockActivations:
    """A GPT block's bytes (`block_activations`, its MLP `ffn` wide), or a Llama block's (`llama_block_activations`)
    where its `intermediate` width is given (`kv_heads` then defaulting to `heads`); `fused_norm` (CUDA's norm
    kernels), `bf16_weights` and `sequence_parallel` passed on to either."""
    if intermediate is None:
        return block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp,
                                 compute_bytes=compute_bytes, bf16_weights=bf16_weights, fused_norm=fused_norm,
                                 ffn=ffn, sequence_parallel=sequence_parallel, cp=cp, ulysses=ulysses)
    return llama_block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads,
                                   kv_heads=heads if kv_heads is None else kv_heads, intermediate=intermediate,
                                   tp=tp, compute_bytes=compute_bytes, fused_norm=fused_norm,
                                   bf16_weights=bf16_weights, sequence_parallel=sequence_parallel, cp=cp,
                                   ulysses=ulysses)


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


def recomputed_block_activations(*, seq_len: int, micro_batch: int, hidden: int, bf16_weights: bool = False) -> float:
    """The bytes a block checkpointed whole keeps for backward, per micro-batch (full recomputation: Korthikanti
    et al. 2022, sec. 5 and Table 2, "full recompute", 2 s b h a layer at their 2-byte activations): its input
    alone, the fp32 residual stream (LAYER_NORM_INPUT_BYTES, under autocast too; the bf16 one under
    `bf16_weights`), whole on every tensor-parallel rank; everything else, the bf16 weight copies (and a Llama
    block's rotary tables) included, is made again in backward. Measured with torch's non-reentrant checkpoint on
    GPT's block and Llama's, fp32, autocast and bf16 weights (tests/test_activations.py,
    tests/test_llama_activations.py)."""
    return (BF16_BYTES if bf16_weights else LAYER_NORM_INPUT_BYTES) * seq_len * micro_batch * hidden


def rank_activation_bytes(*, seq_len: int, micro_batch: int, hidden: int, heads: int, layers: int, compute_bytes: int,
                          tensor_parallel: int = 1, stages: int = 1, micro_batches: int = 1,
                          checkpointed: bool = False, kv_heads: int | None = None, intermediate: int | None = None,
                          fused_norm: bool = False, bf16_weights: bool = False) -> float:
    """What the busiest rank's blocks hold for backward at their peak, for a layout: each block whole
    (`block_bytes` at `tensor_parallel`: GPT's, or Llama's where `intermediate` is given) or, `checkpointed`, its
    input alone (`recomputed_block_activations`), times the blocks of a stage, ceil(layers / stages), times the
    micro-batches a stage holds in flight: under 1F1B at most the pipeline's depth (Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2.1), so
    min(stages, micro_batches) at the first stage, the busiest; one without a pipeline, whose micro-batches run
    forward and backward one after another. `bf16_weights` for a recipe that keeps bf16 weights (module docstring)."""
    if checkpointed:
        per_block = recomputed_block_activations(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden,
                                                 bf16_weights=bf16_weights)
    else:
        per_block = block_bytes(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads,
                                tp=tensor_parallel, compute_bytes=compute_bytes, kv_heads=kv_heads,
                                intermediate=intermediate, fused_norm=fused_norm, bf16_weights=bf16_weights).total
    return -(-layers // stages) * min(stages, micro_batches) * per_block


@dataclass(frozen=True, kw_only=True)
class LossBytes:
    """Bytes the logits and the loss hold on one rank, per micro-batch (module docstring, "The logits and the
    loss")."""

    saved: float        # the fp32 log-probabilities autograd keeps for backward (a saved-activation census counts them)
    logits: float       # the logits the caller holds while backward runs, in the compute dtype (no census counts them)
    transient: float    # what the loss's backward adds at its peak, beyond `held`

    @property
    def held(self) -> float:
        return self.saved + self.logits

    @property
    def peak(self) -> float:
        return self.held + self.transient


def loss_bytes(*, tokens: int, vocab_rows: int, compute_bytes: int, tp: int = 1,
               loss_parallel: bool = False) -> LossBytes:
    """The logits' and the loss's bytes on one rank for `tokens` tokens a micro-batch and `vocab_rows` logit columns
    (a workload's `padded_vocab_size`), the logits in `compute_bytes` per value (4: fp32; 2: bf16 autocast or bf16
    weights): held, 4 T V saved + e_c T V logits; transient, 8 T V (nll_loss's gradient and log_softmax backward's
    output at once). With `loss_parallel` (torch's, over `tp` tensor-parallel ranks) every term is T x V / t and the
    transient 12 T V / t (its fused backward). Without it the logits are whole on every rank, whatever the tensor
    parallelism: `tp` must then be 1."""
    if tokens < 1 or vocab_rows < 1:
        raise ValueError(f"tokens and vocab_rows must be >= 1, got {tokens} and {vocab_rows}")
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes must be 4 (fp32) or 2 (bf16), got {compute_bytes}")
    if tp < 1 or vocab_rows % tp:
        raise ValueError(f"the logits' {vocab_rows} columns must split evenly over tp = {tp} ranks")
    if tp > 1 and not loss_parallel:
        raise ValueError(f"only loss_parallel splits the logits: tp must be 1 without it, got {tp}")
    logits = tokens * vocab_rows / tp
    return LossBytes(saved=LOG_PROBS_BYTES * logits, logits=compute_bytes * logits,
                     transient=(LOSS_PARALLEL_TRANSIENT if loss_parallel else LOSS_BACKWARD_TRANSIENT) * logits)


def fused_loss_bytes(*, tokens: int, vocab_rows: int, compute_bytes: int) -> LossBytes:
    """A fused cross-entropy's bytes (flash-attention's, flash_attn/ops/triton/cross_entropy.py at 0251105a: its
    forward saves the logits, an fp32 log-sum-exp and the labels, its backward writes the logits' gradient into a
    new tensor like them unless `inplace_backward`), which llm-foundry's MPT trains with by default
    (`loss_fn='fused_crossentropy'`, llmfoundry/models/mpt/modeling_mpt.py at 8c8dd48): the logits held, e_c T V,
    and their gradient, e_c T V, at the backward's peak; 4 T of log-sum-exp. Read from the code, not measured: the
    published runs' loss (harness.project.published_runs), not the workloads'."""
    if tokens < 1 or vocab_rows < 1:
        raise ValueError(f"tokens and vocab_rows must be >= 1, got {tokens} and {vocab_rows}")
    logits = tokens * vocab_rows
    return LossBytes(saved=LOG_SUM_EXP_BYTES * tokens, logits=compute_bytes * logits,
                     transient=compute_bytes * logits)


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
    the terms describe with `bf16_weights` but rows are not predicted with here yet), and for sequence
    parallelism, whose saved tensors these terms have not been checked against (tests/test_activations.py
    measures tp without it)."""
    shape = m.get("workload_description") or {}
    if shape.get("family") not in ("gpt", "llama") or row_spec["strategy"] == "pipeline":
        return None
    if (m.get("strategy_config") or {}).get("sequence_parallel"):
        return None
    if m.get("precision_recipe") not in ("fp32", "autocast"):
        return None
    tp = int((m.get("strategy_config") or {}).get("tensor_parallel") or 1)
    # A sequence split over ranks (harness.strategies.sequence_parallel): each rank's tokens, Ulysses' exchanges.
    cp = int((m.get("strategy_config") or {}).get("sequence_split") or 1)
    ulysses = (m.get("strategy_config") or {}).get("sequence_attention") == "ulysses"
    # Autocast computes in 2 bytes at bf16 and fp16 alike (gpt2-small's fp16 autocast row on an H200 saved what its
    # bf16 one did, 4 B apart: ../shared/gpu-h200/rows.jsonl).
    compute_bytes = 2 if row_spec["precision"] in ("bf16", "fp16") else 4
    sizes = block_sizes(shape, device=str(row_spec.get("device") or "cpu"), compute_bytes=compute_bytes)
    if sizes is None:
        return None
    seq_len, micro_batch, hidden = int(shape["seq_len"]), int(row_spec["micro_batch"]), int(shape["n_embd"])
    block = block_bytes(seq_len=seq_len, micro_batch=micro_batch, tp=tp, compute_bytes=compute_bytes, cp=cp,
                        ulysses=ulysses, **sizes)
    checkpointed = int(m.get("activation_checkpointed_blocks") or 0)
    recomputed = recomputed_block_activations(seq_len=seq_len // cp, micro_batch=micro_batch, hidden=hidden)
    return (int(shape["n_layer"]) - checkpointed) * block.total + checkpointed * recomputed
