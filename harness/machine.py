"""The machine a matrix is planned for: its device kind, devices per node and nodes.

    python -m harness run --matrix scaling --dry-run --device cuda --gpus-per-node 8 --nnodes 4

A `Machine` is either this host as detected, or one the user describes (`--gpus-per-node`,
`--cpus-per-node`, `--nnodes`). A dry run plans for the described machine without looking for it, so a
laptop can check a cluster's plan; a real run refuses devices this host does not have. This module also
says, before launch, when CPU cells put more rank threads on a node than it has cores. It launches
nothing and never looks at the other hosts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from harness.spec import DeviceKind, RunSpec, SpecError

DRY_RUN_HINT = "--dry-run plans for a machine you do not have"


@dataclass(frozen=True)
class Machine:
    device: DeviceKind
    # GPUs of each node, or its CPU cores: on CPU a core plays the part of a device (docs/methodology.md, "On CPU").
    devices_per_node: int
    nodes: int = 1      # hosts a multi-rank cell may spread over (a hostfile's, or Slurm's)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", DeviceKind(self.device))
        for name in ("devices_per_node", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"machine {name} must be a whole number >= 1, got {value!r}")

    @property
    def devices(self) -> int:
        """Ranks that can run truly in parallel across every node: devices per node x nodes."""
        return self.devices_per_node * self.nodes

    @classmethod
    def detect(cls, device: DeviceKind | str | None = None, nodes: int = 1) -> "Machine":
        """This host, taken to be like every node: cuda when a GPU is visible (or asked for, which is an
        error where none is), else its CPU cores."""
        gpus = visible_gpus()
        chosen = DeviceKind(device) if device else (DeviceKind.CUDA if gpus else DeviceKind.CPU)
        if chosen is DeviceKind.CUDA and not gpus:
            raise SpecError("device cuda requested but no CUDA device is visible; allowed here: cpu "
                            f"({DRY_RUN_HINT}: --device cuda --gpus-per-node N)")
        return cls(device=chosen, devices_per_node=gpus if chosen is DeviceKind.CUDA else host_cores(), nodes=nodes)

    @classmethod
    def requested(cls, device: str | None, *, gpus_per_node: int | None = None, cpus_per_node: int | None = None,
                  nodes: int = 1, dry_run: bool = False) -> "Machine":
        """The machine a `run` names: --device, --gpus-per-node or --cpus-per-node, --nnodes; what it leaves
        out is this host's. Without `dry_run` (a plan, or nodes elsewhere as under Slurm) it must be here:
        devices this host lacks are a SpecError."""
        if gpus_per_node is not None and cpus_per_node is not None:
            raise SpecError("--gpus-per-node and --cpus-per-node exclude each other: the first goes with "
                            "--device cuda, the second with --device cpu")
        for flag, value in (("--gpus-per-node", gpus_per_node), ("--cpus-per-node", cpus_per_node)):
            if value is not None and value < 1:
                raise SpecError(f"{flag} must be >= 1, got {value}")
        if device is None and gpus_per_node is not None:
            device = DeviceKind.CUDA.value
        if device is None and cpus_per_node is not None:
            device = DeviceKind.CPU.value
        kind = DeviceKind(device) if device else None
        if gpus_per_node is not None and kind is DeviceKind.CPU:
            raise SpecError("--gpus-per-node goes with --device cuda; on cpu say --cpus-per-node N")
        if cpus_per_node is not None and kind is DeviceKind.CUDA:
            raise SpecError("--cpus-per-node goes with --device cpu; on cuda say --gpus-per-node N")
        asked = gpus_per_node or cpus_per_node
        if dry_run and asked:
            return cls(device=kind, devices_per_node=asked, nodes=nodes)
        if dry_run and kind is DeviceKind.CUDA and not visible_gpus():
            raise SpecError("--device cuda on a host with no visible GPU needs --gpus-per-node N (the GPUs of each "
                            "node to plan for) with --dry-run or --slurm; allowed here without them: cpu")
        here = cls.detect(device, nodes)
        if asked and asked > here.devices_per_node:
            flag, what = (("--gpus-per-node", "GPU(s) visible") if here.device is DeviceKind.CUDA
                          else ("--cpus-per-node", "CPU core(s)"))
            raise SpecError(f"{flag} {asked} but this host has {here.devices_per_node} {what}; allowed: "
                            f"1..{here.devices_per_node} ({DRY_RUN_HINT})")
        return dataclasses.replace(here, devices_per_node=asked or here.devices_per_node)


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def host_cores() -> int:
    return os.cpu_count() or 1


def oversubscription_warning(specs: Sequence[RunSpec], machine: Machine,
                             threads_per_rank: Callable[[RunSpec], int],
                             ranks_on_a_machine: Callable[[RunSpec], int] | None = None) -> str | None:
    """One line naming the CPU cells whose ranks on one machine (a node's, or every rank of the cell where
    the placement's nodes share one machine: `ranks_on_a_machine`), times each rank's threads, outnumber its
    cores, or None. Such cells still run (a 2-rank smoke test on one core is a valid check of the
    machinery), but their step times measure the cores' sharing, not the strategy."""
    if machine.device is not DeviceKind.CPU:
        return None
    cores = machine.devices_per_node
    sharing = ranks_on_a_machine or (lambda spec: spec.ranks_per_node)
    over = [(sharing(spec) * threads_per_rank(spec), spec) for spec in specs
            if sharing(spec) * threads_per_rank(spec) > cores]
    if not over:
        return None
    threads, worst = max(over, key=lambda pair: pair[0])
    shared = sharing(worst) != worst.ranks_per_node     # nodes that are one machine (an emulated cluster)
    where, each = ("this machine", "rank(s) on its nodes together") if shared else ("a node", "rank(s) per node")
    return (f"{len(over)} CPU cell(s) run more rank threads on {where} than its {cores} core(s), up to {threads} "
            f"({worst.label}: {sharing(worst)} {each} x {threads_per_rank(worst)} thread(s)); "
            f"their step times measure the sharing of the cores, not the strategy")
