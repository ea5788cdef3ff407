"""Every layout of a described transformer on a described cluster: what each needs in memory per GPU, whether it
fits, its projected step time, and those that fit ranked by it (`python -m harness plan`).

    python -m harness plan --params 7B --shape 4096,4096,32,32 --cluster dgx-h100-ib --nodes 8 --tokens 1e9

Projected from a description alone, no measured row (docs/projection.md, "Planning a layout"):

- **layouts** over G = nodes x GPUs per node: DDP, Horovod, ZeRO-1/2/3 and FSDP2 at dp = G; `fsdp2-tp` and
  `autotp` (ZeRO-1 across) at each tensor-parallel degree t that divides the heads and a node's GPUs, dp = G / t;
  `tp` alone at t = G (one replica); the pipeline at each stage count S that divides the blocks and G, dp = G / S;
  each with activation checkpointing off and on (every block). Offload is left out: its step is the host's
  optimizer and PCIe copies, which nothing here prices.
- **memory per GPU** = model states + activations, against the cluster's GPU memory less MEMORY_MARGIN. Model
  states: the strategy's own plan (`Strategy.model_state_plan`, the ZeRO paper's sharding, sec. 5.1) over the
  parameters one rank holds as the strategy lays the model out (`Strategy.model_split`: 1 / (t x S) of them).
  Activations: harness.derive.activations (Korthikanti et al. 2022, constants redone for the workloads' block):
  every block whole, split t ways where tensor parallelism splits it (no sequence parallelism: the layer-norm and
  column-parallel inputs stay whole on every tp rank), times the blocks of a stage and the micro-batches it holds
  in flight (1F1B: min(S, K)); checkpointed, each block's fp32 input plus one block whole, the one being recomputed.
- **micro-batch**: the largest power of two dividing a replica's share of the global batch that fits (the
  pipeline: of those that fit, the one of least step time, since more and smaller micro-batches shrink its
  bubble), or the one given.
- **step** = compute + exposed communication. Compute = FLOPs a GPU runs a step / (peak x MFU): the model's
  FLOPs (PaLM, Chowdhery et al. 2022, appendix B: 6N + 12 L h s a token) over the G GPUs, x RECOMPUTE_FACTOR
  where checkpointed, x the pipeline's bubble (K + S - 1) / K (Narayanan et al. 2021, sec. 2.2.1). Communication:
  the strategy's collectives priced on the cluster by harness.project.collectives (alpha-beta, NCCL's fastest of
  its algorithms), all of it exposed (f = 1, harness.project.projection's overlap rule with nothing measured: an
  upper bound).
- **figures**: tokens/s per GPU; TFLOP/s per GPU and MFU of the model's FLOPs (recomputation is not useful work,
  PaLM's convention); GPU-hours for the stated tokens; the confidence of the strategy's projection
  (harness.project.confidence).

Torch-free like the rest of harness.project: the strategies' facts come through harness.project.facts; the FLOPs
formula is the workloads' own (`palm_train_flops_per_token`), imported where it is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from harness.derive.activations import block_activations, rank_activation_bytes
from harness.derive.memory import ModelSplit, plan_bytes
from harness.derive.peaks import PEAKS, MathMode
from harness.project.cluster import Cluster
from harness.project.collectives import ClusterModel
from harness.project.confidence import NONE as NO_CONFIDENCE, confidence
from harness.project.facts import REGISTRY_FACTS, RegistryFacts
from harness.project.projection import Scheduled, comm_seconds, exposed_seconds
from harness.spec import SpecError

GIB = float(1 << 30)

DATA_PARALLEL = ("ddp", "horovod", "zero1", "zero2", "zero3", "fsdp2")
# Tensor parallelism inside a node, a data-parallel strategy across the replicas (`Strategy.across_replicas`).
MESH = ("fsdp2-tp", "autotp")
# The layouts whose traffic is more than their replicas' (tensor parallelism's all-reduces, the pipeline's sends):
# `harness project --params` prices them by this module's schedule (`described_schedule_at`), from the model's shape.
HYBRID = (*MESH, "tp", "pipeline")
CHECKPOINTING = ("none", "blocks")          # the strategies' activation_checkpointing option

# The recipes the activation formula was measured under (harness.derive.activations); their compute bytes and the
# precision whose datasheet peak the matmuls run at (bf16 tensor cores under autocast; plain fp32 otherwise).
RECIPE_COMPUTE = {"autocast": (2, "bf16"), "fp32": (4, "fp32")}
DEFAULT_RECIPE = "autocast"

# An assumption, not a measurement: below PaLM's 46.2% MFU (Chowdhery et al. 2022, Table 3) and the 52% of peak
# Megatron-LM reached on 3072 A100s (Narayanan et al. 2021, abstract). The fraction of the peak a GPU's compute runs
# at; the table's MFU is what is left of it after communication, the bubble and recomputation.
DEFAULT_MFU = 0.4
# Llama 2's batch (Touvron et al. 2023, sec. 2.2: "a global batch-size of 4M tokens"): 2^22 = 1024 x 4096 tokens.
DEFAULT_GLOBAL_BATCH_TOKENS = 4 * 2 ** 20
# Kept free of what the memory figure leaves out: the CUDA context, NCCL's buffers, the logits and the loss, the
# allocator's fragmentation. A layout fits when model states + activations <= (1 - margin) x the GPU's memory.
MEMORY_MARGIN = 0.10
# Full recomputation runs each block's forward again in backward: 4/3 of the step's FLOPs, 8N instead of 6N a token
# (Korthikanti et al. 2022, sec. 5: "an extra forward pass"; PaLM appendix B counts it in hardware FLOPs, not MFU).
RECOMPUTE_FACTOR = 4.0 / 3.0
# A shape whose blocks (12 L h^2 parameters, Kaplan et al. 2020, sec. 2.1; + V h with a vocabulary) are not within
# this range of --params describes another model.
SHAPE_TOLERANCE = (0.5, 1.1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Transformer:
    """A decoder described by its parameter count and shape."""

    parameters: int
    seq_len: int
    hidden: int
    heads: int
    layers: int
    vocab: int | None = None

    def __post_init__(self) -> None:
        for name in ("parameters", "seq_len", "hidden", "heads", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise SpecError(f"the {self.heads} heads must divide the hidden size {self.hidden}")
        low, high = SHAPE_TOLERANCE
        ratio = self.shape_parameters / self.parameters
        if not low <= ratio <= high:
            what = "12 L h^2" + (" + V h" if self.vocab else "")
            raise SpecError(f"the shape holds {self.shape_parameters:,} parameters ({what}), {ratio:.0%} of --params "
                            f"{self.parameters:,}; allowed: {low:.0%} to {high:.0%}")

    @property
    def shape_parameters(self) -> int:
        return 12 * self.layers * self.hidden ** 2 + (self.vocab or 0) * self.hidden

    @property
    def flops_per_token(self) -> float:
        """PaLM's 6N + 12 L H Q T, N the whole --params (an untied input embedding, no matmul, counted as one)."""
        from workloads.gpt import palm_train_flops_per_token

        return palm_train_flops_per_token(self.parameters, self.layers, self.heads, self.hidden // self.heads,
                                          self.seq_len)

    def describe(self) -> str:
        vocab = f", vocabulary {self.vocab:,}" if self.vocab else ""
        return (f"{self.parameters:,} parameters, sequence {self.seq_len}, hidden {self.hidden}, {self.heads} heads, "
                f"{self.layers} layers{vocab}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """What the plan assumes besides the model and the cluster."""

    global_batch: int                       # samples a step
    tokens: float                           # to train, for the GPU-hours
    recipe: str = DEFAULT_RECIPE
    mfu: float = DEFAULT_MFU
    micro_batch: int | None = None          # None: the largest power of two that fits
    peak_flops: float | None = None         # None: the cluster's GPU's datasheet peak

    def __post_init__(self) -> None:
        if self.recipe not in RECIPE_COMPUTE:
            raise SpecError(f"--recipe {self.recipe!r}: the activation formula is measured under "
                            f"{', '.join(RECIPE_COMPUTE)} only")
        if not (0 < self.mfu <= 1):
            raise SpecError(f"--mfu must be a fraction of the peak in (0, 1], got {self.mfu!r}")
        if self.global_batch < 1 or not (self.tokens > 0 and math.isfinite(self.tokens)):
            raise SpecError("the global batch must be >= 1 sample and --tokens a finite number > 0")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise SpecError(f"--micro-batch must be >= 1, got {self.micro_batch}")
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise SpecError(f"--peak-tflops must be > 0, got {self.peak_flops!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A strategy with its options, and how it splits the model (`Strategy.model_split`)."""

    strategy: str
    options: tuple[tuple[str, Any], ...]
    split: ModelSplit

    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def checkpointed(self) -> bool:
        return self.options_dict.get("activation_checkpointing", "none") != "none"

    @property
    def label(self) -> str:
        s = self.split
        parts = ([f"tp={s.tensor_parallel}"] if s.tensor_parallel > 1 else []) + (
            [f"pp={s.pipeline_stages}"] if s.pipeline_stages > 1 else []) + [f"dp={s.data_parallel}"]
        return f"{self.strategy} {' x '.join(parts)}" + (" ckpt" if self.checkpointed else "")


@dataclass(frozen=True, kw_only=True)
class Planned:
    """One layout: its memory at the micro-batch chosen (or the smallest, where none fits), and where it fits its
    step and what follows from it; `refusal` where it cannot be laid out at all."""

    layout: Layout
    refusal: str = ""
    micro_batch: int | None = None
    micro_batches: int | None = None        # a replica's per step
    states_bytes: float | None = None
    activation_bytes: float | None = None
    gpu_bytes: float | None = None          # one GPU's memory
    compute_s: float | None = None
    comm_s: float | None = None
    step_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    gpu_hours: float | None = None
    schedule: tuple[Scheduled, ...] = field(default=())

    @property
    def need_bytes(self) -> float | None:
        return None if self.states_bytes is None else self.states_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return not self.refusal and self.step_s is not None

    @property
    def confidence(self) -> str:
        found = confidence(self.layout.strategy)
        return found.text if found is not None else NO_CONFIDENCE


def gpu_figures(cluster: Cluster, settings: Settings) -> tuple[float, float]:
    """(peak FLOP/s of one GPU in the recipe's math, its memory in bytes); a one-line SpecError where the cluster
    does not describe its GPU."""
    if settings.peak_flops is None and not cluster.gpu:
        raise SpecError(f"cluster {cluster.name!r} names no gpu (a device of harness.derive.peaks): add one, "
                        "--set \"gpu=NVIDIA H100 80GB HBM3\", or give --peak-tflops")
    if cluster.gpu_memory_GiB is None:
        raise SpecError(f"cluster {cluster.name!r} gives no gpu_memory_GiB: add it, e.g. --set gpu_memory_GiB=80")
    peak = settings.peak_flops if settings.peak_flops is not None else peak_flops(cluster, settings.recipe)
    return peak, cluster.gpu_memory_GiB * GIB


def peak_flops(cluster: Cluster, recipe: str) -> float:
    """The datasheet peak FLOP/s of the cluster's GPU in the math `recipe`'s matmuls run at (RECIPE_COMPUTE); a
    one-line SpecError where the cluster names no GPU or the recipe is not one of those."""
    if not cluster.gpu:
        raise SpecError(f"cluster {cluster.name!r} names no gpu (a device of harness.derive.peaks): add one, "
                        "--set \"gpu=NVIDIA H100 80GB HBM3\"")
    if recipe not in RECIPE_COMPUTE:
        raise SpecError(f"recipe {recipe!r}: compute from FLOPs knows the math of {', '.join(RECIPE_COMPUTE)} only "
                        "(the peak its matmuls run at)")
    return PEAKS[cluster.gpu].for_mode(MathMode(RECIPE_COMPUTE[recipe][1]))


def layout_at(strategy: str, options: tuple[tuple[str, Any], ...], gpus: int,
              facts: RegistryFacts = REGISTRY_FACTS) -> Layout:
    """The strategy's layout over `gpus` GPUs (`Strategy.model_split`): a replica's ranks from its own options (its
    tp degree, its stages; `tp`, whose degree is no option, takes all `gpus` as one replica), the rest replicas. A
    SpecError where a replica's ranks do not divide `gpus`."""
    per_replica = facts.split(strategy, dict(options), 1, gpus).ranks
    if gpus % per_replica:
        raise SpecError(f"{strategy}'s replica of {per_replica} ranks does not divide {gpus} GPUs")
    return Layout(strategy=strategy, options=options,
                  split=facts.split(strategy, dict(options), gpus // per_replica, gpus))


def layouts(model: Transformer, cluster: Cluster, nodes: int, facts: RegistryFacts = REGISTRY_FACTS) -> list[Layout]:
    """Every layout the module docstring lists, checkpointing off then on."""
    gpus = nodes * cluster.gpus_per_node
    degrees = [t for t in range(2, cluster.gpus_per_node + 1)
               if model.heads % t == 0 and cluster.gpus_per_node % t == 0]
    stages = [s for s in range(2, model.layers + 1) if model.layers % s == 0 and gpus % s == 0]
    found = []
    for checkpointing in CHECKPOINTING:
        shared = (("activation_checkpointing", checkpointing),)
        chosen = [(name, shared) for name in DATA_PARALLEL]
        chosen += [(name, (("tp", t), *shared)) for t in degrees for name in MESH]
        chosen.append(("tp", shared))
        chosen += [("pipeline", (("stages", s), *shared)) for s in stages]
        found += [layout_at(name, options, gpus, facts) for name, options in chosen]
    return found


def layout_refusal(layout: Layout, model: Transformer, cluster: Cluster, settings: Settings,
                   facts: RegistryFacts) -> str:
    """Why the layout cannot run the model at all (the rules the strategies enforce on their workloads:
    `MeshLayout.layout_refusal`, `TensorParallel.layout_refusal`, `Pipeline.validate`), or ""."""
    split = layout.split
    refusal = facts.recipe_refusal(layout.strategy, settings.recipe)
    if refusal:
        return refusal
    refusal = shape_refusal(split, model, cluster.gpus_per_node)
    if refusal:
        return refusal
    if settings.global_batch % split.data_parallel:
        return f"the global batch of {settings.global_batch} samples does not split over {split.data_parallel} replicas"
    if settings.micro_batch is not None and (settings.global_batch // split.data_parallel) % settings.micro_batch:
        return (f"--micro-batch {settings.micro_batch} does not divide a replica's "
                f"{settings.global_batch // split.data_parallel} samples")
    return ""


def shape_refusal(split: ModelSplit, model: Transformer, gpus_per_node: int | None) -> str:
    """Why `split` cannot cut the model's blocks (`MeshLayout.layout_refusal`, `TensorParallel.layout_refusal`: a
    degree that does not divide the heads, tensor parallelism across nodes; stages that do not divide the blocks,
    uneven stages being left out), or ""; `gpus_per_node` None where the target has no nodes (a calibration)."""
    t, stages = split.tensor_parallel, split.pipeline_stages
    if model.heads % t:
        return f"tensor parallelism of {t} must divide the {model.heads} heads"
    if gpus_per_node is not None and t > gpus_per_node:
        return f"tensor parallelism of {t} spans nodes of {gpus_per_node} GPUs: it runs within one node"
    if gpus_per_node is not None and gpus_per_node % t:
        return f"tensor parallelism of {t} must divide a node's {gpus_per_node} GPUs"
    if model.layers % stages:
        return f"{stages} pipeline stages must divide the {model.layers} blocks (uneven stages are not modelled)"
    return ""


def memory_bytes(layout: Layout, model: Transformer, settings: Settings, micro_batch: int, micro_batches: int,
                 facts: RegistryFacts) -> tuple[float, float]:
    """(model states, activations) of the busiest GPU at `micro_batch` samples, `micro_batches` a step."""
    split = layout.split
    plan = facts.model_state_plan(layout.strategy, layout.options_dict, split.data_parallel, settings.recipe)
    states = plan_bytes(plan, split.evenly_held(model.parameters))["total"]
    compute_bytes = RECIPE_COMPUTE[settings.recipe][0]
    sizes = dict(seq_len=model.seq_len, micro_batch=micro_batch, hidden=model.hidden, heads=model.heads)
    activations = rank_activation_bytes(**sizes, layers=model.layers, compute_bytes=compute_bytes,
                                        tensor_parallel=split.tensor_parallel, stages=split.pipeline_stages,
                                        micro_batches=micro_batches, checkpointed=layout.checkpointed)
    if layout.checkpointed:     # the block recomputed in backward holds its whole activations meanwhile
        activations += block_activations(**sizes, tp=split.tensor_parallel, compute_bytes=compute_bytes).total
    return states, activations


def schedule_of(layout: Layout, model: Transformer, recipe: str, micro_batch: int, micro_batches: int,
                facts: RegistryFacts) -> tuple[Scheduled, ...]:
    """The busiest GPU's collectives a step under `recipe`: its data-parallel strategy's among the replicas (of the
    parameters a rank holds), tensor parallelism's activation all-reduces, the pipeline's sends. `harness project
    --params` prices the hybrids by it too (`described_schedule_at`)."""
    split, options = layout.split, layout.options_dict
    held = int(split.evenly_held(model.parameters))
    schedule: list[Scheduled] = []
    if split.data_parallel > 1:
        across = (layout.strategy, options) if layout.strategy in DATA_PARALLEL else facts.across_replicas(
            layout.strategy, options)
        if across is not None:
            gradients, gathered = facts.described_traffic(layout.strategy, options, held, recipe)
            expected = facts.expected_per_step(across[0], across[1], split.data_parallel, micro_batches, held,
                                               gradients, gathered)
            # A mesh's replicas are t ranks apart (one member of a dp group per tp slice); a pipeline stage's are
            # neighbours; a data-parallel strategy's group is the whole world (group None).
            grouped = split.tensor_parallel > 1 or split.pipeline_stages > 1
            schedule += [Scheduled(collective=e["collective"], size_bytes=float(e["size_bytes"]),
                                   calls=float(e["calls"]), group=split.data_parallel if grouped else None,
                                   origin="expected", label="dp", stride=split.tensor_parallel)
                         for e in expected["collectives"] if e["calls"]]
    if split.tensor_parallel > 1:
        forward, backward = facts.tensor_parallel_all_reduces(
            micro_batch=micro_batch, seq_len=model.seq_len, hidden=model.hidden, layers=model.layers,
            micro_batches=micro_batches, tp=split.tensor_parallel, half=recipe == "autocast")
        # Recomputation runs the forward's all-reduces again in backward.
        for entry, calls in ((forward, forward["calls"] * (2 if layout.checkpointed else 1)),
                             (backward, backward["calls"])):
            schedule.append(Scheduled(collective=entry["collective"], size_bytes=float(entry["size_bytes"]),
                                      calls=float(calls), group=split.tensor_parallel, origin="expected", label="tp"))
    if split.pipeline_stages > 1:
        # A middle stage sends each micro-batch's activations on and the gradients of those it received back, each
        # micro-batch x sequence x hidden values of the fp32 residual stream (harness.strategies.pipeline_traffic),
        # to a peer a replica's width away (DeepSpeed's topology: rank = stage x replicas + replica).
        size = micro_batch * model.seq_len * model.hidden * 4
        schedule.append(Scheduled(collective="send", size_bytes=float(size), calls=2.0 * micro_batches, group=2,
                                  origin="expected", label="pp", stride=split.data_parallel))
    return tuple(schedule)


# ---- the hybrids of a described model at any world size (`harness project --params`) ----------------------------

# The option that sets a hybrid's degree, where it has one (`tp`'s degree is its world size).
DEGREE_OPTIONS = {"fsdp2-tp": "tp", "autotp": "tp", "pipeline": "stages"}


def transformer_of(parameters: int, shape: Mapping[str, int]) -> Transformer:
    """The Transformer of `parameters` and a --shape (seq_len, n_embd, n_head, n_layer[, vocab_size])."""
    return Transformer(parameters=int(parameters), seq_len=int(shape["seq_len"]), hidden=int(shape["n_embd"]),
                       heads=int(shape["n_head"]), layers=int(shape["n_layer"]), vocab=shape.get("vocab_size"))


def _refusal_at(strategy: str, options: Mapping[str, Any], model: Transformer, world_size: int,
                gpus_per_node: int | None, facts: RegistryFacts) -> str:
    try:
        layout = layout_at(strategy, tuple(sorted(options.items())), world_size, facts)
    except SpecError as error:
        return str(error)
    return shape_refusal(layout.split, model, gpus_per_node)


def degree_refusal(strategy: str, options: Mapping[str, Any], model: Transformer, world_sizes: Sequence[int],
                   gpus_per_node: int | None, facts: RegistryFacts = REGISTRY_FACTS) -> str:
    """Why a hybrid's degree (its DEGREE_OPTIONS option, given or its default) cannot lay the model out at one of
    `world_sizes`, naming the degrees that can at all of them; "" where it can, or where the degree is the world
    size's own (`tp`: a world size it cannot take is left out of the projection)."""
    key = DEGREE_OPTIONS.get(strategy)
    if key is None:
        return ""
    found = {n: _refusal_at(strategy, options, model, n, gpus_per_node, facts) for n in world_sizes}
    refused = [(n, why) for n, why in found.items() if why]
    if not refused:
        return ""
    n, why = refused[0]
    bound = model.heads if key == "tp" else model.layers
    allowed = [value for value in range(1, bound + 1)
               if not any(_refusal_at(strategy, {**options, key: value}, model, m, gpus_per_node, facts)
                          for m in world_sizes)]
    node = f", nodes of {gpus_per_node} GPUs" if gpus_per_node is not None and key == "tp" else ""
    what = f"{model.heads} heads" if key == "tp" else f"{model.layers} blocks"
    return (f"at world size {n}, {why}; allowed {key} for {what}{node} and world sizes "
            f"{','.join(map(str, world_sizes))}: {', '.join(map(str, allowed)) or 'none'}")


def described_schedule_at(strategy: str, options: Mapping[str, Any], model: Transformer, recipe: str,
                          world_size: int, global_batch: int, micro_batch: int, gpus_per_node: int | None,
                          facts: RegistryFacts = REGISTRY_FACTS) -> tuple[tuple[Scheduled, ...], ModelSplit, int]:
    """(the busiest GPU's collectives a step, the layout's split, micro-batches a replica runs a step) of a hybrid
    of the described model over `world_size` GPUs at `global_batch` samples a step, `micro_batch` samples a forward:
    the same schedule the plan prices (`schedule_of`), so that `project` and `plan` agree. A SpecError where the
    layout cannot run at this size (`shape_refusal`, a batch that does not split)."""
    layout = layout_at(strategy, tuple(sorted(options.items())), world_size, facts)
    split = layout.split
    refusal = shape_refusal(split, model, gpus_per_node)
    if refusal:
        raise SpecError(refusal)
    if global_batch % split.data_parallel or (global_batch // split.data_parallel) % micro_batch:
        raise SpecError(f"the global batch of {global_batch} samples does not split into micro-batches of "
                        f"{micro_batch} over {split.data_parallel} replicas")
    micro_batches = global_batch // split.data_parallel // micro_batch
    return schedule_of(layout, model, recipe, micro_batch, micro_batches, facts), split, micro_batches


def _micro_batches_to_try(per_replica: int, settings: Settings) -> list[int]:
    if settings.micro_batch is not None:
        return [settings.micro_batch]
    return [1 << k for k in range(per_replica.bit_length() - 1, -1, -1) if per_replica % (1 << k) == 0]


def plan_layout(layout: Layout, model: Transformer, cluster: Cluster, nodes: int, settings: Settings,
                facts: RegistryFacts = REGISTRY_FACTS) -> Planned:
    """One layout's memory, fit and step (module docstring)."""
    refusal = layout_refusal(layout, model, cluster, settings, facts)
    if refusal:
        return Planned(layout=layout, refusal=refusal)
    peak, memory = gpu_figures(cluster, settings)
    split, gpus = layout.split, nodes * cluster.gpus_per_node
    per_replica = settings.global_batch // split.data_parallel
    comm_model = ClusterModel(cluster)
    tokens_a_step = settings.global_batch * model.seq_len
    model_flops = tokens_a_step * model.flops_per_token / gpus          # a GPU's share of a step
    executed = model_flops * (RECOMPUTE_FACTOR if layout.checkpointed else 1.0)
    best: Planned | None = None
    smallest: Planned | None = None
    for micro_batch in _micro_batches_to_try(per_replica, settings):
        micro_batches = per_replica // micro_batch
        states, activations = memory_bytes(layout, model, settings, micro_batch, micro_batches, facts)
        planned = Planned(layout=layout, micro_batch=micro_batch, micro_batches=micro_batches, states_bytes=states,
                          activation_bytes=activations, gpu_bytes=memory)
        smallest = planned
        if states + activations > (1 - MEMORY_MARGIN) * memory:
            continue
        compute = executed / (peak * settings.mfu) * facts.bubble_factor(layout.strategy, layout.options_dict,
                                                                          micro_batches)
        schedule = schedule_of(layout, model, settings.recipe, micro_batch, micro_batches, facts)
        comm = comm_seconds(schedule, gpus, comm_model)
        step = compute + exposed_seconds(comm, compute, 1.0)
        per_gpu = tokens_a_step / step / gpus
        planned = Planned(layout=layout, micro_batch=micro_batch, micro_batches=micro_batches, states_bytes=states,
                          activation_bytes=activations, gpu_bytes=memory, compute_s=compute, comm_s=comm,
                          step_s=step, tokens_per_s_per_gpu=per_gpu, tflops_per_gpu=model_flops / step / 1e12,
                          mfu=model_flops / step / peak, gpu_hours=settings.tokens / per_gpu / 3600,
                          schedule=schedule)
        if best is None or step < best.step_s:
            best = planned
        if split.pipeline_stages == 1:      # the largest that fits; only the pipeline's bubble rewards smaller ones
            break
    return best if best is not None else smallest


def plan(model: Transformer, cluster: Cluster, nodes: int, settings: Settings,
         facts: RegistryFacts = REGISTRY_FACTS) -> list[Planned]:
    """Every layout, those that fit first by step time, then those that do not by the memory they need, then those
    that cannot be laid out."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise SpecError(f"--nodes must be a whole number >= 1, got {nodes!r}")
    gpu_figures(cluster, settings)          # a cluster without its GPU fails before anything is planned
    planned = [plan_layout(layout, model, cluster, nodes, settings, facts)
               for layout in layouts(model, cluster, nodes, facts)]
    return sorted(planned, key=lambda p: (0, p.step_s, p.layout.label) if p.fits else
                  (1, p.need_bytes, p.layout.label) if not p.refusal else (2, 0.0, p.layout.label))


# ---- printing -------------------------------------------------------------------------------------------------


def verdict(planned: Planned) -> str:
    if planned.refusal:
        return f"cannot run: {planned.refusal}"
    if planned.fits:
        return "fits"
    need, memory = planned.need_bytes / GIB, planned.gpu_bytes / GIB
    over = "" if need > memory else f": over the {1 - MEMORY_MARGIN:.0%} of it kept for what is not counted"
    return f"does not fit (needs {need:.1f} GiB of {memory:g}{over})"


def header_lines(model: Transformer, cluster: Cluster, nodes: int, settings: Settings) -> list[str]:
    """What is projected from what, before the table."""
    peak, memory = gpu_figures(cluster, settings)
    math_mode = RECIPE_COMPUTE[settings.recipe][1]
    peak_source = ("--peak-tflops" if settings.peak_flops is not None
                   else f"datasheet, {PEAKS[cluster.gpu].document}")
    gpu = cluster.gpu or "GPU"
    return [
        f"parbench plan: {model.describe()}, on {cluster.name}: {nodes} nodes x {cluster.gpus_per_node} {gpu} = "
        f"{nodes * cluster.gpus_per_node} GPUs, {memory / GIB:g} GiB and {peak / 1e12:.4g} TFLOP/s {math_mode} dense "
        f"each ({peak_source})",
        "projected, not measured: no measured row. Compute from FLOPs (PaLM: 6N + 12 L h s = "
        f"{model.flops_per_token / 1e9:.4g} GFLOP a token; x {RECOMPUTE_FACTOR:.4g} where checkpointed) at an assumed "
        f"MFU of {settings.mfu:.0%} of that peak (--mfu); communication by the alpha-beta model on the cluster's "
        "datasheet links, all of it exposed (no overlap measured: an upper bound)",
        f"global batch {settings.global_batch * model.seq_len:,} tokens = {settings.global_batch:,} samples of "
        f"{model.seq_len}; recipe {settings.recipe}; memory a GPU = model states (the strategy's plan, ZeRO paper "
        "sec. 5.1) + activations (Korthikanti et al. 2022, the workloads' block; no sequence parallelism), fitting "
        f"in {1 - MEMORY_MARGIN:.0%} of the GPU (the rest for the CUDA context, NCCL's buffers, the logits, "
        "fragmentation)",
    ]


def format_plan(planned: Sequence[Planned], model: Transformer, cluster: Cluster, nodes: int,
                settings: Settings) -> str:
    """The header, the ranked table, what the confidence column means, and what was left out."""
    columns = (f"{'rank':>4}  {'layout':<28} {'fits':<5} {'micro-batch':>11} {'GiB/GPU (states+acts)':>23} "
               f"{'step s':>8} {'tokens/s/GPU':>12} {'TFLOP/s/GPU':>11} {'MFU':>6} {'GPU-hours':>10}  confidence")
    lines = header_lines(model, cluster, nodes, settings) + ["", columns, "-" * len(columns)]
    rank = 0
    for p in planned:
        batch = f"{p.micro_batch} x {p.micro_batches}" if p.micro_batch is not None else "-"
        memory = (f"{p.need_bytes / GIB:.1f} ({p.states_bytes / GIB:.1f}+{p.activation_bytes / GIB:.1f})"
                  if p.states_bytes is not None else "-")
        if p.fits:
            rank += 1
            lines.append(f"{rank:>4}  {p.layout.label:<28} {'yes':<5} {batch:>11} {memory:>23} {p.step_s:>8.3f} "
                         f"{p.tokens_per_s_per_gpu:>12,.0f} {p.tflops_per_gpu:>11.1f} {p.mfu:>6.1%} "
                         f"{p.gpu_hours:>10,.0f}  {p.confidence}")
        else:
            lines.append(f"{'-':>4}  {p.layout.label:<28} {'no':<5} {batch:>11} {memory:>23}  {verdict(p)}")
    lines += [
        "",
        "micro-batch: samples a forward x micro-batches a replica runs a step (where none fits, the smallest tried)",
        "MFU and TFLOP/s: the model's FLOPs (no recomputation) over the step and the peak; GPU-hours: "
        f"{settings.tokens:,.0f} tokens at that throughput",
        "confidence: the strategy's |error| over the committed validations of its projection (median, max, cells), "
        "on an emulated cluster of CPU nodes (results/reference/emulated-reno, extrapolation; emulated-hybrid-layouts "
        "for the hybrids, better than copying the source cell and outside the bars): the communication model's "
        "record, not a check of compute from FLOPs",
        "left out: offload (ZeRO-Offload, FSDP2's CPUOffloadPolicy: its step is the host's optimizer and PCIe "
        "copies, not priced here), sequence parallelism, the pipeline's tied-weight all-reduce and uneven stages",
    ]
    return "\n".join(lines)
