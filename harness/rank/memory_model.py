"""Memory as a rank sees it: the census of its model states, its peak memory, and DeepSpeed's estimate.

Inside a rank (harness.rank.worker) this module
- counts the model states a rank holds (`census_bytes`): the bytes of the distinct tensor storages its
  trainer names as weights, gradients and optimizer state (`Trainer.model_state_tensors`). Each storage
  counts once, in the first kind that names it, so gradients that are views of DDP's buckets, parameters
  that are views of DeepSpeed's flat buffers and shards padded by FSDP2 count what is really allocated.
  It needs no allocator statistic, so it works on CPU;
- resets and reads peak memory around the timed steps (`reset_peak_memory`, `peak_memory`): CUDA's
  allocator peaks, and the kernel's peak resident set size of the process (Linux: writing 5 to
  /proc/self/clear_refs resets VmHWM in /proc/self/status to the current RSS, proc(5), Linux >= 4.0;
  elsewhere getrusage's ru_maxrss, a peak since the process started);
- reads the model states once per launch (`ModelStateReader`), at the `gradients_ready` point of the last
  warm-up step: after backward and the gradient reduction, before the update frees any gradient, with
  the optimizer state of the step before present;
- at the same reading, measures what the rank holds outside the census: the bytes of every other tensor the
  interpreter reaches (`untracked_tensor_bytes`, exact), and its resident growth since just before the model
  was built (`resident_bytes`: RssAnon on CPU, allocator bytes on CUDA), whose excess over the census is
  flagged above `OUTSIDE_CENSUS_FLAG_BYTES`;
- calls DeepSpeed's own ZeRO-2/3 estimator (`deepspeed_estimate`).

The predictions these are compared with are computed from the row in harness.derive.memory.
"""

from __future__ import annotations

import enum
import gc
import re
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

CLEAR_REFS = Path("/proc/self/clear_refs")
PROC_STATUS = Path("/proc/self/status")
RESET_PEAK_RSS = "5"        # proc(5), /proc/pid/clear_refs: "reset the peak resident set size"
MIB = 1 << 20
# A rank's resident growth beyond its census, above which its row is flagged (`memory_outside_census_flagged`), by
# device type. CPU: RssAnon also grows by everything the rank first imports and caches once it wraps and steps the
# model, none of it a tensor: the plain loop's wrap alone imports some 800 modules (torch._dynamo and sympy among
# them, for AdamW) and grows by 69 MiB. The ci matrix's honest gpt-tiny cells at 2 ranks, launched twice here,
# grew by 77-84 MiB beyond their census (the torch strategies) and 124-130 MiB (DeepSpeed's: its engine), within
# 4 MiB from launch to launch; 256 MiB is twice the largest, so no honest cell is flagged and a regression of
# that order is. CUDA: the allocator counts tensors alone, rounded to 512-byte blocks, so a gap is tensors the
# census does not name, none of them imports: DDP's buckets where gradients are not views of them (25 MiB each),
# ZeRO-3's reduce bucket (reduce_bucket_size elements, 2 GB in fp32 at DeepSpeed's default: flagged, as it
# should be). 64 MiB is above a DDP bucket and far under a weight copy of any GPU workload; no GPU measured it.
OUTSIDE_CENSUS_FLAG_BYTES = {"cpu": 256 * MIB, "cuda": 64 * MIB}


class PeakRssSince(enum.StrEnum):
    """Where a row's peak RSS figure starts."""

    FIRST_TIMED_STEP = "first timed step"
    PROCESS_START = "process start"


@dataclass
class ModelStateTensors:
    """The tensors that hold a rank's model states, as its trainer names them. `gradients` is None where
    they cannot be read at the reading point (the pipeline frees them inside `train_batch`)."""

    weights: list[torch.Tensor]
    gradients: list[torch.Tensor] | None
    optimizer: list[torch.Tensor]
    note: str = ""          # what the census misses or counts beyond the plan, and why


def torch_model_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, note: str = "") -> ModelStateTensors:
    """Model states of a torch model trained by a torch optimizer: parameters, their .grad, and every
    tensor of the optimizer's state (AdamW: exp_avg, exp_avg_sq and a scalar `step` per parameter)."""
    parameters = list(model.parameters())
    return ModelStateTensors(weights=parameters,
                             gradients=[p.grad for p in parameters if p.grad is not None],
                             optimizer=optimizer_state_tensors(optimizer), note=note)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]


def census_bytes(tensors: ModelStateTensors) -> dict[str, int | None]:
    """{"weights", "gradients", "optimizer"}: bytes of the distinct storages behind each kind's tensors;
    a storage already counted under an earlier kind is not counted again."""
    seen: set[tuple[str, int]] = set()
    counts: dict[str, int | None] = {}
    for kind in ("weights", "gradients", "optimizer"):
        group = getattr(tensors, kind)
        if group is None:
            counts[kind] = None
            continue
        total = 0
        for tensor in group:
            key, nbytes = _storage(tensor)
            if nbytes == 0 or key in seen:
                continue
            seen.add(key)
            total += nbytes
        counts[kind] = total
    return counts


def census_tensors(tensors: ModelStateTensors) -> list[torch.Tensor]:
    """Every tensor the census reads, of all three kinds."""
    return [*tensors.weights, *(tensors.gradients or []), *tensors.optimizer]


def _storage(tensor: torch.Tensor) -> tuple[tuple[str, int], int]:
    """((device, address), bytes) of the storage behind `tensor` (a DTensor's: its local shard's)."""
    storage = _local(tensor).untyped_storage()
    return (str(storage.device), storage.data_ptr()), storage.nbytes()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters, gradients and optimizer state); other tensors as they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages of `tensors` that live on `device`."""
    storages = {}
    for tensor in tensors:
        if tensor.device == device:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def untracked_tensor_bytes(model_states: ModelStateTensors, inputs: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of every tensor the interpreter reaches (`gc.get_objects()`; a DTensor
    through its local shard) less the census's storages and the step's input tensors': tensors a rank holds
    outside its model states. Call it after `gc.collect()`: until then tensors in unreachable cycles count too.

    Exact and the same from launch to launch for a given code path (the same tensors, of the same sizes, are
    alive at the reading), so the exact tier holds it. What it cannot see: tensors that only C++ holds, with
    no Python object (autograd's saved tensors, DDP's reducer buckets, Horovod's fusion buffer, ProcessGroup
    work in flight), and memory that is no tensor at all (allocator caches, the interpreter's own objects);
    the resident growth (`resident_bytes`) sees those."""
    excluded = {_storage(t)[0] for t in [*census_tensors(model_states), *inputs]}
    found: dict[tuple[str, int], int] = {}
    for thing in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which a dead weakref.proxy answers with an error.
        if not issubclass(type(thing), torch.Tensor):
            continue
        try:
            key, nbytes = _storage(thing)
        except (RuntimeError, NotImplementedError):     # no storage of its own (a sparse or functional tensor)
            continue
        if key not in excluded and key[0] != "meta":
            found[key] = nbytes
    return sum(found.values())


def resident_bytes(device: torch.device) -> int | None:
    """What a rank's resident growth is measured in: on CUDA the allocator's bytes in use on `device`; elsewhere
    the process's anonymous resident memory (RssAnon in /proc/self/status, proc(5), Linux >= 4.5: heap, stacks
    and private mappings, not the libraries' file-backed pages), None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_bytes("RssAnon")


def outside_census(growth: float | None, census_on_device: int, device: torch.device) -> tuple[float | None, bool]:
    """(gap, flagged): a rank's resident growth less its census's bytes on its device, and whether that gap is
    above OUTSIDE_CENSUS_FLAG_BYTES for the device; (None, False) where the growth could not be read."""
    if growth is None:
        return None, False
    gap = growth - census_on_device
    return gap, gap > outside_census_flag_bytes(device)


def outside_census_flag_bytes(device: torch.device) -> int:
    return OUTSIDE_CENSUS_FLAG_BYTES["cuda" if device.type == "cuda" else "cpu"]


def largest_module_own_parameters(model: nn.Module) -> int:
    """The most parameters one module holds itself (not through its children): DeepSpeed's
    `largest_layer_params` for its ZeRO-3 estimator (deepspeed/runtime/zero/stage3.py, `model_to_params`,
    0.19.8: max over model.modules() of sum(p.numel() for p in m.parameters(recurse=False)))."""
    return max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())


# ---- peak memory ---------------------------------------------------------------------------------


def reset_peak_memory(device: torch.device) -> PeakRssSince:
    """Start the peaks here: CUDA's allocator peaks, and the process's peak RSS where the kernel lets it
    be reset. Returns where the peak RSS read by `peak_memory` will start."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        CLEAR_REFS.write_text(RESET_PEAK_RSS)
    except OSError:            # not Linux, or /proc not writable here
        return PeakRssSince.PROCESS_START
    return PeakRssSince.FIRST_TIMED_STEP if _vm_hwm_bytes() is not None else PeakRssSince.PROCESS_START


def peak_memory(device: torch.device, since: PeakRssSince) -> dict[str, float]:
    """Peak RSS of this process since `since`, and on CUDA the allocator's peak allocated and reserved
    bytes since the last `reset_peak_memory`."""
    rss = _vm_hwm_bytes() if since is PeakRssSince.FIRST_TIMED_STEP else None
    if rss is None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB
    figures = {"peak_rss": float(rss)}
    if device.type == "cuda":
        figures["peak_allocated"] = float(torch.cuda.max_memory_allocated(device))
        figures["peak_reserved"] = float(torch.cuda.max_memory_reserved(device))
    return figures


def _vm_hwm_bytes() -> int | None:
    """VmHWM (peak resident set size) of this process from /proc/self/status, or None where unreadable."""
    return _status_bytes("VmHWM")


def _status_bytes(name: str) -> int | None:
    """A kB field of /proc/self/status in bytes, or None where unreadable."""
    try:
        match = re.search(rf"^{name}:\s+(\d+) kB$", PROC_STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


# ---- the model-state reading ---------------------------------------------------------------------


@dataclass
class ModelStateReader:
    """Reads this rank's model states once: at the `gradients_ready` point of the last warm-up step, or
    right after that step where the trainer has no such point (DeepSpeed's pipeline).

    Step 0 is the parity probe's; AdamW creates its state in the first update, so the reading needs the
    last warm-up step to be step 1 or later (warmup_steps >= 2)."""

    trainer: Any                          # harness.strategies.Trainer (not imported: no cycle)
    device: torch.device
    warmup_steps: int
    resident_before: int | None = None    # `resident_bytes` just before the model was built
    census: dict[str, int | None] | None = None
    allocated: float | None = None        # CUDA: allocator bytes minus the step's input tensors
    untracked: int | None = None          # `untracked_tensor_bytes`
    resident_growth: float | None = None  # `resident_bytes` minus the step's inputs, less `resident_before`
    outside_census: float | None = None   # the growth less the census's bytes on this device
    flagged: bool = False                 # that gap above OUTSIDE_CENSUS_FLAG_BYTES
    note: str = ""
    read_at: str = ""
    unavailable_because: str = ""
    _step: int = field(init=False)

    def __post_init__(self) -> None:
        self._step = self.warmup_steps - 1
        if self.warmup_steps < 2:
            self.unavailable_because = (f"warmup_steps={self.warmup_steps}: the reading needs warm-up step 1 or "
                                        f"later (step 0 is the parity probe's, and AdamW's state exists only "
                                        f"after the first update), so warmup_steps >= 2")

    def gradients_ready(self, step: int, micro_batches: Sequence) -> Callable[[], None] | None:
        """The callback to pass to `train_step` at `step`, or None."""
        if step != self._step or self.unavailable_because or not self.trainer.reaches_gradients_ready:
            return None
        where = f"gradients_ready of warm-up step {step} (after backward and the reduction, before the update)"
        return lambda: self._read(micro_batches, where)

    def after_step(self, step: int, micro_batches: Sequence) -> None:
        """Called after every step: reads here where the trainer never reaches `gradients_ready`."""
        if step == self._step and not self.unavailable_because and not self.trainer.reaches_gradients_ready:
            self._read(micro_batches, f"after warm-up step {step}: the trainer has no point between its gradient "
                                      f"reduction and its update, so gradients are not read")

    def _read(self, micro_batches: Sequence, where: str) -> None:
        tensors = self.trainer.model_state_tensors()
        self.census = census_bytes(tensors)
        self.note = tensors.note
        self.read_at = where
        # The step's inputs and targets are still referenced here; they are not model states.
        inputs = [t for batch in micro_batches for t in batch]
        input_bytes = storage_bytes(inputs, self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.allocated = float(torch.cuda.memory_allocated(self.device) - input_bytes)
        gc.collect()            # garbage in reference cycles is held by no one: neither figure below counts it
        resident = resident_bytes(self.device)
        if resident is not None and self.resident_before is not None:
            self.resident_growth = float(resident - input_bytes - self.resident_before)
        on_device = {key: nbytes for key, nbytes in map(_storage, census_tensors(tensors))
                     if torch.device(key[0]).type == self.device.type}
        self.outside_census, self.flagged = outside_census(self.resident_growth, sum(on_device.values()), self.device)
        self.untracked = untracked_tensor_bytes(tensors, inputs)


# ---- DeepSpeed's estimator -------------------------------------------------------------------------


def deepspeed_estimate(stage: int, parameters: int, largest_layer_parameters: int, gpus_per_node: int,
                       nodes: int = 1, offload_optimizer: bool = False,
                       offload_param: bool = False) -> dict[str, float] | None:
    """DeepSpeed's own per-GPU and per-node-CPU estimate (its `estimate_zero{2,3}_model_states_mem_needs`,
    with its default 1.5x buffer factor for the CPU figure), or None where it has none (stage 0 and 1) or
    DeepSpeed is not installed. `largest_layer_parameters` is DeepSpeed's definition
    (`largest_module_own_parameters`)."""
    try:
        if stage == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
            cpu, gpu = estimate_zero2_model_states_mem_needs(parameters, gpus_per_node, nodes,
                                                               cpu_offload=offload_optimizer)
        elif stage == 3:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                parameters, largest_layer_parameters, gpus_per_node, nodes, cpu_offload=offload_optimizer,
                cpu_offload_params=offload_param, zero_init=True)
        else:
            return None
    except ImportError:
        return None
    return {"gpu_bytes": float(gpu), "cpu_bytes_per_node": float(cpu)}
