"""Matrices: plain functions from the machine and the user's selection to a list of `RunSpec`s.

    python -m harness list

A new experiment is a new function here, added to MATRICES. Each matrix is device-aware: on CPU it uses
the small workloads and world sizes up to the core count; on GPUs, ResNet-50 and GPT-2 and world sizes up
to the GPU count. The micro-batch of a workload is fixed across world sizes (fewer ranks accumulate more
micro-batches), so every world size computes the same per-micro-batch statistics (BatchNorm) and its
losses can be compared with the plain single-device reference at the same global batch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from harness.spec import DeviceKind, Precision, RunSpec, SpecError
from harness.strategies import STRATEGIES
from workloads import get_workload


@dataclass(frozen=True)
class Machine:
    device: DeviceKind
    gpus: int
    cores: int
    nodes: int = 1      # hosts a multi-rank cell may spread over (a hostfile's, or Slurm's)

    @classmethod
    def detect(cls, device: DeviceKind | str | None = None, nodes: int = 1) -> "Machine":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        chosen = DeviceKind(device) if device else (DeviceKind.CUDA if gpus else DeviceKind.CPU)
        if chosen is DeviceKind.CUDA and not gpus:
            raise SpecError("device cuda requested but no CUDA device is visible; allowed here: cpu")
        return cls(device=chosen, gpus=gpus, cores=os.cpu_count() or 1, nodes=nodes)

    @property
    def parallel_devices(self) -> int:
        """How many ranks can run truly in parallel: GPUs, or CPU cores, on each of the nodes (taken to be
        like this one)."""
        return (self.gpus if self.device is DeviceKind.CUDA else self.cores) * self.nodes


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
        return {name: value for name, value in self.options if name in own}


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int    # samples per optimizer step
    micro_batch: int     # samples per forward/backward on one rank
    warmup_steps: int
    timed_steps: int


# Batches sized so that world sizes 1, 2 and 4 all divide them with the same micro-batch.
CPU_PLANS = {
    "resnet20-cifar": BatchPlan(global_batch=16, micro_batch=4, warmup_steps=3, timed_steps=10),
    "gpt-tiny": BatchPlan(global_batch=16, micro_batch=4, warmup_steps=3, timed_steps=10),
}
GPU_PLANS = {
    "resnet50": BatchPlan(global_batch=256, micro_batch=64, warmup_steps=5, timed_steps=20),
    "gpt2-small": BatchPlan(global_batch=16, micro_batch=4, warmup_steps=5, timed_steps=20),
}

ALL_BUT_PLAIN = tuple(name for name in STRATEGIES if name != "plain")


def _plans(machine: Machine, select: Selection) -> dict[str, BatchPlan]:
    plans = GPU_PLANS if machine.device is DeviceKind.CUDA else CPU_PLANS
    if select.workloads is None:
        return dict(plans)
    for name in select.workloads:
        get_workload(name)  # an unknown name fails here, listing the known ones
    missing = [w for w in select.workloads if w not in plans]
    if missing:
        raise SpecError(f"no batch plan for workload(s) {', '.join(missing)} on {machine.device.value}; "
                        f"allowed: {', '.join(plans)}")
    return {w: plans[w] for w in select.workloads}


def _cells(machine: Machine, select: Selection, strategies: Sequence[str], world_sizes: Sequence[int],
           repeats: int, precision: Precision, plans: dict[str, BatchPlan] | None = None) -> list[RunSpec]:
    """Every workload x strategy x world size, plus the plain reference at world size 1."""
    chosen = select.strategies if select.strategies is not None else ("plain", *strategies)
    sizes = select.world_sizes if select.world_sizes is not None else tuple(world_sizes)
    specs = []
    for workload, plan in (plans or _plans(machine, select)).items():
        for strategy in chosen:
            for world_size in (1,) if strategy == "plain" else sizes:
                options = {"stages": min(2, world_size)} if strategy == "pipeline" else {}
                fields = dict(workload=workload, strategy=strategy, world_size=world_size,
                              global_batch=plan.global_batch, micro_batch=plan.micro_batch, precision=precision,
                              warmup_steps=plan.warmup_steps, timed_steps=plan.timed_steps,
                              repeats=select.repeats or repeats, device=machine.device)
                fields.update(select.overrides)
                specs.append(RunSpec(**fields, options={**options, **select.options_for(strategy)}))
    return specs


SMOKE_WORKLOADS = {DeviceKind.CPU: ("gpt-tiny",), DeviceKind.CUDA: ("gpt2-small",)}


def smoke(machine: Machine, select: Selection) -> list[RunSpec]:
    """The quickest end-to-end check: the plain reference and DDP at two ranks, on the smallest
    transformer unless --workload names others (each launch costs ~20-40 s of interpreter start-up on a
    2-core machine, so two launches keep it under two minutes there)."""
    if select.workloads is None:
        select = dataclasses.replace(select, workloads=SMOKE_WORKLOADS[machine.device])
    return _cells(machine, select, ("ddp",), (2,), repeats=1, precision=Precision.FP32)


def full(machine: Machine, select: Selection) -> list[RunSpec]:
    """Every strategy on both workload families at world sizes 1 and 2 (the CPU default; fp32 on CPU,
    bf16 on GPU)."""
    precision = Precision.BF16 if machine.device is DeviceKind.CUDA else Precision.FP32
    repeats = 3 if machine.device is DeviceKind.CUDA else 1
    return _cells(machine, select, ALL_BUT_PLAIN, (1, 2), repeats=repeats, precision=precision)


def _powers_of_two_up_to(limit: int) -> tuple[int, ...]:
    sizes = [1]
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


DATA_PARALLEL = ("ddp", "horovod", "fsdp2", "zero1", "zero2", "zero3")


def scaling(machine: Machine, select: Selection) -> list[RunSpec]:
    """Strong and weak scaling of the data-parallel strategies over world sizes 1, 2, 4, ... up to the
    devices (x nodes): strong keeps the matrix's global batch, weak keeps its per-rank share at the largest
    size; the plain loop at each global batch is the reference (harness.derive.scaling)."""
    precision = Precision.BF16 if machine.device is DeviceKind.CUDA else Precision.FP32
    sizes = select.world_sizes or _powers_of_two_up_to(machine.parallel_devices)
    specs: dict[str, RunSpec] = {}
    for spec in _cells(machine, select, DATA_PARALLEL, sizes, repeats=3, precision=precision):
        specs.setdefault(spec.cell_id, spec)
        per_rank = spec.global_batch // max(sizes)
        if spec.strategy == "plain" or "global_batch" in dict(select.overrides) or per_rank < spec.micro_batch:
            continue
        weak = spec.replace(global_batch=per_rank * spec.world_size)
        reference = spec.replace(strategy="plain", world_size=1, global_batch=per_rank, options=())
        with_reference = select.strategies is None or "plain" in select.strategies
        for cell in (weak, reference) if with_reference else (weak,):
            specs.setdefault(cell.cell_id, cell)
    return sorted(specs.values(), key=lambda s: (s.workload, s.strategy != "plain", s.strategy, s.world_size,
                                                s.global_batch))


MEMORY_PLANS = {
    DeviceKind.CPU: {"gpt-tiny": BatchPlan(global_batch=8, micro_batch=4, warmup_steps=2, timed_steps=3)},
    DeviceKind.CUDA: {name: BatchPlan(global_batch=8, micro_batch=1, warmup_steps=2, timed_steps=5)
                      for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl")},
}
MEMORY_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")


def zero_memory(machine: Machine, select: Selection) -> list[RunSpec]:
    """Peak memory per rank of DDP, ZeRO-1/2/3 and FSDP2 against the ZeRO paper's prediction, on the
    transformer family (GPT-2 small to xl on GPUs; a cell that runs out of memory is a finding, recorded
    as oom) at the largest world size; short runs, since memory, not speed, is the point."""
    precision = Precision.BF16 if machine.device is DeviceKind.CUDA else Precision.FP32
    plans = MEMORY_PLANS[machine.device]
    chosen = select.workloads or tuple(plans)
    missing = [w for w in chosen if w not in plans]
    if missing:
        raise SpecError(f"no memory-sweep plan for workload(s) {', '.join(missing)} on {machine.device.value}; "
                        f"allowed: {', '.join(plans)}")
    largest = _powers_of_two_up_to(machine.parallel_devices)[-1]
    sizes = select.world_sizes or (max(2, largest),)
    specs = []
    for workload in chosen:
        plan = plans[workload]
        narrowed = dataclasses.replace(select, workloads=(workload,))
        specs += _cells(machine, narrowed, MEMORY_STRATEGIES, sizes, repeats=1, precision=precision,
                        plans={workload: plan})
    return specs


MATRICES: dict[str, Callable[[Machine, Selection], list[RunSpec]]] = {
    "smoke": smoke,
    "full": full,
    "scaling": scaling,
    "zero-memory": zero_memory,
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
