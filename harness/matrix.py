"""Matrices: plain functions from the machine and the user's selection to a list of `RunSpec`s.

    python -m harness list
    python -m harness run --matrix scaling --dry-run --device cuda --gpus-per-node 8 --nnodes 4

A new experiment is a new function here, added to MATRICES. Each matrix follows the machine it is planned
for (harness.machine): on CPU the small workloads and world sizes up to the cores, on GPUs ResNet-50 and
GPT-2 and world sizes up to the GPUs, across nodes where there are several.

A workload's batch plan fixes two things. The micro-batch is the same at every world size (fewer ranks
accumulate more micro-batches), so every world size computes the same per-micro-batch statistics
(BatchNorm) and its losses can be compared with the plain single-device reference at the same global
batch. The per-device batch is what one data-parallel replica takes per step at the largest
data-parallel size the matrix contains; the matrix's global batch is the per-device batch times that
size, so every smaller world size (a divisor of it) splits the same global batch with the same
micro-batch.

A 16-bit cell of a strategy whose users run another recipe than the strategy's default (`USERS_RECIPES`: FSDP2's
MixedPrecisionPolicy) runs that recipe on GPUs in every matrix (`Cells.add`), the strategy's default beside it as a
variant in `full`; the user's --option wins over both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from harness.derive.gate import DEFAULT_ALPHA, METRIC_NAMES, launches_needed_a_side
from harness.derive.harness_overhead import BARE_STRATEGY
from harness.derive.parity import DETERMINISTIC_DEVICES, NOISE_FLOOR_LAUNCHES, REFERENCE_STRATEGY
from harness.launch_order import LaunchOrder, round_robin, value_first
from harness.machine import Machine
from harness.spec import DeviceKind, Precision, RunSpec, SpecError
from harness.launch.launcher import get_launcher
from harness.strategies import STRATEGIES, checked, get_strategy
from workloads import get_workload
from workloads.base import Family


@dataclass(frozen=True)
class Selection:
    """The user's filters; None keeps the matrix's own choice."""

    workloads: tuple[str, ...] | None = None
    strategies: tuple[str, ...] | None = None
    world_sizes: tuple[int, ...] | None = None
    repeats: int | None = None
    overrides: tuple[tuple[str, object], ...] = ()   # RunSpec fields replacing the matrix's choice
    options: tuple[tuple[str, object], ...] = ()     # strategy options, each given to the cells having it

    def options_for(self, strategy: str) -> dict[str, object]:
        own = STRATEGIES[strategy].options
        return {name: own[name].given(value) for name, value in self.options if name in own}


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int         # samples per forward/backward on one rank
    per_device_batch: int    # samples per data-parallel replica per step at the matrix's largest data-parallel size
    warmup_steps: int
    timed_steps: int

    def __post_init__(self) -> None:
        if self.per_device_batch % self.micro_batch:
            raise ValueError(f"per_device_batch {self.per_device_batch} must be a multiple of micro_batch "
                             f"{self.micro_batch}")

    def global_batch(self, largest_data_parallel: int) -> int:
        return self.per_device_batch * largest_data_parallel


# Per-device 8 in micro-batches of 4: the 2-core results so far (global 16 at world sizes 1 and 2) stay
# the same, and a rank at the largest size still accumulates two micro-batches.
CPU_PLANS = {
    "resnet20-cifar": BatchPlan(micro_batch=4, per_device_batch=8, warmup_steps=3, timed_steps=10),
    "gpt-tiny": BatchPlan(micro_batch=4, per_device_batch=8, warmup_steps=3, timed_steps=10),
    # gpt-tiny's plan: the two transformer families' cells side by side at the same batch and steps.
    "llama-tiny": BatchPlan(micro_batch=4, per_device_batch=8, warmup_steps=3, timed_steps=10),
}
# The batches a bare training loop (bf16 autocast, fused AdamW) ran at on one H100 80GB (ResNet-50 at 256
# images, ~3,970 img/s and 11.1 GiB peak; GPT-2 small at 16 x 1024 tokens, ~341k tokens/s and 14.5 GiB peak): they
# keep an H100-class GPU busy and leave most of its 80 GB for what a wrapper adds (buckets, gathered shards,
# a pipeline's micro-batches in flight). Micro-batch = per-device batch, so at the largest size each rank
# runs one forward/backward per step as a tuned job would, its plain reference compares with the bare
# loop, and only smaller world sizes accumulate.
# The Llamas at their presets' sequences, each micro-batch the plan's own memory (harness.project.rank_memory, `harness
# memory`) holds on an 80 GB GPU. Llama 3.2 1B (2048 tokens): 4 samples, 49.3 GiB under DDP at world size 1 (18.4
# model states + 14.7 activations + 13.7 logits and loss + the 2.5 allowance), ZeRO-3 57.3; 8 would need 75.9 with no
# room for what a strategy adds. Llama 3 8B (8192 tokens): one sample, the least there is; it fits only sharded or
# split over a node (tp over 8 GPUs 63.1 GiB; FSDP2 with its policy 80.5; ZeRO-3 under autocast 99.4, which an H200's
# 141 GB holds): every cell the plan says is well over the GPU's memory is skipped before launch, with its figures
# (harness.memory_fit), the rest launched.
GPU_PLANS = {
    "resnet50": BatchPlan(micro_batch=256, per_device_batch=256, warmup_steps=5, timed_steps=20),
    "gpt2-small": BatchPlan(micro_batch=16, per_device_batch=16, warmup_steps=5, timed_steps=20),
    "llama3.2-1b": BatchPlan(micro_batch=4, per_device_batch=4, warmup_steps=5, timed_steps=20),
    "llama3-8b": BatchPlan(micro_batch=1, per_device_batch=1, warmup_steps=3, timed_steps=10),
}

# The references: the plain loop (parity's, the projection's compute) and the bare loop timed whole (the harness's
# own cost on the plain loop, harness.derive.harness_overhead); one device each.
REFERENCES = (REFERENCE_STRATEGY, BARE_STRATEGY)
# The strategies that shard an MoE model's experts: they run on the `moe` matrix's MoE workloads alone.
EXPERT_PARALLEL = ("ep", "horovod-ep", "deepspeed-moe")
# The strategies that split a sample's sequence over ranks: they run on the `long-context` matrix's workloads alone.
SEQUENCE_PARALLEL_STRATEGIES = ("ulysses", "cp")
ALL_BUT_REFERENCES = tuple(name for name in STRATEGIES
                           if name not in (*REFERENCES, *EXPERT_PARALLEL, *SEQUENCE_PARALLEL_STRATEGIES))
ASYNCHRONOUS_PS = "ps-async"

# The strategies whose users' 16-bit recipe (`Strategy.usual_mixed_recipe`) the GPU matrices run in each 16-bit cell
# (`Cells.users_recipe`): FSDP2's users gather bf16 parameters for compute and reduce gradients in fp32 with its
# MixedPrecisionPolicy, as torchtitan does, where FSDP2's default here is autocast over fp32 shards, as every other
# strategy's. CPU matrices keep the default, which the CPU parity noise and the committed expectations were measured
# on, and `full` runs the policy beside it. (DeepSpeed's users' bf16 section is `harness plan`'s recipe for ZeRO; the
# matrices keep its torch_autocast section, every ZeRO row's so far, whose parity tolerances are measured.)
USERS_RECIPES = ("fsdp2",)
# Families the users' recipes do not run on: a BatchNorm's fp32 running statistics meet its 16-bit weight ("expected
# scalar type BFloat16 but found Float" on CPU, measured on ResNet-20; "Expected running_mean to have type BFloat16"
# on GPUs, pytorch/torchtitan#674). FSDP2 runs it only with each BatchNorm in a fully_shard unit of its own under an
# fp32 policy, which the strategy does not do: ResNet's cells keep autocast.
BATCH_NORM_FAMILIES = (Family.RESNET,)


def _plans(machine: Machine, select: Selection, plans: dict[DeviceKind, dict[str, BatchPlan]],
           what: str = "batch plan") -> dict[str, BatchPlan]:
    own = plans[machine.device]
    if select.workloads is None:
        return dict(own)
    for name in select.workloads:
        get_workload(name)  # an unknown name fails here, listing the known ones
    missing = [w for w in select.workloads if w not in own]
    if missing:
        raise SpecError(f"no {what} for workload(s) {', '.join(missing)} on {machine.device.value}; "
                        f"allowed: {', '.join(own)}")
    return {w: own[w] for w in select.workloads}


def spans_nodes(strategy: str) -> bool:
    """Whether a strategy's ranks can spread over nodes: a single-process launcher (DataParallel's one
    process driving a node's GPUs) cannot."""
    return get_launcher(get_strategy(strategy).launcher).spans_nodes


def _powers_of_two_up_to(limit: int) -> tuple[int, ...]:
    sizes = [1]
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def _largest_data_parallel(sizes: Iterable[int]) -> int:
    """The size the per-device batch is set at: the largest world size, where the sizes are powers of two
    (every matrix's own); their least common multiple otherwise (a user's --world-sizes 2,3), so that each
    still divides the global batch. A pipeline's data-parallel size (world size / stages) divides its world
    size, so it divides the global batch too."""
    return math.lcm(*sizes)


@dataclass(frozen=True)
class Plan:
    """How one matrix lays out its cells on a machine, before the user's strategy filter."""

    strategies: tuple[str, ...]     # besides the plain reference
    world_sizes: tuple[int, ...]
    repeats: int
    precision: Precision
    # Launches of the plain and bare loops where the user gave no --repeats (at least `repeats`): the harness's cost
    # is their ratio, which one launch a side leaves to the machine's noise (harness.derive.harness_overhead).
    reference_repeats: int = 1


def holds_evenly(machine: Machine, ranks: int) -> bool:
    """Whether some count of the machine's nodes holds `ranks` evenly, each node at most its devices (a launch
    spreads its ranks evenly over whole nodes): W workers and S servers beside them often do not. One CPU host holds
    any count, its ranks sharing its cores where they outnumber them, as in every multi-rank check on a small host
    (the rows say so)."""
    if machine.device is DeviceKind.CPU and machine.nodes == 1:
        return True
    return any(ranks % nodes == 0 and ranks // nodes <= machine.devices_per_node
               for nodes in range(1, machine.nodes + 1))


class Cells:
    """Builds a matrix's specs from its plan and the user's selection, each cell once."""

    def __init__(self, machine: Machine, select: Selection, plan: Plan):
        self.machine, self.select, self.plan = machine, select, plan
        self.sizes = select.world_sizes if select.world_sizes is not None else plan.world_sizes
        for size in self.sizes:     # before the global batch is made from them
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise SpecError(f"world_size must be a whole number >= 1, got {size!r}")
        repeats = select.repeats
        if repeats is not None and (isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1):
            raise SpecError(f"repeats must be a whole number >= 1, got {repeats!r}")   # 0 is not "the default"
        self.repeats = plan.repeats if repeats is None else repeats
        self.largest = _largest_data_parallel(self.sizes)
        self.chosen = select.strategies if select.strategies is not None else ("plain", *plan.strategies)
        self._by_cell: dict[str, RunSpec] = {}

    def sizes_for(self, strategy: str) -> tuple[int, ...]:
        if strategy in REFERENCES:
            return (1,)
        if self.servers_beside(strategy):
            return self.sizes_with_servers(strategy)
        if not spans_nodes(strategy):
            return tuple(size for size in self.sizes if size <= self.machine.devices_per_node)
        return self.sizes

    def sizes_with_servers(self, strategy: str) -> tuple[int, ...]:
        """ps-async's launches: each world size of 2 or more as its workers, and its server ranks beside them (so
        the workers share the global batch as the others' ranks do, and staleness needs two workers), where some
        count of the machine's nodes holds them evenly (`holds_evenly`)."""
        sizes = tuple(size + self.servers_beside(strategy) for size in self.sizes if size >= 2)
        return tuple(size for size in sizes if holds_evenly(self.machine, size))

    def servers_beside(self, strategy: str) -> int:
        """The ranks of a generic matrix's launch that are not its workers: the servers of a strategy that always
        launches them beside its workers (ps-async; the user's --option servers), else 0."""
        if not getattr(get_strategy(strategy), "servers_beside_workers", False):
            return 0
        return int(self.select.options_for(strategy).get("servers", 1))

    def add(self, workload: str, plan: BatchPlan, strategy: str, world_size: int, global_batch: int,
            options: dict[str, object] | None = None, precision: Precision | None = None, nnodes: int = 1,
            own_recipe: bool = False, repeats: int | None = None) -> None:
        """One cell; `options` are the matrix's choice for it (the user's --option wins), `precision` replaces the
        plan's, `nnodes` asks for a cell that spans nodes whatever its placement would choose (one that loses a
        node on purpose), `own_recipe` keeps the strategy's own 16-bit recipe where its users run another
        (`users_recipe`): the variant beside theirs, and `repeats` sets its launches where the user gave no --repeats
        (parity's floor still raises the plain loop's)."""
        if strategy not in self.chosen:
            return
        if options is None:     # two-way model parallelism where there are two ranks; a parameter server whose
            # every rank is a worker (serving a shard too), so that its workers are the world size as everywhere
            options = {"pipeline": {"stages": min(2, world_size)}, "fsdp2-tp": {"tp": min(2, world_size)},
                       "autotp": {"tp": min(2, world_size)}, "ps": {"placement": "colocated"}}.get(strategy, {})
        asked, repeats = repeats, self.repeats
        if asked is not None and self.select.repeats is None:
            repeats = asked
        elif strategy in REFERENCES and self.select.repeats is None and precision in (None, self.plan.precision):
            # The bare loop runs in the plan's precision alone: a plain loop in another is parity's reference only.
            repeats = max(repeats, self.plan.reference_repeats)
        if strategy == REFERENCE_STRATEGY and self.machine.device.value not in DETERMINISTIC_DEVICES:
            # Parity's tolerances there follow the plain loop's own launch-to-launch noise (harness.derive.parity).
            repeats = max(repeats, NOISE_FLOOR_LAUNCHES)
        fields = dict(workload=workload, strategy=strategy, world_size=world_size, global_batch=global_batch,
                      micro_batch=plan.micro_batch, precision=precision or self.plan.precision,
                      warmup_steps=plan.warmup_steps, timed_steps=plan.timed_steps,
                      repeats=repeats, device=self.machine.device, nnodes=nnodes)
        fields.update(self.select.overrides)
        given = {**options, **self.select.options_for(strategy)}
        spec = RunSpec(**fields, options=given)
        if not own_recipe:      # beneath the matrix's own options and the user's, which win
            spec = spec.replace(options={**self.users_recipe(workload, strategy, spec.precision), **given})
        spec = checked(spec)
        self._by_cell.setdefault(spec.cell_id, spec)

    def users_recipe(self, workload: str, strategy: str, precision: Precision) -> dict[str, object]:
        """The options of the 16-bit recipe `strategy`'s users run (`USERS_RECIPES`) where the matrix's cells take
        it: on GPUs, in bf16 or fp16, on a family it runs on (`BATCH_NORM_FAMILIES`); {} elsewhere."""
        if self.machine.device is not DeviceKind.CUDA or not precision.is_mixed:
            return {}
        if get_workload(workload).family in BATCH_NORM_FAMILIES:
            return {}
        return dict(get_strategy(strategy).usual_mixed_recipe()[1]) if strategy in USERS_RECIPES else {}

    def users_recipe_variants(self, workload: str, plan: BatchPlan, global_batch: int) -> None:
        """Each strategy of `USERS_RECIPES` with its own recipe, at its smallest world size, beside the cells that
        run its users': the recipe every earlier row of the cell ran, and what the users' costs or saves. Where
        the users' recipe does not apply (on CPU, on ResNet) it is the cell already there, added once."""
        for strategy in USERS_RECIPES:
            sizes = self.sizes_for(strategy)
            if sizes:
                self.add(workload, plan, strategy, min(sizes), global_batch, own_recipe=True)

    def strong(self, workload: str, plan: BatchPlan) -> None:
        """Every chosen strategy at each of its world sizes on the matrix's one global batch, and the plain
        reference at that batch."""
        for strategy in self.chosen:
            for world_size in self.sizes_for(strategy):
                self.add(workload, plan, strategy, world_size, plan.global_batch(self.largest))

    def weak(self, workload: str, plan: BatchPlan) -> None:
        """Every chosen strategy at each of its world sizes on the per-device batch times the world size,
        and the plain reference at each of those batches."""
        for strategy in self.chosen:
            for world_size in self.sizes_for(strategy):
                workers = world_size - self.servers_beside(strategy)
                self.add(workload, plan, strategy, world_size, plan.global_batch(workers))
                self.add(workload, plan, "plain", 1, plan.global_batch(workers))

    @property
    def specs(self) -> list[RunSpec]:
        """Each cell once, in the order first added."""
        return list(self._by_cell.values())


def _precision(machine: Machine) -> Precision:
    return Precision.BF16 if machine.device is DeviceKind.CUDA else Precision.FP32


SMOKE_WORKLOADS = {DeviceKind.CPU: ("gpt-tiny",), DeviceKind.CUDA: ("gpt2-small",)}
PLANS = {DeviceKind.CPU: CPU_PLANS, DeviceKind.CUDA: GPU_PLANS}


def smoke(machine: Machine, select: Selection) -> list[RunSpec]:
    """The quickest end-to-end check: the plain reference and DDP at two ranks, on the smallest
    transformer unless --workload names others (each launch costs ~20-40 s of interpreter start-up on a
    2-core machine, so two launches keep it under two minutes there). Two ranks even where there is one
    device: the check is of the communication, not of speed (a CPU core is then oversubscribed, and
    harness.machine warns; ranks share one GPU over gloo)."""
    if select.workloads is None:
        select = dataclasses.replace(select, workloads=SMOKE_WORKLOADS[machine.device])
    cells = Cells(machine, select, Plan(("ddp",), (2,), repeats=1, precision=Precision.FP32))
    for workload, plan in _plans(machine, select, PLANS).items():
        cells.strong(workload, plan)
    return cells.specs


HARNESS_OVERHEAD_LAUNCHES = 5
# A GPU matrix's launches a cell by default: the fewest with which `harness compare` can judge every metric of one
# cell (harness.derive.gate: 1 / C(2k, k) <= alpha / its metrics; 5 at alpha 0.05 and 5 metrics). At 3 it judged
# none of them, so two GPU runs could never be compared at the matrix's own defaults.
GATE_REPEATS = launches_needed_a_side(DEFAULT_ALPHA / len(METRIC_NAMES))


def full(machine: Machine, select: Selection) -> list[RunSpec]:
    """On GPUs, `wide`: every strategy, family and world size. On CPU, the cells that show something new on a small
    machine, in the budget of a newcomer's `make run` (harness.run_cost.DEFAULT_RUN_BUDGET_S): every strategy at the
    largest world size on gpt-tiny, beside the plain loop, one launch each. `--matrix wide` has the rest, and each
    narrowing below is undone where the user chose that dimension:
    - world size 1 of each strategy (`--world-sizes`): its 2-rank cell runs the same arithmetic and communicates;
    - llama-tiny and ResNet-20 (`--workload`): the same strategies on other layers, whose own machinery the tests and
      the ci matrix judge;
    - the bare loop beside 5 plain launches (`--strategy bare`): the harness's cost, a ratio this machine's noise left
      inconclusive at 5 launches a side (+9.3%, 96.8% interval -6.2% to +39.8%, 2026-11-28);
    - FSDP2's bf16 policy cells (`--matrix wide`): bf16 arithmetic on a CPU, judged by the tests."""
    if machine.device is not DeviceKind.CPU:
        return wide(machine, select)
    narrowed = dataclasses.replace(select, workloads=select.workloads or CPU_FULL_WORKLOADS)
    sizes = _powers_of_two_up_to(machine.devices)
    sizes = sizes if select.world_sizes is not None else sizes[-1:]
    cells = Cells(machine, narrowed, Plan(ALL_BUT_REFERENCES, sizes, repeats=1, precision=_precision(machine),
                                          reference_repeats=HARNESS_OVERHEAD_LAUNCHES if _asks_for_bare(select) else 1))
    for workload, plan in _plans(machine, narrowed, PLANS).items():
        cells.strong(workload, plan)
    return cells.specs


# The default matrix's workload on CPU (`full`): the smallest transformer, on which every strategy runs.
CPU_FULL_WORKLOADS = ("gpt-tiny",)


def _asks_for_bare(select: Selection) -> bool:
    return select.strategies is not None and BARE_STRATEGY in select.strategies


def wide(machine: Machine, select: Selection) -> list[RunSpec]:
    """Every strategy on every workload family at world sizes 1, 2, 4, ... up to the devices x nodes
    (DataParallel up to one node's devices; fp32 on CPU, bf16 and GATE_REPEATS launches on GPU), with the plain loop and the bare
    loop beside it (the harness's own cost) at world size 1, 5 launches each unless --repeats says otherwise (the
    5 a bootstrap interval of their medians needs: one launch a side is a draw of the machine's noise).
    On GPUs FSDP2 runs its users' MixedPrecisionPolicy on GPT-2 (USERS_RECIPES), with autocast beside it at the
    smallest world size; ResNet keeps autocast (BATCH_NORM_FAMILIES). On CPU, beside the fp32 cells, FSDP2 with
    the policy in bf16 at world sizes 1 and 2 on the transformers and the plain loop in bf16, their parity
    reference, one launch (`policy_on_cpu`)."""
    repeats = GATE_REPEATS if machine.device is DeviceKind.CUDA else 1
    sizes = _powers_of_two_up_to(machine.devices)
    cells = Cells(machine, select, Plan((BARE_STRATEGY, *ALL_BUT_REFERENCES), sizes, repeats=repeats,
                                        precision=_precision(machine), reference_repeats=HARNESS_OVERHEAD_LAUNCHES))
    for workload, plan in _plans(machine, select, PLANS).items():
        cells.strong(workload, plan)
        cells.users_recipe_variants(workload, plan, plan.global_batch(cells.largest))
        if machine.device is DeviceKind.CPU:
            policy_on_cpu(cells, workload, plan)
    return cells.specs


# FSDP2's policy on CPU at one rank (the bf16 weights' arithmetic alone) and two (its bf16 gathers and fp32
# reduce-scatters besides); larger sizes add no other arithmetic.
POLICY_SIZES_ON_CPU = (1, 2)


def policy_on_cpu(cells: Cells, workload: str, plan: BatchPlan) -> None:
    """FSDP2 with its users' MixedPrecisionPolicy in bf16 at POLICY_SIZES_ON_CPU, at the matrix's global batch, and
    the plain loop in bf16 beside it: the same reference key, the policy's rows held to parity's bf16-weights
    tolerances. Only where the user chose FSDP2 (the bf16 plain loop has nothing else to judge), the family runs the
    policy (not ResNet-20: BATCH_NORM_FAMILIES) and the user set no --precision, which puts every cell in one
    precision (the policy is then theirs to ask for, with --option mixed_precision=policy)."""
    if ("fsdp2" not in cells.chosen or get_workload(workload).family in BATCH_NORM_FAMILIES
            or "precision" in dict(cells.select.overrides)):
        return
    global_batch = plan.global_batch(cells.largest)
    sizes = [size for size in cells.sizes_for("fsdp2") if size in POLICY_SIZES_ON_CPU]
    if sizes:
        cells.add(workload, plan, REFERENCE_STRATEGY, 1, global_batch, precision=Precision.BF16)
    for world_size in sizes:
        cells.add(workload, plan, "fsdp2", world_size, global_batch, options=dict(get_strategy("fsdp2").usual_mixed_recipe()[1]),
                  precision=Precision.BF16)


DATA_PARALLEL = ("ddp", "horovod", "fsdp2", "zero1", "zero2", "zero3")
# The parameter servers beside them: the baseline all-reduce replaced (Sergeev and Del Balso 2018).
SCALING_STRATEGIES = (*DATA_PARALLEL, "ps", ASYNCHRONOUS_PS)


def scaling(machine: Machine, select: Selection) -> list[RunSpec]:
    """Strong and weak scaling of the data-parallel strategies and the parameter servers (ps with a shard on every
    rank, ps-async with a server beside its workers) over world sizes 1, 2, 4, ... up to the
    devices x nodes: strong keeps the global batch of the largest size, weak keeps the per-device batch;
    the plain loop at each global batch is the reference (harness.derive.scaling)."""
    sizes = _powers_of_two_up_to(machine.devices)
    repeats = GATE_REPEATS if machine.device is DeviceKind.CUDA else 3
    cells = Cells(machine, select, Plan(SCALING_STRATEGIES, sizes, repeats=repeats, precision=_precision(machine)))
    for workload, plan in _plans(machine, select, PLANS).items():
        cells.strong(workload, plan)
        if "global_batch" not in dict(select.overrides):    # a global batch the user fixed has no weak series
            cells.weak(workload, plan)
    return sorted(cells.specs, key=lambda s: (s.workload, s.strategy != "plain", s.strategy, s.world_size,
                                             s.global_batch))


# Memory, not speed, is the point: one sample per rank per step keeps activations small beside the
# model states being measured, and the runs short.
MEMORY_PLANS = {
    # Per-device 4 in one micro-batch of 4: the 2-core results so far (global 8 at 2 ranks) stay the same.
    DeviceKind.CPU: {"gpt-tiny": BatchPlan(micro_batch=4, per_device_batch=4, warmup_steps=2, timed_steps=3)},
    DeviceKind.CUDA: {name: BatchPlan(micro_batch=1, per_device_batch=1, warmup_steps=2, timed_steps=5)
                      for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama3.2-1b", "llama3-8b")},
}
MEMORY_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")


def zero_memory(machine: Machine, select: Selection) -> list[RunSpec]:
    """Peak memory per rank of DDP, ZeRO-1/2/3 and FSDP2 against the ZeRO paper's prediction, on the
    transformer family (GPT-2 small to xl on GPUs; a cell that runs out of memory is a finding, recorded
    as oom) at the largest world size, two ranks at least (sharding over one rank shows nothing; two
    ranks share one device where there is one, valid for memory); short runs."""
    largest = max(2, _powers_of_two_up_to(machine.devices)[-1])
    cells = Cells(machine, select, Plan(MEMORY_STRATEGIES, (largest,), repeats=1, precision=_precision(machine)))
    for workload, plan in _plans(machine, select, MEMORY_PLANS, "memory-sweep plan").items():
        cells.strong(workload, plan)
    return cells.specs


# The exact gate's cells (harness.derive.expectations): five steps are the four parity compares
# (harness.derive.parity.PARITY_STEPS) and a second warm-up step, in which the model-state census is read (it
# needs the optimizer state the first update makes); the collectives are counted over the three timed ones.
# The same steps as the test suite's shared cells (tests/launch_streams.py), so those rows meet the same
# expectations. A figure that does not depend on the machine needs no more steps than that.
CI_PLANS = {kind: {name: BatchPlan(micro_batch=4, per_device_batch=8, warmup_steps=2, timed_steps=3)
                   for name in ("gpt-tiny", "llama-tiny")}
            for kind in DeviceKind}
# The exact gate runs every strategy on gpt-tiny, and on llama-tiny the machinery its family brings of its own, one
# cell each: FSDP2's per-block units around grouped-query blocks and an untied head, and tp's layout (q split by
# heads, k and v by key/value heads), beside the plain loop.
CI_CELLS_OF = {"llama-tiny": ("plain", "fsdp2", "tp")}


# Every strategy whose figures do not depend on the machine: ps-async's losses depend on the order its workers'
# gradients arrive in.
EXACT_STRATEGIES = tuple(name for name in ALL_BUT_REFERENCES if name != ASYNCHRONOUS_PS)


def ci(machine: Machine, select: Selection) -> list[RunSpec]:
    """The exact gate's cells: the plain loop, and every other strategy at two ranks, on gpt-tiny in fp32, and
    llama-tiny's (`CI_CELLS_OF`). Five steps each; CI holds their counted collectives, model-state census,
    parameters, parity verdict and first losses to committed expectations (`python -m harness expect`,
    harness.derive.expectations). Two ranks even where there is one device, as in smoke."""
    if select.workloads is None:
        select = dataclasses.replace(select, workloads=("gpt-tiny", "llama-tiny"))
    cells = Cells(machine, select, Plan(EXACT_STRATEGIES, (2,), repeats=1, precision=Precision.FP32))
    for workload, plan in _plans(machine, select, CI_PLANS, "exact-gate plan").items():
        for strategy in CI_CELLS_OF.get(workload, cells.chosen):
            for world_size in cells.sizes_for(strategy):
                cells.add(workload, plan, strategy, world_size, plan.global_batch(cells.largest))
    return cells.specs


# Short runs: a hybrid cell's questions are its parity, its traffic by group and its memory, which need the
# warm-up step that counts DTensor's collectives and a few timed steps; gpt-tiny's 4 heads allow TP 2 and 4,
# llama-tiny's 2 key/value heads TP 2 alone (its tp cell at 4 ranks is skipped, with the reason).
HYBRID_PLANS = {
    DeviceKind.CPU: {name: BatchPlan(micro_batch=4, per_device_batch=8, warmup_steps=2, timed_steps=5)
                     for name in ("gpt-tiny", "llama-tiny")},
    # The Llamas at full's micro-batches (GPU_PLANS: what the plan's memory holds on an 80 GB GPU).
    DeviceKind.CUDA: {**{name: BatchPlan(micro_batch=2, per_device_batch=4, warmup_steps=5, timed_steps=20)
                         for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl")},
                      "llama3.2-1b": BatchPlan(micro_batch=4, per_device_batch=4, warmup_steps=5, timed_steps=20),
                      "llama3-8b": BatchPlan(micro_batch=1, per_device_batch=1, warmup_steps=5, timed_steps=20)},
}
HYBRID_STRATEGIES = ("ddp", "fsdp2", "tp", "fsdp2-tp", "autotp", "pipeline")


def hybrid_options(strategy: str, world_size: int, machine: Machine, workload: str) -> dict[str, object]:
    """A hybrid cell's layout: tensor parallelism inside a node at the largest degree dividing the world size,
    the ranks of a node and the heads, the key/value heads where they are fewer (2 where that is 1 and the world
    size is even: the cell is then skipped with the reason), FSDP2 across; pipeline stages one per node the cell
    spans, at most one per layer, at least 2 where the world size is even (the largest such divisor of the world
    size), data parallel over the rest."""
    two_if_even = 2 if world_size % 2 == 0 else 1
    model = get_workload(workload)
    if strategy in ("fsdp2-tp", "autotp") and model.family is not Family.RESNET:   # ResNet skipped, with the reason
        # Grouped-query attention keeps whole key/value heads on a rank too: n_kv_head divides n_head.
        heads = getattr(model.config, "n_kv_head", model.config.n_head)
        return {"tp": max(two_if_even, math.gcd(world_size, machine.devices_per_node, heads))}
    if strategy == "pipeline":
        most = max(two_if_even, min(world_size // machine.devices_per_node, model.layer_count))
        return {"stages": max(d for d in range(1, most + 1) if world_size % d == 0)}
    return {}


def hybrid(machine: Machine, select: Selection) -> list[RunSpec]:
    """Tensor parallelism (`tp`; DeepSpeed's `autotp` with ZeRO-1 across), 2-D FSDP2 x TP (`fsdp2-tp`) and
    pipeline x data parallel beside DDP and FSDP2 on the transformers, at world sizes 2 and 4 on CPU (gpt-tiny and
    llama-tiny, fp32 and bf16, each against the plain loop in its precision) and 2, 4, ... up to the devices on
    GPUs (GPT-2 small to xl in bf16); TP stays inside a node and pipeline stages span nodes (`hybrid_options`)."""
    on_cpu = machine.device is DeviceKind.CPU
    sizes = (2, 4) if on_cpu else _powers_of_two_up_to(machine.devices)[1:] or (2,)
    precisions = (Precision.FP32, Precision.BF16) if on_cpu else (Precision.BF16,)
    cells = Cells(machine, select, Plan(HYBRID_STRATEGIES, sizes, repeats=1, precision=precisions[0]))
    for workload, plan in _plans(machine, select, HYBRID_PLANS, "hybrid plan").items():
        for precision in precisions:
            for strategy in cells.chosen:
                for world_size in cells.sizes_for(strategy):
                    cells.add(workload, plan, strategy, world_size, plan.global_batch(cells.largest),
                              options=hybrid_options(strategy, world_size, machine, workload), precision=precision)
    return cells.specs


# moe-tiny as the transformers run on CPU: 4 ranks at the largest size, each accumulating two micro-batches of 4. On
# GPUs the same cells for now: what they check is the dispatch's arithmetic and traffic, not a GPU's speed.
MOE_TINY_PLAN = BatchPlan(micro_batch=4, per_device_batch=8, warmup_steps=3, timed_steps=10)
MOE_PLANS = {DeviceKind.CPU: {"moe-tiny": MOE_TINY_PLAN}, DeviceKind.CUDA: {"moe-tiny": MOE_TINY_PLAN}}
# Beside expert parallelism, the data-parallel strategies with every expert replicated.
MOE_BASELINES = ("ddp", "fsdp2")


def moe(machine: Machine, select: Selection) -> list[RunSpec]:
    """Expert parallelism on an MoE model beside the baselines that replicate every expert: moe-tiny at world sizes 1,
    2 and 4 in fp32 and bf16 (on GPUs in bf16 at 1, 2, ... up to the devices, 2 sharing the GPU where there is one),
    `ep`, `horovod-ep` and `deepspeed-moe` (ZeRO-2; ZeRO-1 at 2 ranks too) over every rank and, `ep` and
    `deepspeed-moe` at 4, over groups of 2 (`ep=2`: two groups holding the experts, their gradients summed between
    them), each against the plain loop in its precision."""
    on_cpu = machine.device is DeviceKind.CPU
    precisions = (Precision.FP32, Precision.BF16) if on_cpu else (Precision.BF16,)
    # On one GPU, 2 ranks sharing it (as the hybrids'): the dispatch is what is checked, not its speed.
    sizes = (1, 2, 4) if on_cpu else (1, *(_powers_of_two_up_to(machine.devices)[1:] or (2,)))
    cells = Cells(machine, select, Plan((*MOE_BASELINES, *EXPERT_PARALLEL), sizes, repeats=1,
                                        precision=precisions[0]))
    variants = {("ep", 4): ({"ep": 2},), ("deepspeed-moe", 4): ({"ep": 2},),
                ("deepspeed-moe", 2): ({"zero_stage": 1},)}
    _beside_the_plain_loop(cells, _plans(machine, select, MOE_PLANS, "MoE plan"), precisions, variants)
    return cells.specs


def _beside_the_plain_loop(cells: Cells, plans: dict[str, BatchPlan], precisions: Sequence[Precision],
                           variants: Mapping[tuple[str, int], Sequence[dict[str, object]]]) -> None:
    """Each workload's plain loop at 1 rank in each precision, and every chosen strategy at each of its sizes above 1
    at the same global batch, with its `variants` at a size beside it ({(strategy, world size): options, ...})."""
    for workload, plan in plans.items():
        global_batch = plan.global_batch(cells.largest)
        for precision in precisions:
            cells.add(workload, plan, REFERENCE_STRATEGY, 1, global_batch, precision=precision)
            for strategy in cells.chosen:
                for world_size in (size for size in cells.sizes_for(strategy) if size > 1):
                    cells.add(workload, plan, strategy, world_size, global_batch, precision=precision)
                    for options in variants.get((strategy, world_size), ()):
                        cells.add(workload, plan, strategy, world_size, global_batch, options=options,
                                  precision=precision)


# The decoders at 4 times their default sequence (256 tokens), two samples a micro-batch: at 4 ranks a DDP rank runs one
# micro-batch, a group of 4 sequence-parallel ranks four (the global batch of 8 is one replica's). Short runs: what is
# checked is parity at the full sequence, the attention's traffic and the activations a rank saves. On GPUs the same
# cells for now, 2 ranks sharing one GPU where there is one: `cp`'s ring (CUDA's kernels alone) checked there.
LONG_CONTEXT_PLAN = BatchPlan(micro_batch=2, per_device_batch=2, warmup_steps=2, timed_steps=3)
LONG_CONTEXT_PLANS = {kind: {name: LONG_CONTEXT_PLAN for name in ("gpt-tiny-long", "llama-tiny-long")}
                      for kind in (DeviceKind.CPU, DeviceKind.CUDA)}
# Beside the plain loop at the full sequence, the data-parallel strategies each rank of which holds whole samples.
LONG_CONTEXT_BASELINES = ("ddp", "fsdp2")


def long_context(machine: Machine, select: Selection) -> list[RunSpec]:
    """Sequence parallelism beside the strategies that keep whole samples: gpt-tiny-long and llama-tiny-long at world
    sizes 1, 2 and 4 in fp32 and bf16 (on GPUs bf16 at 1 and 2, sharing one GPU where there is one), `ulysses` (ZeRO-2;
    ZeRO-3 at 2 ranks too) and `cp` over every rank and, at 4, over groups of 2 (two replicas, each a group); each
    against the plain loop at the full sequence in its precision. A cell a model refuses (llama-tiny-long's 2 key/value heads over 4 Ulysses ranks)
    and `cp` on the CPU are skipped with their reasons."""
    on_cpu = machine.device is DeviceKind.CPU
    precisions = (Precision.FP32, Precision.BF16) if on_cpu else (Precision.BF16,)
    sizes = (1, 2, 4) if on_cpu else (1, *(_powers_of_two_up_to(machine.devices)[1:] or (2,)))
    cells = Cells(machine, select, Plan((*LONG_CONTEXT_BASELINES, *SEQUENCE_PARALLEL_STRATEGIES), sizes, repeats=1,
                                        precision=precisions[0]))
    # Groups of 2 at 4 ranks; Ulysses under ZeRO-3 at 2, whose reduction averages where ZeRO-1/2's sums (ulysses.py).
    variants = {("ulysses", 4): ({"sp": 2},), ("cp", 4): ({"cp": 2},), ("ulysses", 2): ({"zero_stage": 3},)}
    _beside_the_plain_loop(cells, _plans(machine, select, LONG_CONTEXT_PLANS, "long-context plan"), precisions,
                           variants)
    return cells.specs


# Short runs, as the memory sweep's: the questions are the bytes saved for backward (counted in a warm-up step),
# parity and the recompute pass, which times its own steps. The micro-batch is larger than the memory sweep's
# one sample so that activations, not model states, are what a GPU's peak holds.
# ResNet's blocks checkpoint too (the tensor-parallel strategies skip it, with their reason); its GPU micro-batch is
# the full matrix's.
TECHNIQUE_PLANS = {
    DeviceKind.CPU: {name: BatchPlan(micro_batch=4, per_device_batch=8, warmup_steps=2, timed_steps=3)
                     for name in ("gpt-tiny", "resnet20-cifar")},
    DeviceKind.CUDA: {**{name: BatchPlan(micro_batch=4, per_device_batch=4, warmup_steps=2, timed_steps=5)
                         for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl")},
                      "resnet50": BatchPlan(micro_batch=256, per_device_batch=256, warmup_steps=2, timed_steps=5),
                      "llama3.2-1b": BatchPlan(micro_batch=4, per_device_batch=4, warmup_steps=2, timed_steps=5),
                      "llama3-8b": BatchPlan(micro_batch=1, per_device_batch=1, warmup_steps=2, timed_steps=5)},
}
TECHNIQUE_STRATEGIES = ("ddp", "horovod", "fsdp2", "zero1", "zero2", "zero3", "tp", "fsdp2-tp", "autotp", "pipeline")
CHECKPOINTING_SETTINGS = ("none", "blocks")
# Offload, each option alone, with the strategies that take it (harness.strategies.offload); skipped on a CPU.
ACTIVATION_OFFLOAD_STRATEGIES = tuple(name for name in TECHNIQUE_STRATEGIES if name != "pipeline")
STATE_OFFLOAD = {"zero1": ({"offload_optimizer": "cpu"},), "zero2": ({"offload_optimizer": "cpu"},),
                 "zero3": ({"offload_optimizer": "cpu"}, {"offload_optimizer": "cpu", "offload_param": "cpu"}),
                 "fsdp2": ({"offload_policy": "cpu"},)}


def memory_techniques(machine: Machine, select: Selection) -> list[RunSpec]:
    """Each data-parallel and hybrid strategy with activation checkpointing off and on (every block), in fp32,
    bf16 and fp16, on the transformers (gpt-tiny on CPU; GPT-2 small to xl on GPUs) and ResNet (ResNet-20, ResNet-50),
    at the largest world size,
    two ranks at least (ranks share one device where there is one, valid for memory; an OOM is a finding), and
    the plain loop both ways; then each offload option alone in the precision of the machine's other matrices
    (skipped on a CPU, with the reason): the report opens on the memory each saved and the step time it cost
    (harness.report.techniques). A cell without a technique is the same cell as in the other matrices."""
    largest = max(2, _powers_of_two_up_to(machine.devices)[-1])
    cells = Cells(machine, select, Plan(TECHNIQUE_STRATEGIES, (largest,), repeats=1, precision=Precision.FP32))
    for workload, plan in _plans(machine, select, TECHNIQUE_PLANS, "memory-techniques plan").items():
        def add(strategy: str, precision: Precision, technique: dict[str, str]) -> None:
            for world_size in cells.sizes_for(strategy):
                options = {**hybrid_options(strategy, world_size, machine, workload), **technique}
                cells.add(workload, plan, strategy, world_size, plan.global_batch(cells.largest),
                          options=options, precision=precision)

        for precision in (Precision.FP32, Precision.BF16, Precision.FP16):
            for setting in CHECKPOINTING_SETTINGS:
                checkpointing = {} if setting == "none" else {"activation_checkpointing": setting}
                for strategy in cells.chosen:
                    add(strategy, precision, checkpointing)
        precision = _precision(machine)
        for strategy in cells.chosen:
            offloads = (({"activation_offload": "cpu"},) if strategy in (*ACTIVATION_OFFLOAD_STRATEGIES, "plain")
                        else ()) + STATE_OFFLOAD.get(strategy, ())
            for offload in offloads:
                add(strategy, precision, offload)
    return cells.specs


# The parameter server against all-reduce: short runs, as the hybrids', on the smallest transformer of the machine.
PARAMETER_SERVER_PLANS = {
    DeviceKind.CPU: {"gpt-tiny": BatchPlan(micro_batch=4, per_device_batch=8, warmup_steps=2, timed_steps=5)},
    DeviceKind.CUDA: {"gpt2-small": BatchPlan(micro_batch=8, per_device_batch=16, warmup_steps=5, timed_steps=20)},
}
# Each layout by its options; a dedicated layout launches its servers beside its workers.
PARAMETER_SERVER_LAYOUTS = (("ps", {"placement": "colocated"}), ("ps", {"placement": "dedicated", "servers": 1}),
                            ("ps", {"placement": "dedicated", "servers": 2}), ("ps-async", {"servers": 1}))


def parameter_server(machine: Machine, select: Selection) -> list[RunSpec]:
    """The parameter server beside DDP and Horovod at 2 and 4 workers (--world-sizes) on one global batch: ps with a shard on every
    worker, and with 1 and 2 dedicated server ranks beside the workers; ps-async with one server. The launch holds
    the workers and the servers (5 ranks for 4 workers and one server), where the machine's nodes hold them evenly
    (`holds_evenly`): on an emulated cluster of 6 nodes, a rank on each node. fp32 on CPU, bf16 on GPUs, each against the plain loop at that batch."""
    cells = Cells(machine, select, Plan(("ddp", "horovod", "ps", ASYNCHRONOUS_PS), (2, 4), repeats=1,
                                        precision=_precision(machine)))
    workers = cells.sizes           # --world-sizes chooses the workers here
    for workload, plan in _plans(machine, select, PARAMETER_SERVER_PLANS, "parameter-server plan").items():
        global_batch = plan.global_batch(max(workers))
        cells.add(workload, plan, "plain", 1, global_batch)
        for strategy, options in (("ddp", {}), ("horovod", {}), *PARAMETER_SERVER_LAYOUTS):
            # The user's --option servers=K names the dedicated servers: the colocated layout has none to take.
            given = {**options, **cells.select.options_for(strategy)}
            if given.get("placement") == "colocated" and "servers" in given:
                continue
            servers = 0 if strategy in ("ddp", "horovod") or given.get("placement") == "colocated" \
                else int(given.get("servers", 1))
            for count in workers:
                if holds_evenly(machine, count + servers):
                    cells.add(workload, plan, strategy, count + servers, global_batch, options=dict(options))
    return cells.specs


# Short runs: K = 2 is a warm-up step (the probe of step K stays out of the timed ones) and a kill at step 4 leaves two
# steps recomputed; the resumed launch times the same steps as the uninterrupted one.
FAULT_TOLERANCE_PLANS = {
    DeviceKind.CPU: {"gpt-tiny": BatchPlan(micro_batch=4, per_device_batch=8, warmup_steps=3, timed_steps=3)},
    DeviceKind.CUDA: {"gpt2-small": BatchPlan(micro_batch=8, per_device_batch=16, warmup_steps=3, timed_steps=10)},
}
SAVED_AT, KILLED_AT = 2, 4


def fault_tolerance(machine: Machine, select: Selection) -> list[RunSpec]:
    """Checkpoint, resume and restart, for every strategy that checkpoints (its library's own save: DCP, DeepSpeed's,
    Horovod's rank 0, torch.save): each saves at step 2 and resumes from it in new processes, held against its
    uninterrupted run; DDP, FSDP2 (DCP) and Horovod also resume at 4 ranks from a save at 2 and at 2 from 4; DDP and FSDP2 lose
    a rank at step 4 and torchrun restarts them from the save, Horovod loses one under Horovod Elastic and goes on at
    one rank from its commit, while ZeRO-1 loses one under DeepSpeed's launcher, which restarts nothing, and is
    recorded failed, naming the kill; on 2 or more nodes (an emulated cluster), DDP and FSDP2
    at a rank a node lose the last node at step 4 and go on at one rank (torchrun --nnodes=1:2). One global batch (fp32 on CPU, bf16 on GPUs)."""
    checkpointing = tuple(name for name, strategy in STRATEGIES.items() if strategy.checkpoint_method)
    cells = Cells(machine, select, Plan(tuple(s for s in checkpointing if s != "plain"), (2,), repeats=1,
                                        precision=_precision(machine)))
    # Resharded between 2 and 4 ranks, where the machine holds both (and --world-sizes, where given, names both).
    chosen_sizes = select.world_sizes or (2, 4)
    resharded = [(to, saved) for to, saved in ((4, 2), (2, 4)) if holds_evenly(machine, to) and holds_evenly(machine, saved)
                 and {to, saved} <= set(chosen_sizes)]
    for workload, plan in _plans(machine, select, FAULT_TOLERANCE_PLANS, "fault-tolerance plan").items():
        global_batch = plan.global_batch(4)
        at = f"at:{SAVED_AT}"
        for strategy in cells.chosen:
            for world_size in cells.sizes_for(strategy):
                options = {"pipeline": {"stages": min(2, world_size)}, "fsdp2-tp": {"tp": min(2, world_size)}}
                cells.add(workload, plan, strategy, world_size, global_batch,
                          options={**options.get(strategy, {}), "checkpoint": at})
        # Resharded where the library loads at another world size: DCP's data-parallel strategies and Horovod's file.
        for strategy in ("ddp", "fsdp2", "horovod"):
            for to, saved in resharded:
                cells.add(workload, plan, strategy, to, global_batch, options={"checkpoint": f"{at}:from={saved}"})
        for strategy in ("ddp", "fsdp2", "zero1", "horovod"):
            cells.add(workload, plan, strategy, 2, global_batch, options={"checkpoint": f"{at}:kill={KILLED_AT}"})
        if machine.nodes >= 2:      # elastic shrink: a rank on each of two nodes, one of which leaves
            for strategy in ("ddp", "fsdp2"):
                cells.add(workload, plan, strategy, 2, global_batch, options={"checkpoint": f"{at}:leave={KILLED_AT}"},
                          nnodes=2)
    return cells.specs


# The reference set (scripts/gpu-reference.sh): what one lent GPU shows, in the order it is worth having when time
# runs short (harness.launch_order.value_first: every parity key's two plain launches first, then the cells below in
# this order). Groups of (family, precision, options, strategies): the transformer in bf16 under every data-parallel
# strategy a user asks about first, then in fp16 where the loss scalers differ (torch's GradScaler: plain, DDP;
# DeepSpeed's fp16 section: ZeRO-2, ZeRO-3), then compiled (the compiled tokens/s), then a Llama whose sequence fits
# one GPU, then ResNet.
REFERENCE_GROUPS: tuple[tuple[Family, Precision, dict[str, object], tuple[str, ...]], ...] = (
    (Family.GPT, Precision.BF16, {}, ("plain", "ddp", "fsdp2", "zero1", "zero2", "zero3", "horovod")),
    (Family.GPT, Precision.FP16, {}, ("plain", "ddp", "zero2", "zero3")),
    (Family.GPT, Precision.BF16, {"compile": True}, ("plain", "ddp", "fsdp2")),
    (Family.LLAMA, Precision.BF16, {}, ("plain", "ddp", "fsdp2", "zero3")),
    (Family.RESNET, Precision.BF16, {}, ("plain", "ddp", "fsdp2", "zero1", "zero2", "zero3", "horovod")),
)
# Each family's workload in the reference set, by device: the CPU rehearsal runs the same cells on the tiny ones.
REFERENCE_WORKLOADS = {DeviceKind.CUDA: {Family.GPT: "gpt2-small", Family.LLAMA: "llama3.2-1b", Family.RESNET: "resnet50"},
                       DeviceKind.CPU: {Family.GPT: "gpt-tiny", Family.LLAMA: "llama-tiny", Family.RESNET: "resnet20-cifar"}}
# The bare loop and the plain loop beside it launch this many times each, on the transformer and on ResNet: the fewest
# a side at which the harness's cost has an interval at all (harness.derive.harness_overhead: 4 a side, 97.1%).
REFERENCE_OVERHEAD_LAUNCHES = 4
REFERENCE_OFFLOAD = (("zero1", {"offload_optimizer": "cpu"}), ("zero2", {"offload_optimizer": "cpu"}),
                     ("zero3", {"offload_optimizer": "cpu"}), ("zero3", {"offload_optimizer": "cpu", "offload_param": "cpu"}),
                     ("fsdp2", {"offload_policy": "cpu"}))
# Two ranks on the transformer, last: on one GPU they share it over gloo (harness.strategies.base.place_rank), the
# multi-rank CUDA paths run before a multi-GPU user's do; rows marked shared_device, memory and correctness only.
REFERENCE_TWO_RANKS = ("ddp", "fsdp2", "zero2", "zero3")


def reference(machine: Machine, select: Selection) -> list[RunSpec]:
    """The GPU reference set, the cells of REFERENCE_GROUPS at world size 1, one launch a cell but the plain loop's (at
    least two on a GPU, parity's noise floor); the bare loop beside the plain loop on the transformer and on ResNet,
    REFERENCE_OVERHEAD_LAUNCHES each; ZeRO-1/2/3 with offload_optimizer, ZeRO-3 with offload_param too and FSDP2 with
    offload_policy on the transformer; then DDP, FSDP2, ZeRO-2 and ZeRO-3 at two ranks on it (REFERENCE_TWO_RANKS).
    FSDP2 runs its users' MixedPrecisionPolicy on the transformers (USERS_RECIPES). full's batch plans; on CPU the same
    cells on the tiny workloads (REFERENCE_WORKLOADS), FSDP2 with autocast. Its launches go in
    harness.launch_order.value_first's order (LAUNCH_ORDERS); scripts/gpu-reference.sh runs it on a lent GPU."""
    cells = Cells(machine, select, Plan((BARE_STRATEGY, *ALL_BUT_REFERENCES), (1,), repeats=1, precision=Precision.BF16))
    plans = _plans(machine, select, PLANS)
    chosen = {family: name for family, name in REFERENCE_WORKLOADS[machine.device].items() if name in plans}
    if not chosen:
        raise SpecError(f"the reference set runs {', '.join(REFERENCE_WORKLOADS[machine.device].values())} on "
                        f"{machine.device.value}; --workload named none of them")
    overhead = {} if select.repeats is not None else {REFERENCE_STRATEGY: REFERENCE_OVERHEAD_LAUNCHES}
    groups = [(chosen[family], precision, options, strategies, not options and precision is Precision.BF16
               and family is not Family.LLAMA) for family, precision, options, strategies in REFERENCE_GROUPS
              if family in chosen]
    # Listed in the order value_first launches them: every group's plain loop first (parity's references), then each
    # group's strategies, the bare loop after its family's first group.
    for workload, precision, options, strategies, beside_bare in groups:
        if REFERENCE_STRATEGY in strategies:
            cells.add(workload, plans[workload], REFERENCE_STRATEGY, 1, plans[workload].micro_batch,
                      precision=precision, options=dict(options),
                      repeats=overhead.get(REFERENCE_STRATEGY) if beside_bare else None)
    for workload, precision, options, strategies, beside_bare in groups:
        for strategy in strategies:
            if strategy != REFERENCE_STRATEGY:
                cells.add(workload, plans[workload], strategy, 1, plans[workload].micro_batch, precision=precision,
                          options=dict(options))
        if beside_bare:     # the harness's cost on this family, after its strategies' first cells
            cells.add(workload, plans[workload], BARE_STRATEGY, 1, plans[workload].micro_batch,
                      repeats=overhead.get(REFERENCE_STRATEGY))
    if Family.GPT in chosen:
        workload = chosen[Family.GPT]
        plan = plans[workload]
        for strategy, options in REFERENCE_OFFLOAD:
            cells.add(workload, plan, strategy, 1, plan.micro_batch, options=dict(options))
        # Two ranks of a micro-batch each, held against the plain loop at that global batch (its own parity key, listed
        # just before them: they are the set's last cells, and the head of the order is world size 1's).
        for strategy in (REFERENCE_STRATEGY, *REFERENCE_TWO_RANKS):
            cells.add(workload, plan, strategy, 1 if strategy == REFERENCE_STRATEGY else 2, 2 * plan.micro_batch)
    return cells.specs


MATRICES: dict[str, Callable[[Machine, Selection], list[RunSpec]]] = {
    "smoke": smoke,
    "full": full,
    "wide": wide,
    "scaling": scaling,
    "zero-memory": zero_memory,
    "ci": ci,
    "hybrid": hybrid,
    "memory-techniques": memory_techniques,
    "parameter-server": parameter_server,
    "fault-tolerance": fault_tolerance,
    "reference": reference,
    "moe": moe,
    "long-context": long_context,
}


def build_matrix(name: str, machine: Machine, select: Selection = Selection()) -> list[RunSpec]:
    if name not in MATRICES:
        raise SpecError(f"unknown matrix {name!r}; known: {', '.join(MATRICES)}")
    for strategy in select.strategies or ():
        if strategy not in STRATEGIES:
            raise SpecError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    chosen = select.strategies or tuple(STRATEGIES)
    for option, _ in select.options:  # an option must belong to at least one selected strategy
        if not any(option in STRATEGIES[strategy].options for strategy in chosen):
            known = "; ".join(f"{s}: {', '.join(STRATEGIES[s].options) or 'none'}" for s in chosen)
            raise SpecError(f"option {option!r} belongs to none of the selected strategies ({known})")
    specs = MATRICES[name](machine, select)
    if not specs:
        raise SpecError(f"matrix {name} has no cells for this selection")
    return specs


# The launch order of a matrix that does not go repeat by repeat (harness.launch_order).
LAUNCH_ORDERS: dict[str, LaunchOrder] = {"reference": value_first}


def launch_order(name: str) -> LaunchOrder:
    """The order of matrix `name`'s launches: its own (LAUNCH_ORDERS), else repeat by repeat."""
    return LAUNCH_ORDERS.get(name, round_robin)


__all__ = ["BatchPlan", "LAUNCH_ORDERS", "MATRICES", "Machine", "Selection", "build_matrix", "launch_order"]
