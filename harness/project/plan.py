"""Every layout of a described decoder on a described cluster: every byte it needs on a GPU, whether it fits, its
projected step with a range, and those that fit ranked, the ones equivalent within the error grouped
(`python -m harness plan`).

    python -m harness plan --model llama3-8b --cluster dgx-h100-ib --nodes 1 --tokens 1e9
    python -m harness plan --params 7B --shape 4096,4096,32,32,32000 --cluster dgx-h100-ib --nodes 8 --tokens 1e9

Projected from a description alone, no measured row (docs/projection.md, "Planning a layout"):

- **layouts** over G = nodes x GPUs per node: DDP, Horovod, ZeRO-1/2/3 and FSDP2 at dp = G; `fsdp2-tp` and
  `autotp` (ZeRO-1 across) at each tensor-parallel degree t that divides the heads, the key/value heads and a
  node's GPUs, dp = G / t; `tp` alone at t = G (one replica); the pipeline at each stage count S that divides the
  blocks and G, dp = G / S; FSDP2 and fsdp2-tp also reduce-scattering every micro-batch (`gradient_sync=every`)
  where a replica runs more than one; a sequence split over P ranks at each P that divides G and the sequence:
  `ulysses` (ZeRO-1, 2 and 3; P dividing the heads and the key/value heads) and torch's ring `cp` (FSDP2), dp =
  G / P replicas of the batch, the states sharded over all G; each with activation checkpointing off and on (every
  block). Each in the
  recipe its users run (`Strategy.usual_mixed_recipe`: FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16 section,
  torch.autocast elsewhere) unless --recipe names one for all. Offload is left out: its step is the host's
  optimizer and PCIe copies, which nothing here prices.
- **memory**: every term of harness.project.rank_memory (model states, activations, logits and loss, the
  strategy's buckets, gathered parameters and accumulated gradients, the stated allowance); a layout fits when
  their sum is at most the GPU's memory.
- **micro-batch**: the largest power of two dividing a replica's share of the global batch that fits (the
  pipeline: of those that fit, the one of least step time, since more and smaller micro-batches shrink its
  bubble), or the one given.
- **step** = compute + exposed communication (harness.project.layouts prices both): compute at the compute MFU
  of the model fitted on published GPU runs (harness.project.mfu_model) for the cluster's GPU, the model's size and
  recomputation, or --mfu; of the communication, the fitted fraction of the data-parallel collectives and all of
  tensor parallelism's and the pipeline's.
- **confidence and range**: compute's is the MFU model's held-out error on published runs; communication's the
  strategy's record on the emulated clusters (harness.project.confidence). A row's range is its compute +/- the
  held-out median error and its exposed communication +/- the strategy's median error: a typical band, not a
  bound. Layouts whose range overlaps the fastest one's are **equivalent within the error**, one group; the plan
  follows the group's simplest layout (SIMPLICITY).
- **figures**: tokens/s per GPU; TFLOP/s per GPU and MFU of the model's FLOPs (recomputation is not useful work,
  PaLM's convention); GPU-hours for the stated tokens (G GPUs x the wall time).

Torch-free like the rest of harness.project: the strategies' facts come through harness.project.facts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from harness.derive.peaks import PEAKS
from harness.project.cluster import Cluster
from harness.project.confidence import confidence
from harness.project.facts import REGISTRY_FACTS, RegistryFacts
from harness.project.collectives import ClusterModel
from harness.project.layouts import (DATA_PARALLEL, MESH, RECIPE_MATH, RECOMPUTE_FACTOR, Layout, layout_at,
                                     memory_of, peak_flops, price_step, shape_refusal)
from harness.project.mfu_model import Validation, data_parallel_seconds, validation
from harness.project.model import Decoder
from harness.project.projection import Scheduled, comm_seconds
from harness.project.rank_memory import ALLOWANCE_TEXT, GIB, MemoryTerms
from harness.spec import SpecError

CHECKPOINTING = ("none", "blocks")          # the strategies' activation_checkpointing option
# --recipe: each strategy's own users' recipe, or one for every layout.
USERS = "users"
RECIPES = (USERS, "autocast", "fp32")
DEFAULT_RECIPE = USERS
# Llama 2's batch (Touvron et al. 2023, sec. 2.2: "a global batch-size of 4M tokens"): 2^22 = 1024 x 4096 tokens.
DEFAULT_GLOBAL_BATCH_TOKENS = 4 * 2 ** 20
# Simplest first, for the group a plan follows: one launcher and no sharding (DDP), then sharding of growing depth,
# then Horovod (its own launcher and build), then tensor parallelism and the pipeline, which change the model's code.
SIMPLICITY = ("ddp", "zero1", "zero2", "fsdp2", "zero3", "horovod", "ep", "deepspeed-moe", "ulysses", "cp", "tp",
              "fsdp2-tp", "autotp", "pipeline")
# A sequence split over P ranks, at each P from 2 that divides the GPUs and the sequence (twice over for the ring's
# head-tail chunks; Ulysses' also the heads and the key/value heads): Ulysses under ZeRO-1, 2 and 3, torch's ring
# under FSDP2 (harness.matrix.long_context's strategies).
ULYSSES_STAGES = (1, 2, 3)
# An MoE model's layouts: the moe matrix's baselines with every expert replicated (harness.matrix.moe: DDP, FSDP2),
# and expert parallelism at each degree that divides the experts and the GPUs: `ep` (DDP's copies) and deepspeed-moe
# under ZeRO-1 and ZeRO-2. The other strategies' cells of the MoE family are not run here (harness.matrix.moe), so
# they are not laid out for one.
MOE_REPLICATED = ("ddp", "fsdp2")
# FSDP's layouts that also run reduce-scattering every micro-batch.
GRADIENT_SYNC_EVERY = ("fsdp2", "fsdp2-tp", "cp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """What the plan assumes besides the model and the cluster."""

    global_batch: int                       # samples a step
    tokens: float                           # to train, for the GPU-hours
    recipe: str = DEFAULT_RECIPE
    mfu: float | None = None                # None: the MFU model's compute MFU
    micro_batch: int | None = None          # None: the largest power of two that fits
    peak_flops: float | None = None         # None: the cluster's GPU's datasheet peak

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise SpecError(f"--recipe {self.recipe!r}: allowed {', '.join(RECIPES)} ({USERS}: each strategy's own "
                            "mixed recipe, the one its users run)")
        if self.mfu is not None and not (0 < self.mfu <= 1):
            raise SpecError(f"--mfu must be a fraction of the peak in (0, 1], got {self.mfu!r}")
        if self.global_batch < 1 or not (self.tokens > 0 and math.isfinite(self.tokens)):
            raise SpecError("the global batch must be >= 1 sample and --tokens a finite number > 0")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise SpecError(f"--micro-batch must be >= 1, got {self.micro_batch}")
        if self.peak_flops is not None and not (self.peak_flops > 0 and math.isfinite(self.peak_flops)):
            raise SpecError(f"--peak-tflops must be a finite number > 0, got {self.peak_flops!r}")


@dataclass(frozen=True, kw_only=True)
class Planned:
    """One layout: its memory at the micro-batch chosen (or the smallest, where none fits), and where it fits its
    step, its range and what follows from them; `refusal` where it cannot be laid out at all."""

    layout: Layout
    refusal: str = ""
    micro_batch: int | None = None
    micro_batches: int | None = None        # a replica's per step
    memory: MemoryTerms | None = None
    gpu_bytes: float | None = None          # one GPU's memory
    compute_mfu: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None             # all of it, as priced
    exposed_s: float | None = None          # what the step waits for
    step_s: float | None = None
    step_low_s: float | None = None
    step_high_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    gpu_hours: float | None = None
    schedule: tuple[Scheduled, ...] = field(default=())
    all_to_all_s: float = 0.0               # expert parallelism's all-to-alls a step, all exposed
    unfit_step_s: float | None = None       # an expert layout that does not fit: its step at the smallest micro-batch
    tied: bool = False                      # within the error of the fastest

    @property
    def need_bytes(self) -> float | None:
        return None if self.memory is None else self.memory.total

    @property
    def fits(self) -> bool:
        return not self.refusal and self.step_s is not None

    @property
    def communication_confidence(self) -> str:
        found = confidence(self.layout.strategy)
        return found.text if found is not None else "no committed validation"

    @property
    def simplicity(self) -> tuple:
        s = self.layout.split
        return ((s.tensor_parallel > 1) + (s.pipeline_stages > 1) + (self.layout.context_parallel > 1),
                self.layout.checkpointed,
                SIMPLICITY.index(self.layout.strategy), self.layout.options_dict.get("gradient_sync") == "every",
                s.tensor_parallel, s.pipeline_stages)


def gpu_figures(cluster: Cluster, settings: Settings) -> tuple[float, float]:
    """(peak FLOP/s of one GPU in 16-bit math, or fp32's under --recipe fp32, its memory in bytes); a one-line
    SpecError where the cluster does not describe its GPU."""
    if settings.peak_flops is None and not cluster.gpu:
        raise SpecError(f"cluster {cluster.name!r} names no gpu (a device of harness.derive.peaks): add one, "
                        "--set \"gpu=NVIDIA H100 80GB HBM3\", or give --peak-tflops")
    if cluster.gpu_memory_GiB is None:
        raise SpecError(f"cluster {cluster.name!r} gives no gpu_memory_GiB: add it, e.g. --set gpu_memory_GiB=80")
    recipe = "fp32" if settings.recipe == "fp32" else "autocast"
    peak = settings.peak_flops if settings.peak_flops is not None else peak_flops(cluster, recipe)
    return peak, cluster.gpu_memory_GiB * GIB


def recipe_for(strategy: str, settings: Settings, facts: RegistryFacts) -> tuple[str, dict[str, Any]]:
    """(the recipe a layout of `strategy` runs, the options that select it): its users' where --recipe is
    `users` and it can run it (fsdp2-tp cannot run the MixedPrecisionPolicy: torch.autocast), else --recipe's."""
    if settings.recipe != USERS:
        return settings.recipe, {}
    recipe, options = facts.usual_mixed_recipe(strategy)
    return recipe, options


def layouts(model: Decoder, cluster: Cluster, nodes: int, settings: Settings,
            facts: RegistryFacts = REGISTRY_FACTS) -> list[Layout]:
    """Every layout the module docstring lists, checkpointing off then on."""
    gpus = nodes * cluster.gpus_per_node
    degrees = [t for t in range(2, cluster.gpus_per_node + 1)
               if model.heads % t == 0 and model.kv_heads_count % t == 0 and cluster.gpus_per_node % t == 0]
    stages = [s for s in range(2, model.layers + 1) if model.layers % s == 0 and gpus % s == 0]
    found = []
    for checkpointing in CHECKPOINTING:
        shared = (("activation_checkpointing", checkpointing),)
        if model.is_moe:
            chosen = [(name, shared) for name in MOE_REPLICATED]
            degrees = [e for e in range(2, min(model.experts, gpus) + 1) if model.experts % e == 0 and gpus % e == 0]
            chosen += [("ep", (("ep", e), *shared)) for e in degrees]
            chosen += [("deepspeed-moe", (("ep", e), ("zero_stage", z), *shared)) for e in degrees for z in (1, 2)]
            chosen += [(name, (*options, ("gradient_sync", "every"))) for name, options in chosen
                       if name in GRADIENT_SYNC_EVERY]
            found += [layout_at(name, tuple(sorted({**dict(options), **recipe_for(name, settings, facts)[1]}.items())),
                                gpus, recipe_for(name, settings, facts)[0], facts) for name, options in chosen]
            continue
        chosen = [(name, shared) for name in DATA_PARALLEL]
        chosen += [(name, (("tp", t), *shared)) for t in degrees for name in MESH]
        chosen.append(("tp", shared))
        chosen += [("pipeline", (("stages", s), *shared)) for s in stages]
        splits = [p for p in range(2, gpus + 1) if gpus % p == 0 and model.seq_len % p == 0]
        chosen += [("ulysses", (("sp", p), ("zero_stage", z), *shared)) for p in splits
                   if model.heads % p == 0 and model.kv_heads_count % p == 0 for z in ULYSSES_STAGES]
        chosen += [("cp", (("cp", p), *shared)) for p in splits if model.seq_len % (2 * p) == 0]
        chosen += [(name, (*options, ("gradient_sync", "every"))) for name, options in chosen
                   if name in GRADIENT_SYNC_EVERY]
        for name, options in chosen:
            recipe, recipe_options = recipe_for(name, settings, facts)
            merged = tuple(sorted({**dict(options), **recipe_options}.items()))
            found.append(layout_at(name, merged, gpus, recipe, facts))
    return found


def layout_refusal(layout: Layout, model: Decoder, cluster: Cluster, settings: Settings,
                   facts: RegistryFacts) -> str:
    """Why the layout cannot run the model at all (the rules the strategies enforce on their workloads:
    `MeshLayout.layout_refusal`, `TensorParallel.layout_refusal`, `Pipeline.validate`; a recipe it cannot run;
    a batch that does not split), or ""."""
    split = layout.split
    refusal = facts.recipe_refusal(layout.strategy, layout.recipe)
    if refusal:
        return refusal
    refusal = shape_refusal(split, model, cluster.gpus_per_node)
    if refusal:
        return refusal
    replicas = layout.batch_replicas
    if settings.global_batch % replicas:
        return f"the global batch of {settings.global_batch} samples does not split over {replicas} replicas"
    if settings.micro_batch is not None and (settings.global_batch // replicas) % settings.micro_batch:
        return (f"--micro-batch {settings.micro_batch} does not divide a replica's "
                f"{settings.global_batch // replicas} samples")
    return ""


def _micro_batches_to_try(per_replica: int, settings: Settings) -> list[int]:
    if settings.micro_batch is not None:
        return [settings.micro_batch]
    return [1 << k for k in range(per_replica.bit_length() - 1, -1, -1) if per_replica % (1 << k) == 0]


def compute_mfu_of(layout: Layout, model: Decoder, cluster: Cluster, settings: Settings,
                   fitted: Validation) -> float:
    """--mfu, or the fitted compute MFU of the cluster's GPU, the model's size and the layout's recomputation."""
    if settings.mfu is not None:
        return settings.mfu
    return fitted.model.compute_mfu(cluster.gpu, model.active_parameters, layout.checkpointed)


def plan_layout(layout: Layout, model: Decoder, cluster: Cluster, nodes: int, settings: Settings,
                facts: RegistryFacts = REGISTRY_FACTS, fitted: Validation | None = None) -> Planned:
    """One layout's memory, fit and step (module docstring)."""
    refusal = layout_refusal(layout, model, cluster, settings, facts)
    if refusal:
        return Planned(layout=layout, refusal=refusal)
    fitted = fitted or validation(facts)
    peak, memory = gpu_figures(cluster, settings)
    split, gpus = layout.split, nodes * cluster.gpus_per_node
    per_replica = settings.global_batch // layout.batch_replicas
    compute_mfu = compute_mfu_of(layout, model, cluster, settings, fitted)
    compute_error = fitted.held_out_median
    found = confidence(layout.strategy)
    comm_error = found.median_abs_error_pct / 100 if found is not None else compute_error
    best: Planned | None = None
    smallest: Planned | None = None
    def priced(micro_batch: int):
        price = price_step(layout, model, cluster, global_batch=settings.global_batch, micro_batch=micro_batch,
                           compute_mfu=compute_mfu, peak=peak, facts=facts)
        data_parallel_s, other_s = data_parallel_seconds(price, gpus, cluster)
        all_to_all = comm_seconds([s for s in price.schedule if s.label in ("ep", "cp")], gpus, ClusterModel(cluster))
        return price, fitted.model.exposed_s(data_parallel_s, other_s), all_to_all

    for micro_batch in _micro_batches_to_try(per_replica, settings):
        micro_batches = per_replica // micro_batch
        terms = memory_of(layout, model, micro_batch=micro_batch, micro_batches=micro_batches, facts=facts)
        planned = Planned(layout=layout, micro_batch=micro_batch, micro_batches=micro_batches, memory=terms,
                          gpu_bytes=memory)
        smallest = planned
        if terms.total > memory:
            continue
        price, exposed, all_to_all = priced(micro_batch)
        step = price.compute_s + exposed
        tokens_a_step = settings.global_batch * model.seq_len
        per_gpu = tokens_a_step / step / gpus
        planned = replace(planned, compute_mfu=compute_mfu, compute_s=price.compute_s,
                          comm_s=price.comm_s, exposed_s=exposed, step_s=step,
                          step_low_s=price.compute_s * (1 - compute_error) + exposed * (1 - comm_error),
                          step_high_s=price.compute_s * (1 + compute_error) + exposed * (1 + comm_error),
                          tokens_per_s_per_gpu=per_gpu, tflops_per_gpu=price.model_flops / step / 1e12,
                          mfu=price.model_flops / step / peak, gpu_hours=settings.tokens / per_gpu / 3600,
                          schedule=price.schedule, all_to_all_s=all_to_all)
        if best is None or step < best.step_s:
            best = planned
        if split.pipeline_stages == 1:      # the largest that fits; only the pipeline's bubble rewards smaller ones
            break
    if best is None and smallest is not None and layout.expert_parallel > 1:
        # What its exchange would cost, though the memory rules it out: whether memory or the network binds it.
        price, exposed, all_to_all = priced(smallest.micro_batch)
        return replace(smallest, all_to_all_s=all_to_all, unfit_step_s=price.compute_s + exposed)
    return best if best is not None else smallest


def _same_as_sync_last(planned: Planned) -> bool:
    """A layout reduce-scattering every micro-batch whose replica runs one: the same step as its default."""
    return planned.layout.options_dict.get("gradient_sync") == "every" and planned.micro_batches == 1


def plan(model: Decoder, cluster: Cluster, nodes: int, settings: Settings,
         facts: RegistryFacts = REGISTRY_FACTS) -> list[Planned]:
    """Every layout, those that fit first by step time (those within the error of the fastest marked `tied`), then
    those that do not by the memory they need, then those that cannot be laid out."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise SpecError(f"--nodes must be a whole number >= 1, got {nodes!r}")
    gpu_figures(cluster, settings)          # a cluster without its GPU fails before anything is planned
    fitted = validation(facts)
    if settings.mfu is None:
        fitted.model.compute_mfu(cluster.gpu, model.active_parameters, False)   # a GPU no run measured: one line
    planned = [plan_layout(layout, model, cluster, nodes, settings, facts, fitted)
               for layout in layouts(model, cluster, nodes, settings, facts)]
    planned = [p for p in planned if not _same_as_sync_last(p)]
    ranked = sorted(planned, key=lambda p: (0, p.step_s, p.layout.label) if p.fits else
                    (1, p.need_bytes, p.layout.label) if not p.refusal else (2, 0.0, p.layout.label))
    fastest = next((p for p in ranked if p.fits), None)
    if fastest is None:
        return ranked
    return [replace(p, tied=p.step_low_s <= fastest.step_high_s) if p.fits else p for p in ranked]


def equivalent(planned: Sequence[Planned]) -> list[Planned]:
    """The layouts within the error of the fastest, simplest first (SIMPLICITY)."""
    return sorted((p for p in planned if p.tied), key=lambda p: p.simplicity)


# ---- printing -------------------------------------------------------------------------------------------------


def verdict(planned: Planned) -> str:
    if planned.refusal:
        return f"cannot run: {planned.refusal}"
    if planned.fits:
        return "fits"
    return f"does not fit (needs {planned.need_bytes / GIB:.1f} GiB of {planned.gpu_bytes / GIB:g})"


def header_lines(model: Decoder, cluster: Cluster, nodes: int, settings: Settings,
                 fitted: Validation) -> list[str]:
    """What is projected from what, before the table."""
    peak, memory = gpu_figures(cluster, settings)
    peak_source = ("--peak-tflops" if settings.peak_flops is not None
                   else f"datasheet, {PEAKS[cluster.gpu].document}")
    gpu = cluster.gpu or "GPU"
    if settings.mfu is not None:
        mfu = f"--mfu {settings.mfu:.0%} (given)"
    else:
        mfu = (f"{fitted.model.describe(cluster.gpu, model.active_parameters, False)}; "
               f"{fitted.model.compute_mfu(cluster.gpu, model.active_parameters, True):.1%} recomputed; --mfu to "
               "override")
        if model.is_moe:
            mfu += (" (an MoE model at the MFU of a dense one of its active parameters: the published runs it was "
                    "fitted on are dense)")
    recipe = ("each strategy's users' recipe (FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16 section, "
              "torch.autocast elsewhere)" if settings.recipe == USERS else settings.recipe)
    return [
        f"parbench plan: {model.describe()}, on {cluster.name}: {nodes} nodes x {cluster.gpus_per_node} {gpu} = "
        f"{nodes * cluster.gpus_per_node} GPUs, {memory / GIB:g} GiB and {peak / 1e12:.4g} TFLOP/s dense each "
        f"({peak_source})",
        f"projected, not measured: compute from FLOPs (PaLM: 6N + 12 L H Q T = {model.flops_per_token / 1e9:.4g} "
        f"GFLOP a token, N without the input embedding{', of the active parameters' if model.is_moe else ''}; "
        f"x {RECOMPUTE_FACTOR:.4g} where checkpointed) at {mfu}",
        f"communication: the alpha-beta model on the cluster's datasheet links; exposed: "
        f"{fitted.model.exposed_data_parallel:.0%} of the data-parallel collectives (fitted on the same runs) and "
        f"all of tensor parallelism's and the pipeline's" + (
            ", and expert parallelism's all-to-alls (each block waits for its tokens), at an even routing"
            if model.is_moe else ""),
        f"confidence: compute, the MFU model's error on published runs it was not fitted on ({fitted.confidence_text()}"
        "); communication, each strategy's record on emulated clusters (last column). A step's range: compute +/- "
        "the first's median, exposed communication +/- the second's: a typical band, not a bound",
        f"global batch {settings.global_batch * model.seq_len:,} tokens = {settings.global_batch:,} samples of "
        f"{model.seq_len}; recipe: {recipe}; memory a GPU = model states + activations + logits and loss + the "
        f"strategy's buckets, gathered parameters and accumulated gradients + allowance ({ALLOWANCE_TEXT}); fits "
        f"when the sum is at most the GPU's {memory / GIB:g} GiB",
    ]


def format_plan(planned: Sequence[Planned], model: Decoder, cluster: Cluster, nodes: int,
                settings: Settings, fitted: Validation | None = None) -> str:
    """The header, the ranked table (each row's memory terms under it), the group within the error, and what was
    left out."""
    fitted = fitted or validation()
    columns = (f"{'rank':>4}  {'layout':<30} {'recipe':<15} {'fits':<4} {'micro-batch':>11} {'GiB/GPU':>8} "
               f"{'step s':>7} {'range s':>13} {'tokens/s/GPU':>12} {'MFU':>6} {'GPU-hours':>10}  "
               "communication confidence")
    lines = header_lines(model, cluster, nodes, settings, fitted) + ["", columns, "-" * len(columns)]
    rank = 0
    for p in planned:
        batch = f"{p.micro_batch} x {p.micro_batches}" if p.micro_batch is not None else "-"
        memory = f"{p.need_bytes / GIB:.1f}" if p.memory is not None else "-"
        head = f"{p.layout.label:<30} {p.layout.recipe:<15}"
        if p.fits:
            rank += 1
            mark = f"{rank}=" if p.tied else str(rank)
            lines.append(f"{mark:>4}  {head} {'yes':<4} {batch:>11} {memory:>8} {p.step_s:>7.2f} "
                         f"{p.step_low_s:>6.2f}-{p.step_high_s:<6.2f} {p.tokens_per_s_per_gpu:>12,.0f} "
                         f"{p.mfu:>6.1%} {p.gpu_hours:>10,.0f}  {p.communication_confidence}")
        else:
            lines.append(f"{'-':>4}  {head} {'no':<4} {batch:>11} {memory:>8}  {verdict(p)}")
        if p.memory is not None:
            lines.append(f"{'':>6}memory: {p.memory.describe()}")
        if p.layout.expert_parallel > 1 and (p.fits or p.unfit_step_s):
            among = (f"among {p.layout.expert_parallel} ranks, "
                     f"{'inside a node' if p.layout.expert_parallel <= cluster.gpus_per_node else 'across nodes'}")
            if p.fits:
                lines.append(f"{'':>6}all-to-all: {p.all_to_all_s:.3f} s a step, {p.all_to_all_s / p.step_s:.1%} of "
                             f"it ({among})")
            else:
                lines.append(f"{'':>6}all-to-all: {p.all_to_all_s:.3f} s a step at micro-batch {p.micro_batch}, "
                             f"{p.all_to_all_s / p.unfit_step_s:.1%} of the {p.unfit_step_s:.2f} s step it would take "
                             f"were there memory for it ({among})")
        if p.layout.context_parallel > 1 and p.fits:
            p_ = p.layout.context_parallel
            what = "all-to-alls of q, k, v and the output" if p.layout.ulysses else "ring's key/value passes"
            lines.append(f"{'':>6}attention: {p.all_to_all_s:.3f} s a step, {p.all_to_all_s / p.step_s:.1%} of it "
                         f"(the {what} among {p_} ranks, "
                         f"{'inside a node' if p_ <= cluster.gpus_per_node else 'across nodes'}; priced exposed)")
    group = equivalent(planned)
    lines.append("")
    if group:
        lines.append(f"equivalent within the error ({len(group)}, marked =): the layouts whose range overlaps the "
                     f"fastest's ({min(p.step_s for p in group):.2f} s); simplest first: "
                     + ", ".join(p.layout.label for p in group))
    lines += [
        "micro-batch: samples a forward x micro-batches a replica runs a step (where none fits, the smallest tried)",
        "MFU and TFLOP/s: the model's FLOPs (no recomputation) over the step and the peak; GPU-hours: "
        f"{settings.tokens:,.0f} tokens at that throughput, on all {nodes * cluster.gpus_per_node} GPUs",
        "left out: offload (ZeRO-Offload, FSDP2's CPUOffloadPolicy: its step is the host's optimizer and PCIe "
        "copies, not priced here), Megatron's sequence parallelism, selective recomputation (the strategies recompute whole "
        "blocks only), the pipeline's tied-weight all-reduce and uneven stages",
    ]
    if model.is_moe:
        lines.append("an MoE model: the moe matrix's layouts (DDP and FSDP2 with every expert replicated; ep and "
                     "deepspeed-moe's ZeRO-1 and -2 at each degree dividing the experts and the GPUs, deepspeed-moe's "
                     "capacity taken as an even routing's, its capacity all-reduce left out); horovod-ep (Horovod "
                     "0.28.1's alltoall refuses bf16), tensor and pipeline parallelism of experts are not laid out; "
                     "routing taken as even (a real router's imbalance loads the busiest rank's experts and links "
                     "more)")
    return "\n".join(lines)


__all__ = ["CHECKPOINTING", "DATA_PARALLEL", "DEFAULT_GLOBAL_BATCH_TOKENS", "DEFAULT_RECIPE", "MESH", "RECIPES",
           "RECIPE_MATH", "Planned", "Settings", "equivalent", "format_plan", "layouts", "plan", "plan_layout"]
