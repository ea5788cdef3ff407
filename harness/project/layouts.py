"""A layout of a described decoder over GPUs, and the price of its optimizer step on a described cluster: what
`harness plan` ranks, `harness project --params` prices for its hybrids, and the published runs' table is laid
out as (harness.project.published_runs), so that the plan is checked on the same machinery it runs.

    python -c "from harness.project.layouts import layout_at; print(layout_at('fsdp2-tp', (('tp', 8),), 64).label)"

- **a layout** is a registered strategy (whose facts give the model states, the data-parallel collectives and
  the working memory), its options, its split of the model (`Strategy.model_split`: dp replicas of t x S ranks)
  and the precision recipe it runs. A published run laid out with tensor and pipeline parallelism together (a
  3-D layout no single strategy here runs) is the data-parallel strategy among its replicas with that split.
- **compute** = the FLOPs a GPU runs a step / (the GPU's peak x the compute MFU): the model's FLOPs (PaLM,
  Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T a token, N without the lookups: harness.project.model)
  over the G GPUs, x RECOMPUTE_FACTOR where checkpointed, x the pipeline's bubble (K + S - 1) / K
  (Narayanan et al. 2021, sec. 2.2.1). The compute MFU is the fraction of the peak the GPU's compute runs at,
  from the MFU model fitted on published runs (harness.project.mfu_model) unless given.
- **communication** (`schedule_of`): the strategy's collectives among the replicas, of the parameters a rank
  holds (`Strategy.described_traffic_bytes`, `expected_collectives`); tensor parallelism's activation
  all-reduces of the blocks a stage holds (Shoeybi et al. 2019, sec. 3: 2 forward, 2 backward a block and
  micro-batch, the forward's again where recomputed); the pipeline's sends of b x s x h values, each priced
  on the cluster by harness.project.collectives (alpha-beta, NCCL's fastest algorithm), all of it exposed
  (f = 1: nothing measured overlaps it, an upper bound).
- **experts** (an MoE model, harness.project.model): compute from its active parameters; under `ep` the dense
  gradients all-reduced among every rank and each expert's among the G / ep ranks holding it (as DDP's buckets),
  and the tokens' all-to-alls among the ep ranks (`all_to_all_schedule`).
- **a sequence split** over P ranks (`ulysses`, `cp`): the model states sharded over every rank, dp / P replicas
  of the batch, each rank's activations and logits at its s / P tokens, and the exchanges around attention
  (`attention_schedule`).
- **step** = compute + communication.

Torch-free: the strategies' facts come through harness.project.facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from harness.derive.memory import ModelSplit
from harness.derive.peaks import PEAKS, MathMode
from harness.project.cluster import Cluster
from harness.project.collectives import ClusterModel
from harness.project.facts import REGISTRY_FACTS, RegistryFacts
from harness.project.model import Decoder
from harness.project.projection import Scheduled, comm_seconds, exposed_seconds
from harness.project.rank_memory import WORKLOADS_LOSS, MemoryTerms, layout_memory
from harness.spec import SpecError

DATA_PARALLEL = ("ddp", "horovod", "zero1", "zero2", "zero3", "fsdp2")
# Tensor parallelism inside a node, a data-parallel strategy across the replicas (`Strategy.across_replicas`).
MESH = ("fsdp2-tp", "autotp")
# The layouts whose traffic is more than their replicas' (tensor parallelism's all-reduces, the pipeline's sends):
# `harness project --params` prices them by this module's schedule (`described_schedule_at`), from the model's shape.
HYBRID = (*MESH, "tp", "pipeline")
# Full recomputation runs each block's forward again in backward: 4/3 of the step's FLOPs, 8N instead of 6N a token
# (Korthikanti et al. 2022, sec. 5: "an extra forward pass"; PaLM appendix B counts it in hardware FLOPs, not MFU).
RECOMPUTE_FACTOR = 4.0 / 3.0
# The math a recipe's matmuls run in: 16-bit tensor cores for every mixed recipe, plain fp32 otherwise.
RECIPE_MATH = {"fp32": "fp32", "autocast": "bf16", "deepspeed-bf16": "bf16", "deepspeed-fp16": "fp16",
               "fsdp-mp-policy": "bf16"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A strategy with its options, how it splits the model (`Strategy.model_split`) and the recipe it runs;
    `sequence_parallel` where tensor parallelism splits the sequence outside the blocks' matmuls too."""

    strategy: str
    options: tuple[tuple[str, Any], ...]
    split: ModelSplit
    recipe: str = "autocast"
    sequence_parallel: bool = False
    expert_parallel: int = 0        # the ranks an MoE model's experts are sharded over, 0: none (expert_parallel_degree)
    # The ranks a sample's sequence is split over (Ulysses', the ring's: sequence_split_degree); the split's
    # data-parallel ranks, over which the model states are sharded, hold split.data_parallel / it replicas.
    context_parallel: int = 1

    @property
    def batch_replicas(self) -> int:
        """The replicas the global batch is split over: groups of `context_parallel` ranks share their samples."""
        return self.split.data_parallel // self.context_parallel

    @property
    def ulysses(self) -> bool:
        return self.strategy == "ulysses"

    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def checkpointed(self) -> bool:
        return self.options_dict.get("activation_checkpointing", "none") not in ("none", None)

    @property
    def vocabulary_split(self) -> bool:
        """Loss parallelism splits the vocabulary matrices and the logits over the tensor-parallel ranks."""
        return bool(self.options_dict.get("loss_parallel"))

    @property
    def label(self) -> str:
        s = self.split
        parts = ([f"tp={s.tensor_parallel}"] if s.tensor_parallel > 1 else []) + (
            [f"pp={s.pipeline_stages}"] if s.pipeline_stages > 1 else []) + [f"dp={self.batch_replicas}"] + (
            [f"cp={self.context_parallel}"] if self.context_parallel > 1 else [])
        # Experts sharded over ep of the dp ranks: a tag, not a factor of the GPUs as tp and pp are.
        tags = ([f"ep={self.expert_parallel}"] if self.expert_parallel > 1 else []) + (
            ["sp"] if self.sequence_parallel else []) + (
            [f"zero{self.options_dict['zero_stage']}"] if "zero_stage" in self.options_dict else []) + (
            ["rs-every"] if self.options_dict.get("gradient_sync") == "every" else []) + (
            ["ckpt"] if self.checkpointed else [])
        return f"{self.strategy} {' x '.join(parts)}" + "".join(f" {tag}" for tag in tags)


def layout_at(strategy: str, options: tuple[tuple[str, Any], ...], gpus: int, recipe: str = "autocast",
              facts: RegistryFacts = REGISTRY_FACTS) -> Layout:
    """The strategy's layout over `gpus` GPUs (`Strategy.model_split`): a replica's ranks from its own options (its
    tp degree, its stages; `tp`, whose degree is no option, takes all `gpus` as one replica), the rest replicas. A
    SpecError where a replica's ranks do not divide `gpus`."""
    per_replica = facts.split(strategy, dict(options), 1, gpus).ranks
    if gpus % per_replica:
        raise SpecError(f"{strategy}'s replica of {per_replica} ranks does not divide {gpus} GPUs")
    return Layout(strategy=strategy, options=options, split=facts.split(strategy, dict(options), gpus // per_replica,
                                                                          gpus), recipe=recipe,
                  expert_parallel=facts.expert_parallel_degree(strategy, dict(options), gpus),
                  context_parallel=facts.sequence_split_degree(strategy, dict(options), gpus))


def shape_refusal(split: ModelSplit, model: Decoder, gpus_per_node: int | None, uneven_stages: bool = False) -> str:
    """Why `split` cannot cut the model's blocks (`MeshLayout.layout_refusal`, `TensorParallel.layout_refusal`: a
    degree that does not divide the heads and the key/value heads, tensor parallelism across nodes; stages that do
    not divide the blocks, uneven stages being left out), or ""; `gpus_per_node` None where the target has no
    nodes (a calibration); `uneven_stages` where a published run cut its blocks unevenly (the busiest stage then
    holds ceil(blocks / stages))."""
    t, stages = split.tensor_parallel, split.pipeline_stages
    kv = model.kv_heads_count
    if model.heads % t or kv % t:
        allowed = [d for d in range(1, model.heads + 1) if model.heads % d == 0 and kv % d == 0]
        heads = f"{model.heads} heads" + (f" and {kv} key/value heads" if kv != model.heads else "")
        return f"tensor parallelism of {t} must divide the {heads} (allowed: {', '.join(map(str, allowed))})"
    if gpus_per_node is not None and t > gpus_per_node:
        return f"tensor parallelism of {t} spans nodes of {gpus_per_node} GPUs: it runs within one node"
    if gpus_per_node is not None and gpus_per_node % t:
        return f"tensor parallelism of {t} must divide a node's {gpus_per_node} GPUs"
    if model.layers % stages and not uneven_stages:
        return f"{stages} pipeline stages must divide the {model.layers} blocks (uneven stages are not modelled)"
    return ""


def peak_flops(cluster: Cluster, recipe: str) -> float:
    """The datasheet peak FLOP/s of the cluster's GPU in the math `recipe`'s matmuls run at (RECIPE_MATH); a
    one-line SpecError where the cluster names no GPU of harness.derive.peaks or the recipe is unknown."""
    if not cluster.gpu or cluster.gpu not in PEAKS:
        raise SpecError(f"cluster {cluster.name!r} names no gpu of harness.derive.peaks ({cluster.gpu or 'none'}): "
                        "add one, --set \"gpu=NVIDIA H100 80GB HBM3\", or give --peak-tflops")
    if recipe not in RECIPE_MATH:
        raise SpecError(f"recipe {recipe!r}: compute from FLOPs knows the math of {', '.join(RECIPE_MATH)} only")
    return PEAKS[cluster.gpu].for_mode(MathMode(RECIPE_MATH[recipe]))


# The bytes of a value each all-to-all carries (harness.strategies.expert_parallel.RoutingLog: each exchange in its
# own dtype): the dispatch carries the normed hidden state, fp32 under torch.autocast (RMSNorm runs in fp32) and
# 16-bit where the weights are; the combine carries the experts' outputs, 16-bit under every mixed recipe. Their
# backward exchanges carry the gradients in the same dtypes.
DISPATCH_BYTES = {"fp32": 4, "autocast": 4, "deepspeed-bf16": 2, "deepspeed-fp16": 2, "fsdp-mp-policy": 2}
COMBINE_BYTES = {"fp32": 4, "autocast": 2, "deepspeed-bf16": 2, "deepspeed-fp16": 2, "fsdp-mp-policy": 2}


def all_to_all_schedule(layout: Layout, model: Decoder, micro_batch: int, micro_batches: int) -> list[Scheduled]:
    """Expert parallelism's all-to-alls a step on a rank (harness.strategies.expert_parallel): in each MoE block and
    micro-batch the dispatch sends each of its b x s tokens' top_k copies of h values to the rank holding that
    expert and the combine brings the outputs back; backward runs both again with the gradients, and recomputation
    the forward's pair again. An all-to-all's nccl-tests size is a rank's whole buffer, b s k h values, 1/ep of it
    its own (tokens routed evenly: the load imbalance of a real router adds to the busiest rank's share, not priced).
    The split sizes' exchange (8 bytes an expert) is left out."""
    ep = layout.expert_parallel
    if ep == 1 or not model.is_moe:
        return []
    values = micro_batch * model.seq_len * model.top_k * model.hidden
    forwards = 2 if layout.checkpointed else 1
    blocks = -(-model.layers // layout.split.pipeline_stages)
    return [Scheduled(collective="all_to_all", size_bytes=float(values * width), calls=float(calls * blocks *
                                                                                                micro_batches),
                      group=ep, origin="expected", label="ep")
            for width, calls in ((DISPATCH_BYTES[layout.recipe], forwards + 1),
                                 (COMBINE_BYTES[layout.recipe], forwards + 1))]


# The bytes of a value Ulysses' and the ring's exchanges carry: q, k, v and the output come out of linear layers in
# the compute dtype; the ring's key/value gradients go round in fp32 (torch's convert_to_f32).
EXCHANGE_BYTES = {"fp32": 4, "autocast": 2, "deepspeed-bf16": 2, "deepspeed-fp16": 2, "fsdp-mp-policy": 2}


def attention_schedule(layout: Layout, model: Decoder, micro_batch: int, micro_batches: int) -> list[Scheduled]:
    """A sequence split's exchanges around attention a step on a rank, per block and micro-batch (the strategies'
    `expected_traffic`: harness/strategies/ulysses.py, harness/strategies/cp.py): Ulysses' all-to-alls of q and the
    output (b s/P a d values each) and of k and v (b s/P a_kv d), forward and backward, the forward's again where
    recomputed; the ring's all-gather of every rank's keys and values (P blocks of 2 b s/P a_kv d) forward and again
    backward (and in the recomputed forward), and its P passes of the key/value gradients, fp32. All priced exposed:
    Ulysses' exchanges sit between the projections and the core; the ring overlaps its passes with the blocks'
    attention, which the price does not credit (an upper bound)."""
    p = layout.context_parallel
    if p == 1:
        return []
    width, tokens = EXCHANGE_BYTES[layout.recipe], micro_batch * model.seq_len // p
    head_dim = model.hidden // model.heads
    blocks = model.layers * micro_batches
    forwards = 2 if layout.checkpointed else 1

    def exchange(collective: str, size: float, calls: float) -> Scheduled:
        return Scheduled(collective=collective, size_bytes=float(size), calls=float(calls * blocks), group=p,
                         origin="expected", label="cp")

    if layout.ulysses:
        return [exchange("all_to_all", tokens * heads * head_dim * width, 2 * (forwards + 1))
                for heads in (model.heads, model.kv_heads_count)]
    block = 2 * tokens * model.kv_heads_count * head_dim
    return [exchange("all_gather", p * block * width, forwards + 1), exchange("all_to_all", block * 4, p)]


# The data-parallel collectives an expert layout runs on its dense part and its experts: `ep`'s are DDP's;
# deepspeed-moe's its own ZeRO stage's.
EXPERT_LAYOUT_DATA_PARALLEL = {"ep": "ddp"}
# Layouts that reduce their experts' gradients after backward, one call a tensor, where nothing overlaps them
# (harness.strategies.ep: ExpertGradients.reduce after accumulate): priced all exposed, apart from the data-parallel
# collectives' fitted share.
EXPERTS_REDUCED_AFTER_BACKWARD = ("ep",)


def _expert_parallel_dp(layout: Layout, model: Decoder, micro_batches: int, facts: RegistryFacts) -> list[Scheduled]:
    """An expert layout's gradient reductions (and ZeRO's gathers): the dense part's among every rank, and each rank's
    experts' among the G / ep ranks holding the same ones (a group of ranks ep apart: harness.strategies.ep,
    DeepSpeed's expert data parallelism), as the strategy's data-parallel collectives (`EXPERT_LAYOUT_DATA_PARALLEL`)."""
    ep, ranks = layout.expert_parallel, layout.split.ranks
    experts = model.routed_expert_parameters / ep
    dense = model.held_by_rank(expert_parallel=ep) - experts
    name = EXPERT_LAYOUT_DATA_PARALLEL.get(layout.strategy, layout.strategy)
    options = {} if name != layout.strategy else layout.options_dict
    schedule = []
    for held, group, stride in ((dense, ranks, 1), (experts, ranks // ep, ep)):
        if group == 1:
            continue
        gradients, gathered = facts.described_traffic(name, options, int(held), layout.recipe)
        if held is experts and layout.strategy in EXPERTS_REDUCED_AFTER_BACKWARD:
            # One all-reduce of each expert tensor (its gate-and-up and its down matrices, a block each), exposed.
            tensors = 2 * model.layers
            schedule.append(Scheduled(collective="all_reduce", size_bytes=gradients / tensors, calls=float(tensors),
                                      group=group, origin="expected", label="experts", stride=stride))
            continue
        expected = facts.expected_per_step(name, options, group, micro_batches, int(held), gradients, gathered)
        schedule += [Scheduled(collective=e["collective"], size_bytes=float(e["size_bytes"]), calls=float(e["calls"]),
                               group=group, origin="expected", label="dp", stride=stride)
                     for e in expected["collectives"] if e["calls"]]
    return schedule


def schedule_of(layout: Layout, model: Decoder, micro_batch: int, micro_batches: int,
                facts: RegistryFacts = REGISTRY_FACTS) -> tuple[Scheduled, ...]:
    """The busiest GPU's collectives a step under the layout's recipe (module docstring)."""
    split, options = layout.split, layout.options_dict
    held = int(model.held_by_rank(split.tensor_parallel, split.pipeline_stages, layout.vocabulary_split))
    schedule: list[Scheduled] = []
    if layout.expert_parallel and model.is_moe:
        return tuple(_expert_parallel_dp(layout, model, micro_batches, facts)
                     + all_to_all_schedule(layout, model, micro_batch, micro_batches))
    if split.data_parallel > 1:
        across = (layout.strategy, options) if layout.strategy in DATA_PARALLEL else facts.across_replicas(
            layout.strategy, options)
        if across is not None:
            gradients, gathered = facts.described_traffic(layout.strategy, options, held, layout.recipe)
            expected = facts.expected_per_step(across[0], across[1], split.data_parallel, micro_batches, held,
                                               gradients, gathered)
            # A mesh's replicas are t ranks apart (one member of a dp group per tp slice); a pipeline stage's are
            # neighbours; a data-parallel strategy's group is the whole world (group None).
            grouped = split.tensor_parallel > 1 or split.pipeline_stages > 1
            schedule += [Scheduled(collective=e["collective"], size_bytes=float(e["size_bytes"]),
                                   calls=float(e["calls"]), group=split.data_parallel if grouped else None,
                                   origin="expected", label="dp", stride=split.tensor_parallel)
                         for e in expected["collectives"] if e["calls"]]
    schedule += attention_schedule(layout, model, micro_batch, micro_batches)
    if split.tensor_parallel > 1:
        forward, backward = facts.tensor_parallel_all_reduces(
            micro_batch=micro_batch, seq_len=model.seq_len, hidden=model.hidden,
            layers=-(-model.layers // split.pipeline_stages), micro_batches=micro_batches,
            tp=split.tensor_parallel, half=layout.recipe != "fp32")
        # Recomputation runs the forward's all-reduces again in backward.
        for entry, calls in ((forward, forward["calls"] * (2 if layout.checkpointed else 1)),
                             (backward, backward["calls"])):
            schedule.append(Scheduled(collective=entry["collective"], size_bytes=float(entry["size_bytes"]),
                                      calls=float(calls), group=split.tensor_parallel, origin="expected", label="tp"))
    if split.pipeline_stages > 1:
        # A middle stage sends each micro-batch's activations on and the gradients of those it received back, each
        # micro-batch x sequence x hidden values of the residual stream (harness.strategies.pipeline_traffic: fp32,
        # 16-bit where the weights are), to a peer a replica's width away (DeepSpeed's topology).
        width = 2 if layout.recipe in ("deepspeed-bf16", "deepspeed-fp16", "fsdp-mp-policy") else 4
        size = micro_batch * model.seq_len * model.hidden * width / (
            split.tensor_parallel if layout.sequence_parallel else 1)
        schedule.append(Scheduled(collective="send", size_bytes=float(size), calls=2.0 * micro_batches, group=2,
                                  origin="expected", label="pp", stride=split.data_parallel * split.tensor_parallel))
    return tuple(schedule)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPrice:
    """One layout's step at a micro-batch: compute and communication seconds, and what they came from."""

    compute_s: float
    comm_s: float
    model_flops: float          # a GPU's share of the model's FLOPs a step (no recomputation)
    schedule: tuple[Scheduled, ...]

    @property
    def step_s(self) -> float:
        return self.compute_s + exposed_seconds(self.comm_s, self.compute_s, 1.0)


def bubble_factor(split: ModelSplit, micro_batches: int, facts: RegistryFacts = REGISTRY_FACTS) -> float:
    """The pipeline's schedule over its stages' own work (the pipeline strategy's `bubble_factor`), 1 without one."""
    if split.pipeline_stages == 1:
        return 1.0
    return facts.bubble_factor("pipeline", {"stages": split.pipeline_stages}, micro_batches)


def price_step(layout: Layout, model: Decoder, cluster: Cluster, *, global_batch: int, micro_batch: int,
               compute_mfu: float, peak: float, facts: RegistryFacts = REGISTRY_FACTS) -> StepPrice:
    """The layout's step at `micro_batch` samples a forward over `global_batch` samples a step (module docstring)."""
    split = layout.split
    micro_batches = global_batch // layout.batch_replicas // micro_batch
    gpus = split.ranks
    model_flops = global_batch * model.seq_len * model.flops_per_token / gpus
    executed = model_flops * (RECOMPUTE_FACTOR if layout.checkpointed else 1.0)
    compute = executed / (peak * compute_mfu) * bubble_factor(split, micro_batches, facts)
    schedule = schedule_of(layout, model, micro_batch, micro_batches, facts)
    comm = comm_seconds(schedule, gpus, ClusterModel(cluster))
    return StepPrice(compute_s=compute, comm_s=comm, model_flops=model_flops, schedule=schedule)


def memory_of(layout: Layout, model: Decoder, *, micro_batch: int, micro_batches: int,
              facts: RegistryFacts = REGISTRY_FACTS, loss: str = WORKLOADS_LOSS) -> MemoryTerms:
    """The busiest GPU's bytes by term (harness.project.rank_memory), the loss the workloads' unless given."""
    return layout_memory(model=model, strategy=layout.strategy, options=layout.options_dict, split=layout.split,
                         recipe=layout.recipe, micro_batch=micro_batch, micro_batches=micro_batches,
                         checkpointed=layout.checkpointed, facts=facts, sequence_parallel=layout.sequence_parallel,
                         vocabulary_split=layout.vocabulary_split, loss=loss,
                         expert_parallel=max(1, layout.expert_parallel), context_parallel=layout.context_parallel,
                         ulysses=layout.ulysses)


# ---- the hybrids of a described model at any world size (`harness project --params`) ----------------------------

# The option that sets a hybrid's degree, where it has one (`tp`'s degree is its world size).
DEGREE_OPTIONS = {"fsdp2-tp": "tp", "autotp": "tp", "pipeline": "stages"}


def _refusal_at(strategy: str, options: Mapping[str, Any], model: Decoder, world_size: int,
                gpus_per_node: int | None, facts: RegistryFacts) -> str:
    try:
        layout = layout_at(strategy, tuple(sorted(options.items())), world_size, facts=facts)
    except SpecError as error:
        return str(error)
    return shape_refusal(layout.split, model, gpus_per_node)


def degree_refusal(strategy: str, options: Mapping[str, Any], model: Decoder, world_sizes: Sequence[int],
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


def described_schedule_at(strategy: str, options: Mapping[str, Any], model: Decoder, recipe: str,
                          world_size: int, global_batch: int, micro_batch: int, gpus_per_node: int | None,
                          facts: RegistryFacts = REGISTRY_FACTS) -> tuple[tuple[Scheduled, ...], ModelSplit, int, int]:
    """(the busiest GPU's collectives a step, the layout's split, micro-batches a replica runs a step, the
    parameters a rank holds before data-parallel sharding: `Decoder.held_by_rank`) of a hybrid
    of the described model over `world_size` GPUs at `global_batch` samples a step, `micro_batch` samples a forward:
    the same schedule the plan prices (`schedule_of`), so that `project` and `plan` agree. A SpecError where the
    layout cannot run at this size (`shape_refusal`, a batch that does not split)."""
    layout = layout_at(strategy, tuple(sorted(options.items())), world_size, recipe, facts)
    split = layout.split
    refusal = shape_refusal(split, model, gpus_per_node)
    if refusal:
        raise SpecError(refusal)
    if global_batch % split.data_parallel or (global_batch // split.data_parallel) % micro_batch:
        raise SpecError(f"the global batch of {global_batch} samples does not split into micro-batches of "
                        f"{micro_batch} over {split.data_parallel} replicas")
    micro_batches = global_batch // split.data_parallel // micro_batch
    held = int(model.held_by_rank(split.tensor_parallel, split.pipeline_stages, layout.vocabulary_split))
    return schedule_of(layout, model, micro_batch, micro_batches, facts), split, micro_batches, held
