"""The one small interface every strategy implements, and the pieces they share.

A `Strategy` is consulted twice. Before launch (in the harness process) it validates a spec, says how the
global batch is laid out, why a cell must be skipped here, and which launcher starts it. Inside each rank
(in `harness.rank.worker`) it starts its communication library, wraps the model and optimizer, and returns a
`Trainer` that runs one optimizer step over the rank's micro-batches. It also owns facts about its step
that the row records: the collectives a step should issue (`expected_traffic`, in the dtypes its precision
recipe really reduces and gathers), the dtypes its gradient reduction communicates in
(`gradient_reduce_dtypes`, which parity's bf16 tolerances follow) and what a rank's own work is without
communication (`compute_only_plan`, the baseline of exposed communication). Strategies must not import their
optional libraries (deepspeed, horovod) at module level: the registry is imported before launch.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import importlib.util
import math
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Mapping, Sequence

import torch
from torch import nn

from harness.derive.checkpoint import CheckpointContents, held_once
from harness.derive.comm import Collective
from harness.derive.exposed import SAME_WORK
from harness.derive.memory import ModelSplit, ModelStatePlan, RankParameters, zero_plan
from harness.rank.memory_model import ModelStateTensors
from harness.spec import DeviceKind, Layout, OptionValue, Precision, RunSpec, SpecError
from harness.strategies.loss_scaling import StepOutcome, scaler_step
from harness.strategies.offload import offload_refusal, saved_on_host
from harness.strategies.option import Option
from workloads import Workload

if TYPE_CHECKING:
    from harness.machine import Machine

# One optimizer for every strategy (torch AdamW, handed to DeepSpeed as a client optimizer), so that
# strategies differ only in how they distribute the work. One parameter group: ZeRO flattens groups.
ADAMW_HYPERPARAMETERS: Mapping[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}

MicroBatch = tuple[torch.Tensor, torch.Tensor]
# Called by `Trainer.train_step` once per step, after the step's gradients are reduced and before the
# optimizer changes any weight: the one point where every strategy holds the same thing (reduced
# gradients, last step's weights and optimizer state), read by the parity probe and the memory reading.
GradientsReady = Callable[[], None]


class PrecisionRecipe(enum.StrEnum):
    """How low precision is applied; every row names the one it used."""

    FP32 = "fp32"                        # no low precision anywhere
    AUTOCAST = "autocast"                # torch.autocast: fp32 weights, bf16/fp16 compute (the default everywhere)
    DEEPSPEED_BF16 = "deepspeed-bf16"    # DeepSpeed's `bf16` section: bf16 weights + fp32 master copy
    DEEPSPEED_FP16 = "deepspeed-fp16"    # DeepSpeed's `fp16` section (GPU only): fp16 weights + fp32 master copy
    FSDP_MP_POLICY = "fsdp-mp-policy"    # FSDP2 MixedPrecisionPolicy: bf16/fp16 params for compute, fp32 reduce


# Whose each recipe is, as a strategy that cannot run one says so (`Strategy.recipe_refusal`).
RECIPE_SOURCES: Mapping[PrecisionRecipe, str] = {
    PrecisionRecipe.FP32: "plain fp32",
    PrecisionRecipe.AUTOCAST: "torch.autocast's",
    PrecisionRecipe.DEEPSPEED_BF16: "DeepSpeed's (its bf16 section)",
    PrecisionRecipe.DEEPSPEED_FP16: "DeepSpeed's (its fp16 section)",
    PrecisionRecipe.FSDP_MP_POLICY: "FSDP2's (its MixedPrecisionPolicy)",
}


# Bytes per parameter of (weights, gradients, optimizer state) for torch AdamW over a model's own
# parameters. fp32 and torch.autocast keep fp32 weights and gradients and two fp32 moments, with no
# master copy: 4 + 4 + 8. DeepSpeed's bf16 recipe is the ZeRO paper's mixed-precision Adam (Rajbhandari et
# al. 2020, sec. 3.1): 2-byte weights and gradients, and K = 12 bytes of fp32 master weights, momentum and
# variance. FSDP2's MixedPrecisionPolicy casts only the unsharded copies it gathers for compute and frees
# after use; "The optimizer step uses the sharded parameter in the original dtype" and FSDP "keeps the
# high-precision sharded parameters in memory anyway" (torch/distributed/fsdp/_fully_shard/_fsdp_api.py,
# torch 2.13), with gradients reduced and kept in fp32 (reduce_dtype), so it is 4 + 4 + 8 too.
ADAMW_STATE_BYTES: Mapping[PrecisionRecipe, tuple[int, int, int]] = {
    PrecisionRecipe.FP32: (4, 4, 8),
    PrecisionRecipe.AUTOCAST: (4, 4, 8),
    PrecisionRecipe.FSDP_MP_POLICY: (4, 4, 8),
    PrecisionRecipe.DEEPSPEED_BF16: (2, 2, 12),
    PrecisionRecipe.DEEPSPEED_FP16: (2, 2, 12),     # the same mixed-precision Adam, in fp16
}


@dataclass(frozen=True, kw_only=True)
class TrafficBytes:
    """A model's parameters, and the bytes of all their gradients in the dtype a precision recipe reduces
    them in and of all of them in the dtype it gathers them in (a tied weight counts once)."""

    parameters: int
    gradients_reduced: int
    parameters_gathered: int
    # Parameters a sharding strategy keeps whole on every rank, as a row measured them (ZeRO-3's persistent
    # ones); 0 where not known, as before a run.
    parameters_kept_whole: int = 0


@dataclass(frozen=True, kw_only=True)
class ExpectedCollective:
    """Collectives of one type that an optimizer step should issue on each rank."""

    collective: Collective
    size_bytes: int      # nccl-tests size of one call (harness.derive.comm): a whole-model buffer
    calls: int           # such calls per optimizer step (an implementation splits each into buckets)
    ranks: int           # ranks in the group it runs among
    group: str = "world"  # that group's name in the counts (harness.rank.comm_counter.label_group)
    # Ranks between one member of the group and the next: 1 where the members are neighbours (a node holds them
    # together: tensor parallelism's group), the inner mesh dimensions' size where they are spread (a 2-D
    # mesh's dp group, one rank per tp slice): where it crosses nodes, how many groups share a node's links.
    stride: int = 1


@dataclass(frozen=True, kw_only=True)
class ExpectedTraffic:
    """What a strategy's step should put on the wire per rank, or why it is not modelled."""

    collectives: tuple[ExpectedCollective, ...] = ()
    not_modelled_because: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"collectives": [{"collective": c.collective.value, "size_bytes": c.size_bytes, "calls": c.calls,
                                 "ranks": c.ranks, "group": c.group, "stride": c.stride} for c in self.collectives],
                "not_modelled_because": self.not_modelled_because}


class Sharding(enum.StrEnum):
    """Which elements of the parameters a rank's optimizer updates."""

    REPLICATED = "replicated"          # every parameter (DDP, Horovod)
    FLAT = "flat"                      # the r-th 1/N of all parameters concatenated (DeepSpeed ZeRO-1/2)
    PER_PARAMETER = "per-parameter"    # the r-th 1/N of each parameter's elements (DeepSpeed ZeRO-3)
    DIM0_ROWS = "dim-0 rows"           # the r-th chunk of each parameter's first dimension (FSDP2's Shard(0))


@dataclass(frozen=True, kw_only=True)
class ComputeOnlyPlan:
    """A rank's own work with no communication: the baseline of exposed communication
    (harness.rank.compute_only runs it, harness.derive.exposed uses it)."""

    kind: str = SAME_WORK                       # "same work", or "bound: <why it is not the same work>"
    sharding: Sharding = Sharding.REPLICATED
    weights_dtype: torch.dtype = torch.float32  # the dtype forward and backward hold the weights in
    autocast: bool = False                      # torch.autocast (bf16) around forward
    whole_gradients_in_fp32: bool = False       # every gradient is cast to fp32 before it is sharded


@dataclass
class RankContext:
    """Where this process stands: filled in by `Strategy.start` inside a rank."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str                 # "gloo", "nccl", or "none" for a single process
    shared_device: bool          # several ranks on one GPU: valid for memory, meaningless for speed


# Elements squared in float64 at a time by `squared_norm`: a bounded float64 copy (128 MiB) on the device or host.
NORM_CHUNK_ELEMENTS = 1 << 24


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of squares of `tensor`'s elements, accumulated in float64, a float64 scalar on its device.

    The parity probe's instrument. torch's float32 norm on the host sums in float32: of a 38.6M-element gradient
    spread like GPT-2's tied embedding (a few large rows among many tiny values) it lost 0.5% here, where the
    GPU's reduction is far closer, so a strategy whose gradients sit on the host (FSDP2's offload_policy) read
    0.7% off every other on an H200 for nothing it computed (docs/methodology.md, "Parity"). In float64, a
    chunk at a time, the sum is exact to ~1e-15 wherever it runs."""
    flat = tensor.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for chunk in flat.split(NORM_CHUNK_ELEMENTS):
        total += chunk.to(torch.float64).square().sum()
    return total


@dataclass
class Trainer(abc.ABC):
    """A wrapped model and optimizer that runs optimizer steps for one rank."""

    context: RankContext
    config: dict[str, Any] = field(default_factory=dict)   # what was configured, recorded in the row
    precision_recipe: PrecisionRecipe = PrecisionRecipe.FP32
    # What this rank multiplies each micro-batch's loss by before backward in the coming step: set by the
    # worker from a silent-corruption fault (harness.rank.faults), None in every honest step.
    loss_multipliers: Sequence[float] | None = None
    # fp16 only: what the last `train_step` did under loss scaling (harness.strategies.loss_scaling), read by
    # the worker after every step; None in fp32 and bf16.
    step_outcome: StepOutcome | None = None

    # False where a strategy's step cannot be stopped between reduction and update (DeepSpeed's pipeline
    # runs both inside `train_batch`); `gradients_ready` is then never called.
    reaches_gradients_ready: ClassVar[bool] = True
    norms_unavailable_because: ClassVar[str] = ""           # why, where it is False
    # True where the reduced gradients are not at hand inside `gradients_ready` and `gradient_norm` reads
    # the norm the library computed during its own optimizer step instead (DeepSpeed ZeRO).
    gradient_norm_after_step: ClassVar[bool] = False

    @abc.abstractmethod
    def train_step(self, micro_batches: Sequence[MicroBatch],
                   gradients_ready: GradientsReady | None = None) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the mean loss it saw (detached).
        Calls `gradients_ready` (if given) after the gradients are reduced and before the update."""

    @abc.abstractmethod
    def model_state_tensors(self) -> ModelStateTensors:
        """The tensors holding this rank's weights, gradients and optimizer state right now, for the census
        (harness.rank.memory_model): called at `gradients_ready`, or after the step where there is none."""

    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW (`make_adamw`) whose learning rate and state this trainer's step uses: what a
        planted fault changes (harness.rank.faults, `lr-scale` and `weight-copy`). The trainer's `optimizer`
        where it keeps one (Horovod's DistributedOptimizer is a subclass of the AdamW it wraps)."""
        optimizer = getattr(self, "optimizer", None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise NotImplementedError(f"{type(self).__name__} does not name its torch optimizer")
        return optimizer

    def parameters_held(self, whole_model: int) -> int:
        """Parameters this rank's model holds before any sharding (`whole_model` unless the strategy cuts
        the model; a tied weight counts once)."""
        return whole_model

    def parameters_kept_whole(self) -> int:
        """Parameters a sharding strategy also keeps unsharded on this rank beside their shard."""
        return 0

    def expert_parameters_held(self) -> int:
        """Of `parameters_held`, the routed experts' this rank holds where the strategy shards an MoE model's experts
        (`Strategy.expert_parallel_degree`): their states follow its plan over the ranks holding the same experts."""
        return 0

    def local_parameters(self) -> tuple[list[torch.Tensor], bool]:
        """This rank's part of every trainable parameter, each once (a tied weight once), and whether the
        parts are disjoint shards whose squares add up across ranks (True) or whole replicas (False)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its parameters")

    def local_gradients(self) -> tuple[list[torch.Tensor], bool]:
        """The reduced gradients of `local_parameters`, in the same form; valid inside `gradients_ready`."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its gradients")

    def parameter_names(self) -> list[str]:
        """The name of each of `local_parameters` in the unwrapped model (`unwrapped_parameter_names`), in the
        same order."""
        raise NotImplementedError(f"{type(self).__name__} cannot name its parameters")

    def gradient_norm(self) -> float:
        """L2 norm of this step's reduced gradients over every parameter, the same on every rank. Called
        inside `gradients_ready`, or right after the step where `gradient_norm_after_step`."""
        return self.global_norm(*self.local_gradients())

    def parameter_norm(self) -> float:
        """L2 norm over every parameter once, the same on every rank."""
        return self.global_norm(*self.local_parameters())

    def global_norm(self, tensors: Iterable[torch.Tensor], sharded: bool) -> float:
        """L2 norm of the vector `tensors` are (this rank's shards of it where `sharded`; on the device or
        the host). Squares add up in float64 (`squared_norm`), so neither the order of the sum, which differs
        between strategies, nor the device it runs on moves it by anything near a tolerance."""
        squares = torch.zeros((), dtype=torch.float64, device=self.context.device)
        for tensor in tensors:
            squares += squared_norm(tensor).to(squares.device)
        if sharded and self.context.world_size > 1:
            torch.distributed.all_reduce(squares)
        return math.sqrt(squares.item())

    def tensor_norms(self, tensors: Iterable[torch.Tensor], sharded: bool) -> list[float]:
        """The L2 norm of each whole tensor of which `tensors` are this rank's shards where `sharded` (an
        empty shard where a rank holds none of one), else whole: as `global_norm`, in float64, with every
        rank's squares added in one all-reduce."""
        device = self.context.device
        squares = torch.stack([squared_norm(tensor).to(device) for tensor in tensors])
        if sharded and self.context.world_size > 1:
            torch.distributed.all_reduce(squares)
        return squares.sqrt().tolist()

    def global_losses(self, local_losses: torch.Tensor) -> torch.Tensor:
        """Per-step losses of the whole global batch from each rank's `train_step` losses.

        Called once after the timed steps, so its collective never lands in a timed step.
        """
        if self.context.world_size == 1:
            return local_losses
        total = local_losses.clone()
        torch.distributed.all_reduce(total)
        return total / self.context.world_size

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (any picklable object), in rank order; for use outside timed steps."""
        if self.context.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.context.world_size
        torch.distributed.all_gather_object(gathered, value)
        return gathered

    def rank_figures(self) -> dict[str, Any]:
        """Figures of this rank's own that the strategy records (`strategy_figures_by_rank`): an asynchronous
        server's staleness of each update it applied. Nothing by default."""
        return {}

    def combined_step_times(self, times_by_rank: list[list[float]]) -> list[float]:
        """Each timed step's time for the whole launch, from every rank's: a synchronous step ends when its
        slowest rank ends."""
        return [max(per_rank) for per_rank in zip(*times_by_rank)]

    def barrier(self) -> None:
        """All ranks meet here; called before each step's clock starts."""
        if self.context.world_size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """Release the communication library; called once at the end of the cell."""
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class Strategy(abc.ABC):
    """How one parallelisation scheme is launched, validated and wrapped around a workload."""

    name: ClassVar[str]
    # The key of the launcher that starts its ranks, on one host and across nodes alike
    # (harness.launch.launcher.LAUNCHERS); checked when the strategy registers.
    launcher: ClassVar[str]
    description: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()       # importable modules the strategy needs
    options: ClassVar[Mapping[str, Option]] = {}
    comm_interception: ClassVar[str] = "torch.distributed collectives"   # what the counter sees
    # The library call that saves and loads its training state (harness.rank.checkpoint.METHODS: dcp, deepspeed,
    # horovod rank 0, torch.save), with the `checkpoint` option (harness.strategies.state_checkpoint) in its
    # options; "" where it has none.
    checkpoint_method: ClassVar[str] = ""
    # True for the bare loop alone (harness.strategies.bare): the worker runs harness.rank.bare_loop, one clock
    # around all its timed steps, instead of its measured steps.
    times_whole_loop: ClassVar[bool] = False
    # The precision recipes its trainer can run and record (`Trainer.precision_recipe`): fp32 and torch.autocast
    # (`recipe_of`) unless its library brings its own; `recipe_refusal` names why another is not one of them.
    precision_recipes: ClassVar[tuple[PrecisionRecipe, ...]] = (PrecisionRecipe.FP32, PrecisionRecipe.AUTOCAST)
    # Why its cells cannot run `compile=true` (harness.strategies.compiling), or "" where its wrap compiles the blocks.
    # Every strategy takes the option, so that a matrix's `--option compile=true` never runs one eager unsaid.
    cannot_compile_because: ClassVar[str] = ""

    # ---- before launch -------------------------------------------------------------------------

    def check_options(self, given: Mapping[str, OptionValue]) -> None:
        for name, value in given.items():
            if name not in self.options:
                known = ", ".join(sorted(self.options)) or "none"
                raise SpecError(f"strategy {self.name} has no option {name!r}; its options: {known}")
            self.options[name].check(self.name, name, value)

    def resolve_options(self, given: Mapping[str, OptionValue]) -> dict[str, OptionValue]:
        return {name: given.get(name, option.default) for name, option in self.options.items()}

    def resolved(self, spec: RunSpec) -> dict[str, OptionValue]:
        """The options of a cell of this strategy, its defaults included."""
        return self.resolve_options(spec.options_dict)

    def validate(self, spec: RunSpec) -> None:
        """Raise SpecError for combinations this strategy cannot run (beyond the generic checks)."""

    def model_state_plan(self, data_parallel: int, recipe: PrecisionRecipe,
                         options: Mapping[str, OptionValue]) -> ModelStatePlan:
        """What each rank keeps per parameter of weights, gradients and optimizer state under `recipe`,
        and over how many ranks each is sharded (harness.derive.memory turns it into bytes). The default:
        every rank keeps the whole model and its AdamW state (the ZeRO paper's data-parallel baseline)."""
        weights, gradients, optimizer = ADAMW_STATE_BYTES[recipe]
        return zero_plan(0, data_parallel, weights, gradients, optimizer,
                         basis=f"{recipe.value}: torch AdamW over the model's own parameters, whole on every rank")

    def recipe_refusal(self, recipe: PrecisionRecipe) -> str | None:
        """Why this strategy cannot run `recipe` (one line naming whose it is and what it runs), or None if it can:
        a plan under a recipe the strategy never runs describes nothing it could measure."""
        if recipe in self.precision_recipes:
            return None
        *others, last = [r.value for r in self.precision_recipes]
        runs = f"{', '.join(others)} and {last}" if others else last
        return f"recipe {recipe.value} is {RECIPE_SOURCES[recipe]}; {self.name} runs {runs}"

    def model_split(self, replicas: int, tensor_parallel: int, options: Mapping[str, OptionValue]) -> ModelSplit:
        """How this strategy lays out `replicas` data-parallel replicas under `options`, where `tensor_parallel` is
        the degree asked of a strategy whose degree is no option of its own (`tp`, whose ranks are all one
        replica): what `harness memory` divides a model by. The default: each replica one rank, holding it whole."""
        return ModelSplit(data_parallel=replicas)

    def sequence_split_degree(self, world_size: int, options: Mapping[str, OptionValue]) -> int:
        """The ranks a sample's sequence is split over at `world_size` (`harness plan`: each holds 1/degree of its
        tokens and their activations), 1 for a strategy that keeps whole samples on a rank."""
        return 1

    def state_sharding_ranks(self, spec: RunSpec) -> int:
        """The ranks a sharding strategy's model states are spread over in `spec`'s cell (its plan's
        `data_parallel`): its data-parallel replicas, unless ranks of one replica shard them too (a sequence split
        over ranks that hold the same samples: harness.strategies.sequence_parallel)."""
        return self.layout(spec).data_parallel

    def expert_parallel_degree(self, world_size: int, options: Mapping[str, OptionValue]) -> int:
        """The ranks an MoE model's routed experts are sharded over at `world_size` (`harness memory`, `harness plan`:
        each rank holds experts / degree of them); 0 for a strategy that shards no experts, which an MoE model's
        experts pass through replicated (whole on every rank, or as its other states are)."""
        return 0

    def described_traffic_bytes(self, parameters: int, recipe: PrecisionRecipe,
                                options: Mapping[str, OptionValue]) -> TrafficBytes:
        """`traffic_bytes` of a model known by its parameter count alone (`harness plan`), every parameter taken as a
        linear layer's, as nearly all of a transformer's are. The default: gradients reduced and parameters gathered
        in the bytes `recipe` keeps them in (ADAMW_STATE_BYTES: fp32 under torch.autocast)."""
        weights, gradients, _ = ADAMW_STATE_BYTES[recipe]
        return TrafficBytes(parameters=parameters, gradients_reduced=gradients * parameters,
                            parameters_gathered=weights * parameters)

    def across_replicas(self, options: Mapping[str, OptionValue]) -> str | None:
        """The data-parallel strategy whose collectives this one runs among its replicas, each replica's share of
        the parameters in place of the model (a 2-D mesh's FSDP2, AutoTP's ZeRO, a pipeline stage's all-reduce), for
        a model known by its parameter count alone; None where its replicas are the whole of its traffic (the
        data-parallel strategies' own `expected_collectives`) or it has none (`tp`)."""
        return None

    def usual_mixed_recipe(self) -> tuple[PrecisionRecipe, dict[str, OptionValue]]:
        """The 16-bit recipe this strategy's users run, and the options that select it (`harness plan` lays each
        strategy out so; the GPU matrices run FSDP2 so): torch.autocast over fp32 weights unless its library brings
        its own (DeepSpeed's bf16 section, FSDP2's MixedPrecisionPolicy)."""
        return PrecisionRecipe.AUTOCAST, {}

    def working_memory_bytes(self, rank: RankParameters, recipe: PrecisionRecipe,
                             options: Mapping[str, OptionValue]) -> dict[str, float]:
        """Bytes this strategy keeps on a rank beyond its model states and the activations at its step's peak, by
        name, for a rank of a described layout (`harness plan`, `harness memory`): its communication buffers
        ("buckets"), parameters gathered from their shards ("gathered"), unsharded gradients kept from one
        micro-batch to the next ("accumulated gradients"). None here: a strategy that keeps any says which."""
        return {}

    def checkpoint_holds(self, options: Mapping[str, OptionValue]) -> tuple[str, ...]:
        """The model-state components (harness.derive.memory.COMPONENTS) its checkpoint writes: weights and optimizer
        state, never gradients, which the next step makes again."""
        return ("weights", "optimizer")

    def checkpoint_contents(self, recipe: PrecisionRecipe, options: Mapping[str, OptionValue]) -> CheckpointContents:
        """Bytes per parameter one checkpoint of this strategy's job holds under `recipe`: the components its
        checkpoint writes (`checkpoint_holds`) as its plan keeps them, each once over the job
        (harness.derive.checkpoint.held_once). A strategy whose plan is not the job's says so by overriding this."""
        return held_once(self.model_state_plan(1, recipe, options), self.checkpoint_holds(options))

    def deepspeed_estimate_bytes(self, parameters: int, largest_module_parameters: int, gpus_per_node: int,
                                 nodes: int, options: Mapping[str, OptionValue]) -> float | None:
        """DeepSpeed's own estimate of a rank's model-state bytes (harness.rank.memory_model.deepspeed_estimate),
        where DeepSpeed has one for this strategy (ZeRO-2/3); None elsewhere."""
        return None

    def layout(self, spec: RunSpec) -> Layout:
        replicas = spec.world_size
        per_replica = spec.global_batch // replicas
        return Layout(data_parallel=replicas, pipeline_stages=1, per_replica_batch=per_replica,
                      micro_batches=max(1, per_replica // spec.micro_batch))

    def layout_refusal(self, spec: RunSpec) -> str | None:
        """Why this strategy cannot lay out `spec`'s model over its ranks on any machine (a tensor-parallel
        degree that does not divide the heads, tensor parallelism across nodes), or None: a skip before launch,
        and a size the projection leaves out."""
        return None

    def compile_refusal(self, spec: RunSpec) -> str | None:
        """Why a compiled cell (`compile=true`, harness.strategies.compiling) of this strategy cannot run, in one line,
        or None."""
        if self.cannot_compile_because and spec.options_dict.get("compile"):
            return f"{self.name} cannot run compile=true: {self.cannot_compile_because}"
        return None

    def skip_reason(self, spec: RunSpec, machine: "Machine | None" = None) -> str | None:
        """Why this cell cannot run on `machine` (checked before launch), or None. None: this host, as seen
        here; a Machine: the nodes a dry run plans for (harness.launch.dry_run), whose devices are as it says."""
        refusal = (self.layout_refusal(spec) or offload_refusal(spec, self.resolved(spec))
                   or self.compile_refusal(spec))
        if refusal:
            return refusal
        # Judged here even for a planned machine: its nodes run this interpreter (the same path) or an image
        # built from this checkout, and nothing else tells what they have installed.
        missing = [module for module in self.requires if not _importable(module)]
        if missing:
            return f"{self.name} needs {', '.join(missing)}, which is not installed here"
        has_cuda = torch.cuda.is_available() if machine is None else machine.device is DeviceKind.CUDA
        if spec.device is DeviceKind.CUDA and not has_cuda:
            return "device cuda requested but no CUDA device is visible"
        return None

    # ---- inside a rank ---------------------------------------------------------------------------

    def instrument(self, counter: Any) -> None:
        """Let a `harness.rank.comm_counter.CollectiveCounter` see this strategy's collectives (called first)."""
        counter.install_torch()

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        """Why a communication-free run of a rank's own work would not be comparable (empty if it is)."""
        return ""

    def compute_only_plan(self, spec: RunSpec) -> ComputeOnlyPlan:
        """This rank's own work without communication. Default: the whole model and a full optimizer step,
        fp32 weights, autocast in bf16 (what every replicating strategy's rank does)."""
        return ComputeOnlyPlan(autocast=spec.precision.is_mixed)

    def expected_traffic(self, spec: RunSpec, layers: Sequence[nn.Module]) -> ExpectedTraffic:
        """The collectives one optimizer step should issue per rank, from freshly built (unwrapped) layers."""
        layout = self.layout(spec)
        return self.expected_collectives(data_parallel=layout.data_parallel, micro_batches=layout.micro_batches,
                                         options=self.resolved(spec),
                                         traffic=self.traffic_bytes(spec, nn.Sequential(*layers)))

    def traffic_bytes(self, spec: RunSpec, model: nn.Module) -> TrafficBytes:
        """Gradient bytes as reduced and parameter bytes as gathered. Default: in the weights' own dtype
        (fp32; torch.autocast computes in bf16 but keeps fp32 weights and gradients)."""
        parameters = list(model.parameters())
        total = sum(p.numel() * p.element_size() for p in parameters)
        return TrafficBytes(parameters=sum(p.numel() for p in parameters), gradients_reduced=total,
                            parameters_gathered=total)

    def gradient_reduce_dtypes(self, spec: RunSpec, model: nn.Module) -> tuple[str, ...]:
        """The dtypes (torch's names, sorted) the gradient reduction of a step communicates gradients in, from
        freshly built (unwrapped) layers: parity's tolerances depend on it (harness.derive.parity). Default:
        the weights' own dtype, as `traffic_bytes` (fp32 under torch.autocast)."""
        return tuple(sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}))

    def planned_parameters_held(self, spec: RunSpec, layers: Sequence[nn.Module]) -> int:
        """Parameters one rank holds before any sharding under `spec`'s layout, from unwrapped layers (a tied
        weight once): the whole model, unless the strategy cuts it (`Trainer.parameters_held` is what a run
        measured)."""
        unique = {id(p): p for layer in layers for p in layer.parameters()}
        return sum(p.numel() for p in unique.values())

    def bubble_factor(self, options: Mapping[str, OptionValue], micro_batches: int) -> float:
        """A step's time over its ranks' own work, from the schedule alone: 1, except a pipeline's, whose stages
        wait while it fills and drains."""
        return 1.0

    def expected_collectives(self, *, data_parallel: int, micro_batches: int, options: Mapping[str, OptionValue],
                             traffic: TrafficBytes) -> ExpectedTraffic:
        """The collectives a step of `micro_batches` micro-batches among `data_parallel` replicas issues."""
        return ExpectedTraffic(not_modelled_because=f"strategy {self.name} does not model its traffic")

    def point_to_point(self, options: Mapping[str, OptionValue]) -> tuple[str, int]:
        """How the step's sends and receives load the network, for the projection's pricing
        (harness.project.collectives), and over how many hubs: ("chain", 0) by default, each send one hop to a peer
        that receives it while it sends on (a pipeline's stages), so a recv costs nothing of its own; ("star", S)
        where every data-parallel rank sends to and receives from each of S ranks of their own (a dedicated
        parameter server), whose links carry every message in turn."""
        return "chain", 0

    def wire_calls(self, *, collective: str, counted_calls: float, bytes_per_step: float, backward_s: float,
                   options: Mapping[str, OptionValue]) -> float:
        """How many collectives the `counted_calls` submitted per step (of `collective`, `bytes_per_step` in
        all) become on the wire, where gradients become ready over `backward_s`: as many, unless the library
        fuses what it is handed (Horovod)."""
        return counted_calls

    @abc.abstractmethod
    def start(self, spec: RunSpec) -> RankContext:
        """Start the communication library in this process and say where the rank stands."""

    @abc.abstractmethod
    def wrap(self, spec: RunSpec, context: RankContext, workload: Workload,
             layers: list[nn.Module]) -> Trainer:
        """Wrap freshly built (identically seeded) layers and an AdamW optimizer for training."""

    def sample_indices(self, spec: RunSpec, context: RankContext, micro_batch_index: int) -> torch.Tensor:
        """Global sample indices this process feeds in one micro-batch of a step."""
        from workloads.data import rank_sample_indices

        layout = self.layout(spec)
        return rank_sample_indices(replica=self.replica(spec, context), micro_batch_index=micro_batch_index,
                                   micro_batches=layout.micro_batches, micro_batch=spec.micro_batch)

    def replica(self, spec: RunSpec, context: RankContext) -> int:
        """This rank's data-parallel index."""
        return context.rank

    def rank_batch(self, spec: RunSpec, context: RankContext, batch: MicroBatch) -> MicroBatch:
        """What this rank feeds of a micro-batch of its replica's samples: all of it, unless the strategy splits a
        sample over ranks (Ulysses: the rank's slice of the sequence). The step's data, made before its clock
        starts."""
        return batch


# ---- pieces shared by the strategies -------------------------------------------------------------


def make_adamw(parameters, device: torch.device) -> torch.optim.AdamW:
    """The common optimizer: fused kernels on CUDA (what a tuned job uses), the reference loop on CPU."""
    implementation = {"fused": True} if device.type == "cuda" else {"foreach": False}
    return torch.optim.AdamW(parameters, **ADAMW_HYPERPARAMETERS, **implementation)


def optimizer_description(device: torch.device) -> dict[str, Any]:
    return {"optimizer": "torch.optim.AdamW", **{k: list(v) if isinstance(v, tuple) else v
                                                  for k, v in ADAMW_HYPERPARAMETERS.items()},
            "optimizer_impl": "fused" if device.type == "cuda" else "single-tensor"}


AUTOCAST_DTYPES: Mapping[Precision, torch.dtype] = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def autocast(spec: RunSpec, device: torch.device) -> contextlib.AbstractContextManager:
    """torch.autocast for bf16 and fp16 runs (fp32 weights, 16-bit compute); a no-op for fp32."""
    if spec.precision.is_mixed:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[spec.precision])
    return contextlib.nullcontext()


def half_dtype_names(spec: RunSpec) -> tuple[str, ...]:
    """torch's name of the 16-bit dtype autocast computes in under `spec`'s precision (none in fp32)."""
    return (str(AUTOCAST_DTYPES[spec.precision]).removeprefix("torch."),) if spec.precision.is_mixed else ()


def recipe_of(spec: RunSpec) -> PrecisionRecipe:
    """The recipe of a strategy that runs every 16-bit precision under torch.autocast."""
    return PrecisionRecipe.AUTOCAST if spec.precision.is_mixed else PrecisionRecipe.FP32


def torchrun_context(device_kind: DeviceKind) -> RankContext:
    """Start torch.distributed from the environment torchrun (or DeepSpeed's launcher, which sets the same
    variables) gives each rank: NCCL with one GPU per rank, else gloo.

    Ranks outnumbering the GPUs share them over gloo (NCCL refuses two ranks on one GPU); such runs are
    marked `shared_device` and only good for memory and correctness.
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # torchrun says LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
    device, backend, shared = place_rank(device_kind, local_rank, local_world_size)
    check_rendezvous_host(os.environ.get("MASTER_ADDR", ""))
    # Also at world size 1: the wrappers need a process group, and their cost there is what we measure.
    if not torch.distributed.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        torch.distributed.init_process_group(backend=backend, **kwargs)
    return RankContext(rank=rank, world_size=world_size, local_rank=local_rank,
                       local_world_size=local_world_size, device=device, backend=backend, shared_device=shared)


def check_rendezvous_host(address: str) -> None:
    """Stop at once, in one line, where the rendezvous host does not resolve here: the store's client would
    otherwise retry it until the launch's timeout (a container with its own host name and no network waited
    613 s) and the row would say only that the cell timed out."""
    if not address:
        return
    try:
        socket.getaddrinfo(address, None)
    except (socket.gaierror, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise RuntimeError(f"the rendezvous host MASTER_ADDR={address!r} does not resolve on host "
                           f"{socket.gethostname()!r} ({reason}); give the launcher an address this host "
                           "resolves, or add the name to /etc/hosts") from None


def place_rank(device_kind: DeviceKind, local_rank: int, local_world_size: int) -> tuple[torch.device, str, bool]:
    """(device, collective backend, shared) for a rank on this host."""
    if device_kind is DeviceKind.CPU:
        return torch.device("cpu"), "gloo", False
    count = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(device)
    shared = local_world_size > count
    return device, ("gloo" if shared else "nccl"), shared


def accumulate(model: nn.Module | Callable, loss_fn: Callable, micro_batches: Sequence[MicroBatch],
               spec: RunSpec, device: torch.device,
               no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
               multipliers: Sequence[float] | None = None,
               scaler: torch.amp.GradScaler | None = None,
               around: Callable[[MicroBatch], tuple[contextlib.AbstractContextManager, MicroBatch]] | None = None,
               ) -> torch.Tensor:
    """Forward and backward over micro-batches, each loss scaled by 1/K so gradients are the batch mean.

    `no_sync` (DDP's, for instance) suppresses gradient communication on all but the last micro-batch.
    `multipliers` (a fault's, `Trainer.loss_multipliers`) scale each micro-batch's loss before backward.
    `scaler` (fp16's, harness.strategies.loss_scaling) multiplies what backward starts from by its scale.
    `around` (context parallelism's) gives a micro-batch's forward and backward a context to run in and the tensors
    to run on (which that context may shard in place).
    Returns the mean unscaled loss (detached).
    """
    count = len(micro_batches)
    total = torch.zeros((), device=device)
    for index, batch in enumerate(micro_batches):
        last = index == count - 1
        context = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        sequence, (inputs, targets) = around(batch) if around is not None else (contextlib.nullcontext(), batch)
        with context, saved_on_host(spec), sequence:
            with autocast(spec, device):
                outputs = model(inputs)
            loss = loss_fn(outputs, targets)
            scaled = (loss if multipliers is None else loss * multipliers[index]) / count
            (scaled if scaler is None else scaler.scale(scaled)).backward()
        # A DTensor loss (tensor parallelism's loss_parallel: every rank holds the whole value) as a plain tensor.
        total += loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
    return total / count


def apply_update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> StepOutcome | None:
    """The optimizer step: plain, or through fp16's loss scaler (skipped on an inf or NaN gradient), whose
    outcome it returns (None without one)."""
    if scaler is None:
        optimizer.step()
        return None
    return scaler_step(scaler, optimizer)


# What wrappers put into a parameter's name in the model they wrap: DDP and DataParallel a leading `module.`,
# torch.compile `_orig_mod.`, FSDP1 and activation checkpointing their own parts wherever they wrap. FSDP2 and
# DeepSpeed keep the names of the module they were given.
WRAPPER_NAME_PREFIX = "module."
WRAPPER_NAME_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def unwrapped_parameter_names(model: nn.Module) -> list[str]:
    """`Trainer.parameter_names` of `model`: each trainable parameter once (a tied weight under its first
    name), named as in the unwrapped model, so that every strategy's names match the plain loop's."""
    names = []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            while name.startswith(WRAPPER_NAME_PREFIX):
                name = name[len(WRAPPER_NAME_PREFIX):]
            names.append(".".join(part for part in name.split(".") if part not in WRAPPER_NAME_PARTS))
    return names


def replicated_parameters(model: nn.Module) -> tuple[list[torch.Tensor], bool]:
    """`Trainer.local_parameters` of a model every rank holds whole: each trainable parameter once
    (`nn.Module.parameters` yields a tied weight once)."""
    return [p for p in model.parameters() if p.requires_grad], False


def replicated_gradients(model: nn.Module) -> tuple[list[torch.Tensor], bool]:
    """`Trainer.local_gradients` of a model every rank holds whole, after its gradients are reduced."""
    return [p.grad for p in model.parameters() if p.requires_grad], False


BLOCK_CLASS_NAMES = ("Block", "LlamaBlock", "BasicBlock", "Bottleneck")


def is_block(layer: nn.Module) -> bool:
    """Layers that are repeated units of the model (residual or transformer blocks), for per-block wrapping; a
    block inside activation checkpointing's wrapper (harness.strategies.checkpointing) or compiled
    (harness.strategies.compiling) is one too."""
    from workloads.gpt import Block
    from workloads.llama import LlamaBlock
    from workloads.resnet import BasicBlock, Bottleneck

    layer = getattr(layer, "_orig_mod", layer)            # torch.compile's OptimizedModule
    layer = getattr(layer, "_checkpoint_wrapped_module", layer)
    return isinstance(layer, (Block, LlamaBlock, BasicBlock, Bottleneck))


def _importable(module: str) -> bool:
    """Whether `module` can be found; a submodule whose parent is absent or fails to import cannot."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
