"""Every byte that decides whether a layout of a described decoder fits one GPU, each a named term, for the busiest
GPU of the layout (`harness plan`, `harness memory`):

    python -c "from harness.project.rank_memory import ALLOWANCE_GIB; print(ALLOWANCE_GIB)"

- **model states**: the strategy's plan (`Strategy.model_state_plan`, the ZeRO paper's sec. 5.1 sharding) over
  the parameters a rank holds (`Decoder.held_by_rank`: its tensor-parallel and pipeline share, the norms, the
  row-parallel biases, the embeddings and an untied head whole on every tensor-parallel rank, an MoE model's
  routed experts over the expert-parallel ranks);
- **activations** (at a rank's s / cp tokens where a sequence is split over cp ranks): what the blocks save for backward, by the family's own block formula
  (harness.derive.activations: GPT's or Llama's, measured on the workloads' blocks) under the layout's recipe,
  x the blocks of a stage x the micro-batches in flight (1F1B: min(stages, K) at the first stage, 1 at the
  last); checkpointed, each block's input and one block whole, the one being recomputed; an MoE block as Llama's
  with its MLP as wide as the experts a token runs, and the routing's copies (`routing_bytes`, projected);
- **logits and loss**: on the GPU that holds the head (the last stage), the logits and the loss as the
  workloads compute them (harness.derive.activations.loss_bytes: held for backward, and what the loss's
  backward adds at its peak), over the vocabulary rows, split where loss parallelism splits them; a published
  run's own fused cross-entropy where it says so (`fused_loss_bytes`);
- **the strategy's working memory** (`Strategy.working_memory_bytes`): its buckets (DDP's without bucket views,
  DeepSpeed's reduction buckets, Horovod's fusion buffer), parameters gathered from their shards (ZeRO-3, FSDP2),
  FSDP2's unsharded gradients kept across micro-batches with gradient sync off;
- **allowance**: ALLOWANCE_GIB, stated, not measured (below).

A layout fits when the sum is at most the GPU's memory: no margin beyond the allowance does any work. Not counted:
the caching allocator's slack between reserved and allocated bytes (on the H200 rows 5-21% of the peak;
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True keeps it small), and the memory of the pipeline's tied-weight
copies and uneven stages.

Torch-free: the strategies' facts come through harness.project.facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from harness.derive import activations as formulas
from harness.derive.memory import ModelSplit, RankParameters, plan_bytes
from harness.project.model import Decoder, Mlp

GIB = float(1 << 30)

# What a process cannot use of a GPU's stated memory, stated rather than measured: the driver's reservation (an
# "80 GB" H100 or A100 reports about 79.2 GiB of total capacity to torch, against the presets' 80), the CUDA
# context with cuBLAS's workspaces (about 0.5-1 GiB), and NCCL's buffers (NCCL_BUFFSIZE, 4 MiB, for each channel
# of each peer of each communicator and protocol: hundreds of MiB a communicator at 32 channels).
ALLOWANCE_GIB = 2.5
ALLOWANCE_TEXT = (f"{ALLOWANCE_GIB:g} GiB stated for the driver's reservation (an 80 GB GPU reports 79.2 GiB to "
                  "torch), the CUDA context and cuBLAS's workspaces, and NCCL's buffers")

# Recipes whose weights are 16-bit: no autocast copies, a 16-bit residual stream (harness.derive.activations).
SIXTEEN_BIT_WEIGHTS = ("deepspeed-bf16", "deepspeed-fp16", "fsdp-mp-policy")
# Bytes a value the blocks compute in, by recipe: 4 in fp32, 2 under autocast or with 16-bit weights.
COMPUTE_BYTES = {"fp32": 4, "autocast": 2, "deepspeed-bf16": 2, "deepspeed-fp16": 2, "fsdp-mp-policy": 2}


@dataclass(frozen=True, kw_only=True)
class MemoryTerms:
    """The bytes of one GPU of a layout, by term; `working` the strategy's own, by the names it gives them."""

    states: float
    activations: float
    logits: float
    working: Mapping[str, float] = field(default_factory=dict)
    allowance: float = ALLOWANCE_GIB * GIB
    where: str = ""             # which GPU of the layout these are: "" (all alike), "first stage", "last stage"

    @property
    def working_total(self) -> float:
        return float(sum(self.working.values()))

    @property
    def total(self) -> float:
        return self.states + self.activations + self.logits + self.working_total + self.allowance

    def terms(self) -> dict[str, float]:
        """Every term by name, the strategy's working memory by its own names."""
        return {"model states": self.states, "activations": self.activations, "logits and loss": self.logits,
                **dict(self.working), "allowance": self.allowance}

    def describe(self) -> str:
        """'61.2 = 1.6 states + 40.5 activations + ...' in GiB, the terms that hold anything."""
        parts = [f"{value / GIB:.1f} {name}" for name, value in self.terms().items() if value]
        where = f" ({self.where})" if self.where else ""
        return f"{self.total / GIB:.1f}{where} = " + " + ".join(parts)


def block_bytes(model: Decoder, *, micro_batch: int, recipe: str, tensor_parallel: int,
                sequence_parallel: bool = False, context_parallel: int = 1, ulysses: bool = False) -> float:
    """One block's saved bytes on a tensor-parallel rank at `micro_batch` samples (harness.derive.activations: the
    family's block, the recipe's compute bytes, its weight copies under autocast)."""
    compute = COMPUTE_BYTES[recipe]
    # CUDA's norm kernels (`fused_norm`): the fused RMSNorm keeps no normalised copy of its input, the layer norm
    # its statistics in fp32 (harness.derive.activations).
    sizes: dict[str, Any] = dict(seq_len=model.seq_len, micro_batch=micro_batch, hidden=model.hidden,
                                 heads=model.heads, tp=tensor_parallel, compute_bytes=compute, fused_norm=True,
                                 bf16_weights=recipe in SIXTEEN_BIT_WEIGHTS, sequence_parallel=sequence_parallel,
                                 cp=context_parallel, ulysses=ulysses)
    if model.mlp is Mlp.SWIGLU:
        sizes.update(kv_heads=model.kv_heads_count, intermediate=model.ffn_width * model.mlps_a_token)
    else:
        sizes.update(ffn=model.ffn_width)
    return formulas.block_bytes(**sizes).total + routing_bytes(model, micro_batch=micro_batch, recipe=recipe)


def routing_bytes(model: Decoder, *, micro_batch: int, recipe: str) -> float:
    """What an MoE block keeps beyond Llama's block with its MLP top_k (+ shared) experts wide, which `block_bytes`
    counts: each token's top_k dispatched copies of its hidden state (the experts' input, saved for their weights'
    gradients) and their outputs (saved for the combine's weighting by the router), in the compute bytes, and the
    router's logits and probabilities over the experts in fp32. Projected from the shapes, not measured on an MoE
    block (Llama's block formula is: harness.derive.activations); 0 for a dense block."""
    if not model.is_moe:
        return 0.0
    tokens = model.seq_len * micro_batch
    return tokens * (2 * model.top_k * model.hidden * COMPUTE_BYTES[recipe] + 2 * model.experts * 4)


def activation_bytes(model: Decoder, split: ModelSplit, *, micro_batch: int, micro_batches: int, recipe: str,
                     checkpointed: bool, in_flight: int, sequence_parallel: bool = False, context_parallel: int = 1,
                     ulysses: bool = False) -> float:
    """The blocks of one stage at `in_flight` micro-batches held for backward (module docstring)."""
    blocks = -(-model.layers // split.pipeline_stages)
    whole = block_bytes(model, micro_batch=micro_batch, recipe=recipe, tensor_parallel=split.tensor_parallel,
                        sequence_parallel=sequence_parallel, context_parallel=context_parallel, ulysses=ulysses)
    if not checkpointed:
        return blocks * in_flight * whole
    kept = formulas.recomputed_block_activations(seq_len=model.seq_len // context_parallel, micro_batch=micro_batch,
                                                 hidden=model.hidden, bf16_weights=recipe in SIXTEEN_BIT_WEIGHTS)
    if sequence_parallel:
        kept /= split.tensor_parallel
    return blocks * in_flight * kept + whole       # the block being recomputed holds its whole activations


# How the loss is computed: the workloads' (log_softmax and nll_loss over fp32 logits), or a fused cross-entropy
# (flash-attention's, which llm-foundry trains MPT with): harness.derive.activations.
WORKLOADS_LOSS, FUSED_LOSS = "workloads", "fused"


def logits_bytes(model: Decoder, *, micro_batch: int, recipe: str, vocabulary_split: int = 1,
                 loss: str = WORKLOADS_LOSS, context_parallel: int = 1) -> float:
    """The logits and the loss of one micro-batch at the loss's backward peak, held and transient
    (harness.derive.activations.loss_bytes, or fused_loss_bytes for a `loss` that is not the workloads'), split
    over the tensor-parallel ranks by loss parallelism (`vocabulary_split` > 1) or whole on each."""
    if not model.vocab:
        return 0.0
    tokens, compute = model.seq_len // context_parallel * micro_batch, COMPUTE_BYTES[recipe]
    if loss == FUSED_LOSS:
        return formulas.fused_loss_bytes(tokens=tokens, vocab_rows=model.vocab, compute_bytes=compute).peak
    found = formulas.loss_bytes(tokens=tokens, vocab_rows=model.vocab, compute_bytes=compute, tp=vocabulary_split,
                                loss_parallel=vocabulary_split > 1)
    return found.peak


def rank_parameters(model: Decoder, split: ModelSplit, micro_batches: int, vocabulary_split: bool,
                    expert_parallel: int = 1) -> RankParameters:
    """What a rank of `split` holds of `model` (its experts over `expert_parallel` ranks), for the strategy's
    working memory."""
    t, stages = split.tensor_parallel, split.pipeline_stages
    unit = model.block_parameters_held(t) - model.routed_expert_parameters / model.layers * (1 - 1 / expert_parallel)
    vocabulary = model.embedding_parameters / (t if vocabulary_split else 1)
    outside = model.held_by_rank(t, 1, vocabulary_split, expert_parallel) - model.layers * unit
    return RankParameters(held=model.held_by_rank(t, stages, vocabulary_split, expert_parallel), unit=unit,
                          outside_blocks=outside / (1 if stages == 1 else 2), largest_module=max(unit, vocabulary),
                          data_parallel=split.data_parallel, micro_batches=micro_batches)


def layout_memory(*, model: Decoder, strategy: str, options: Mapping[str, Any], split: ModelSplit, recipe: str,
                  micro_batch: int, micro_batches: int, checkpointed: bool, facts: Any,
                  sequence_parallel: bool = False, vocabulary_split: bool = False,
                  loss: str = WORKLOADS_LOSS, expert_parallel: int = 1, context_parallel: int = 1,
                  ulysses: bool = False) -> MemoryTerms:
    """The busiest GPU's MemoryTerms: with pipeline stages, the larger of the first stage (most micro-batches in
    flight) and the last (one in flight, the logits); `loss` the workloads' unless a published run says."""
    rank = rank_parameters(model, split, micro_batches, vocabulary_split, expert_parallel)
    plan = facts.model_state_plan(strategy, options, split.data_parallel, recipe)
    states = plan_bytes(plan, rank.held)["total"]
    if model.is_moe and expert_parallel > 1:
        # The rank's experts under the strategy's plan over the ranks holding the same ones (ZeRO shards their states
        # there: DeepSpeed-MoE's expert data parallelism), the rest over every data-parallel rank.
        experts = model.routed_expert_parameters / expert_parallel / split.pipeline_stages
        over = facts.model_state_plan(strategy, options, max(1, split.data_parallel // expert_parallel), recipe)
        states = plan_bytes(plan, rank.held - experts)["total"] + plan_bytes(over, experts)["total"]
    working = facts.working_memory(strategy, options, rank, recipe)
    logits = logits_bytes(model, micro_batch=micro_batch, recipe=recipe,
                          vocabulary_split=split.tensor_parallel if vocabulary_split else 1, loss=loss,
                          context_parallel=context_parallel)
    shared = dict(micro_batch=micro_batch, micro_batches=micro_batches, recipe=recipe, checkpointed=checkpointed,
                  sequence_parallel=sequence_parallel, context_parallel=context_parallel, ulysses=ulysses)
    if split.pipeline_stages == 1:
        acts = activation_bytes(model, split, in_flight=1, **shared)
        return MemoryTerms(states=states, activations=acts, logits=logits, working=working)
    first = MemoryTerms(states=states, working=working, logits=0.0, where="first stage",
                        activations=activation_bytes(model, split, in_flight=min(split.pipeline_stages,
                                                                                 micro_batches), **shared))
    last = MemoryTerms(states=states, working=working, logits=logits, where="last stage",
                       activations=activation_bytes(model, split, in_flight=1, **shared))
    return max(first, last, key=lambda terms: terms.total)
