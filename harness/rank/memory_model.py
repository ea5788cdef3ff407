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
  flagged above its strategy's size (`outside_census_flag_bytes`);
- measures the growth of its RssAnon (and on CUDA of the allocator's bytes) over the timed steps
  (`TimedStepsGrowth`), flagged above `TIMED_GROWTH_FLAG_BYTES`'s figure for the steps;
- calls DeepSpeed's own ZeRO-2/3 estimator (`deepspeed_estimate`).

The predictions these are compared with are computed from the row in harness.derive.memory.
"""

from __future__ import annotations

import ctypes
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
# The sizes a rank's memory outside its census is flagged above (docs/methodology.md, "Memory outside the census").
#
# The gap (`memory_outside_census_flagged`): a rank's resident growth beyond its census at the last warm-up step. On
# CPU, RssAnon also grows by what the rank first imports and caches once it wraps and steps the model, none of it a
# tensor, and how much follows the strategy's libraries. The largest part, what the first torch optimizer imports
# (68 MiB), is paid before the baseline (`import_optimizer_modules`), so that it neither sits in every gap nor differs
# between a parameter server's ranks that build an optimizer and those that build none (9.5 against 67.8 MiB
# without it); DeepSpeed's engine still adds some 45 MiB. One size for every strategy would sit above DeepSpeed's and
# pass a torch strategy's leak of 80 MiB, so each strategy has its own: its honest gaps measured (MiB, the lowest and
# the highest rank of every launch) plus OUTSIDE_CENSUS_MARGIN_BYTES. Measured 2026-11-29 on the 2-core VM (2 vCPUs,
# 23.5 GiB, Debian 12, glibc 2.36, Python 3.11.7, torch 2.13.0+cpu, DeepSpeed 0.19.8, Horovod 0.28.1, one thread a
# rank), every honest cell of the ci matrix launched 4 times (gpt-tiny; llama-tiny's plain, fsdp2 and tp), with
# resnet20-cifar's plain, DDP, ZeRO-2 and FSDP2 twice, the memory-techniques matrix's gpt-tiny cells of DDP, ZeRO-2/3
# and FSDP2 in fp32 and of the plain loop, DDP and ZeRO-2 in bf16 (checkpointed blocks, ZeRO's offloaded optimizer
# and parameters) once, ps-async twice and ps's dedicated servers (1 and 2) once; launches: plain 14, ddp 10, horovod
# 4, fsdp2 12, tp 8, fsdp2-tp 4, pipeline 4, ps 7, ps-async 2, zero1 4, zero2 12, zero3 8, autotp 4.
HONEST_OUTSIDE_CENSUS_CPU_MIB: dict[str, tuple[float, float]] = {
    "plain": (6.2, 13.5), "ddp": (7.4, 15.9), "horovod": (9.8, 10.9), "fsdp2": (11.5, 19.8), "tp": (9.7, 13.8),
    "fsdp2-tp": (11.9, 13.7), "pipeline": (8.7, 10.7), "ps": (0.6, 10.3), "ps-async": (-0.7, 11.9),
    "zero1": (55.3, 56.3), "zero2": (50.3, 59.1), "zero3": (56.1, 62.9), "autotp": (53.7, 54.9),
    # moe-tiny's cells of the moe matrix, 2026-11-29 (its DDP 10.7-18.3 there): ep in fp32 and bf16 at 2 and 4 ranks
    # (3 launches each), horovod-ep in fp32 at 2 and 4 (3 and 1; bf16 is refused by its alltoall).
    "ep": (12.0, 18.2), "horovod-ep": (15.3, 18.9),
    # deepspeed-moe in fp32 at 2 ranks (ZeRO-2 twice, ZeRO-1) and 4 (every rank, ep=2), 2026-11-29: DeepSpeed's engine
    # as ZeRO's. Its bf16 cells, like every bf16 MoE cell here (the plain loop's 168-215 MiB, ep's 126-131), are
    # flagged: the experts' matrix multiplies take a new shape every step (each expert's tokens), and oneDNN's bf16
    # kernels for each new shape stay resident (ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 halved the plain loop's gap).
    "deepspeed-moe": (55.3, 63.6),
    # ulysses on gpt-tiny-long and llama-tiny-long in fp32 and bf16 at 2 ranks and 4 (every rank, and sp=2), once each,
    # 2026-11-29: DeepSpeed's engine as ZeRO's. `cp` runs on CUDA alone.
    "ulysses": (53.4, 66.7),
}
# Room above the highest honest gap for what another machine adds: 3.6 times the widest spread of one strategy
# measured (ZeRO-2's 8.8 MiB over two workloads, two precisions and its options); four threads a rank
# (OMP_NUM_THREADS=4: plain, DDP and ZeRO-2 on gpt-tiny) added 1.3-1.6 MiB. Yet a 100 MiB leak on the lowest honest
# gap of every strategy is above its size by the margin again or more (the least: ps-async's 99.3 MiB against its
# 43.9 MiB; tests/test_memory_flags.py), and any leak above 45 MiB is flagged in every strategy.
OUTSIDE_CENSUS_MARGIN_BYTES = 32 * MIB
# By device type, for a strategy not measured above: on CPU the largest of the measured strategies' sizes. On CUDA the
# allocator counts tensors alone, rounded to 512-byte blocks, so a gap is tensors the census does not name, none of
# them imports, the same for every strategy: DDP's buckets where gradients are not views of them (25 MiB each),
# ZeRO-3's reduce bucket (reduce_bucket_size elements, 2 GB in fp32 at DeepSpeed's default: flagged, as it should be).
# 64 MiB is above a DDP bucket and far under a weight copy of any GPU workload; no GPU measured it.
OUTSIDE_CENSUS_FLAG_BYTES = {"cpu": int(max(high for _, high in HONEST_OUTSIDE_CENSUS_CPU_MIB.values()) * MIB)
                             + OUTSIDE_CENSUS_MARGIN_BYTES, "cuda": 64 * MIB}


@dataclass(frozen=True, kw_only=True, slots=True)
class GrowthLimit:
    """The growth over n steps a rank is flagged above: `fixed_bytes` + n x `per_step_bytes`."""

    fixed_bytes: int
    per_step_bytes: int

    def __post_init__(self) -> None:
        for name in ("fixed_bytes", "per_step_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def over(self, steps: int) -> int:
        return self.fixed_bytes + steps * self.per_step_bytes


# The growth over the timed steps (`memory_growth_timed_steps_flagged`, TimedStepsGrowth): the highest rank's growth
# of RssAnon measured, MiB, by the steps it spanned (the last warm-up step and the timed ones), on the same machine and
# day as the gaps above, over the same cells and the ci cells at 3 and 30 timed steps: over 4 steps (ci's 3 timed
# steps) 98 rank readings of 52 launches (29 cells), over 11 steps 231 of 123 (22 cells), over 31 steps 9 of 5 (5
# cells). An honest rank grows by a little once (ZeRO-1 and -2 up to 3 MiB, at any length) and by a little every step
# (tp the most: 85 KiB a step), so the size is a fixed part above the first and a part per step three times the
# second: 4 MiB + 256 KiB a step, at least twice every honest growth measured, and a leak of 1 MiB a step is flagged
# from 6 steps on (n MiB > 4 + n / 4 MiB): over 10 timed steps, 11 MiB against 6.75 MiB.
HONEST_TIMED_GROWTH_CPU_MIB = {4: 2.05, 11: 2.98, 31: 3.40}
# CUDA: the allocator's bytes count live tensors alone, and an honest rank ends its steps holding the same ones but
# the losses it keeps (a 512-byte block a step): 1 MiB + 256 KiB a step flags the same leak as RssAnon's size
# does, from 2 steps on. No GPU measured it.
TIMED_GROWTH_FLAG_BYTES = {"resident": GrowthLimit(fixed_bytes=4 * MIB, per_step_bytes=MIB // 4),
                           "allocated": GrowthLimit(fixed_bytes=MIB, per_step_bytes=MIB // 4)}


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


def import_optimizer_modules() -> None:
    """Build and drop a torch AdamW over one element: what constructing the first one imports (torch 2.13: some 820
    modules, torch._dynamo and sympy among them, 67.6 MiB of RssAnon) is then imported. The worker calls it
    before it reads `resident_bytes` for the baseline, so that the gap is what the rank holds, not that fixed cost,
    and is the same for ranks that build an optimizer and ranks that build none (a parameter server's workers)."""
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])


def resident_bytes(device: torch.device) -> int | None:
    """What a rank's resident growth is measured in: on CUDA the allocator's bytes in use on `device`; elsewhere
    the process's anonymous resident memory (RssAnon in /proc/self/status, proc(5), Linux >= 4.5: heap, stacks
    and private mappings, not the libraries' file-backed pages), None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return anonymous_resident_bytes()


def anonymous_resident_bytes() -> int | None:
    """RssAnon of this process (/proc/self/status, proc(5), Linux >= 4.5), on any device; None where unreadable."""
    return _status_bytes("RssAnon")


def outside_census(growth: float | None, census_on_device: int, device: torch.device,
                   strategy: str | None = None) -> tuple[float | None, bool]:
    """(gap, flagged): a rank's resident growth less its census's bytes on its device, and whether that gap is
    above `outside_census_flag_bytes` for the device and the strategy; (None, False) where the growth could not be
    read."""
    if growth is None:
        return None, False
    gap = growth - census_on_device
    return gap, gap > outside_census_flag_bytes(device, strategy)


def outside_census_flag_bytes(device: torch.device, strategy: str | None = None) -> int:
    """The gap a rank of `strategy` is flagged above: on CPU its highest honest gap measured plus
    OUTSIDE_CENSUS_MARGIN_BYTES, where it was measured; otherwise OUTSIDE_CENSUS_FLAG_BYTES for the device."""
    if device.type == "cuda":
        return OUTSIDE_CENSUS_FLAG_BYTES["cuda"]
    if strategy in HONEST_OUTSIDE_CENSUS_CPU_MIB:
        return int(HONEST_OUTSIDE_CENSUS_CPU_MIB[strategy][1] * MIB) + OUTSIDE_CENSUS_MARGIN_BYTES
    return OUTSIDE_CENSUS_FLAG_BYTES["cpu"]


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
    strategy: str | None = None           # whose size the gap is flagged above (`outside_census_flag_bytes`)
    census: dict[str, int | None] | None = None
    allocated: float | None = None        # CUDA: allocator bytes minus the step's input tensors
    untracked: int | None = None          # `untracked_tensor_bytes`
    resident_growth: float | None = None  # `resident_bytes` minus the step's inputs, less `resident_before`
    outside_census: float | None = None   # the growth less the census's bytes on this device
    flagged: bool = False                 # that gap above `outside_census_flag_bytes`
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
        self.outside_census, self.flagged = outside_census(self.resident_growth, sum(on_device.values()), self.device,
                                                           self.strategy)
        self.untracked = untracked_tensor_bytes(tensors, inputs)


# ---- growth over the timed steps -------------------------------------------------------------------


@dataclass
class TimedStepsGrowth:
    """What a rank's memory grew by over its last warm-up step and its timed steps: read just before the last warm-up
    step (before the ranks meet at its barrier, with its data made) and just after the last timed step, each after
    `gc.collect()` and glibc's `malloc_trim(0)` (`release_free_heap`): the process's anonymous resident memory
    (`anonymous_resident_bytes`, on every device) and on CUDA the allocator's bytes in use. Each reading holds one
    step's data and nothing else that differs.

    By the last warm-up step the rank has run a whole step, so whatever it first imports, allocates and caches it has;
    the steps after repeat that work on data of the same shapes, and an honest rank ends them holding what it held
    before them, where a rank that keeps B bytes more every step ends them (timed steps + 1) x B higher, which the
    model-state reading, taken once in the last warm-up step, cannot see. The trim is why: without it RssAnon also
    holds the heap's free pages, up to glibc's trim threshold (which grows to twice the largest block freed, up to
    64 MiB), so two readings of the same live memory differ by megabytes, and a leak can fill free pages already
    resident without growing it. The start is a warm-up step's, not the first timed step's, so that the pages the trim
    gave back are faulted in again outside every timed step. Flagged above TIMED_GROWTH_FLAG_BYTES's figure for the
    steps it spans (`timed_growth_flagged`)."""

    device: torch.device
    warmup_steps: int
    timed_steps: int
    resident_at_start: int | None = None
    allocated_at_start: int | None = None
    resident: float | None = None         # RssAnon after the last timed step less before the last warm-up step
    allocated: float | None = None        # CUDA: the same of torch.cuda.memory_allocated
    flagged: bool = False
    note: str = ""                        # where the heap's free pages could not be given back first
    unavailable_because: str = ""

    def __post_init__(self) -> None:
        self.unavailable_because = (
            f"warmup_steps={self.warmup_steps}: the growth is read from the start of the last warm-up step, which "
            "needs a whole step before it (step 0 first imports and allocates what every later step reuses), so "
            "warmup_steps >= 2" if self.warmup_steps < 2 else
            "no step ran from the last warm-up step's start to the last timed step's end in this launch")

    @property
    def steps(self) -> int:
        """The steps the growth spans: the last warm-up step and every timed step."""
        return self.timed_steps + 1

    def flag_bytes(self) -> dict[str, int]:
        """{"resident", "allocated"}: the growths over `steps` this rank is flagged above (TIMED_GROWTH_FLAG_BYTES)."""
        return {kind: limit.over(self.steps) for kind, limit in TIMED_GROWTH_FLAG_BYTES.items()}

    def before_step(self, step: int) -> None:
        """Called before every step's barrier: reads the start before the last warm-up step."""
        if step != self.warmup_steps - 1 or self.warmup_steps < 2:
            return
        self.resident_at_start, self.allocated_at_start = self._read()
        self.resident = self.allocated = None
        self.flagged = False

    def after_step(self, step: int) -> None:
        """Called after every step: reads the end after the last timed step."""
        if step != self.warmup_steps + self.timed_steps - 1 or self.resident_at_start is None and \
                self.allocated_at_start is None:
            return              # not the last step, or resumed past the start: no growth to tell
        resident, allocated = self._read()
        if resident is not None and self.resident_at_start is not None:
            self.resident = float(resident - self.resident_at_start)
        if allocated is not None:
            self.allocated = float(allocated - self.allocated_at_start)
        self.flagged = timed_growth_flagged(self.resident, self.allocated, self.steps)
        self.unavailable_because = ""

    def _read(self) -> tuple[int | None, int | None]:
        gc.collect()
        if not release_free_heap():
            self.note = ("malloc_trim is not in this C library (glibc's): the resident growth holds free heap pages "
                         "too")
        allocated = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
        return anonymous_resident_bytes(), allocated


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the kernel (glibc's malloc_trim(0): every arena, the free pages inside the
    heap as well as its top); False where the C library has no malloc_trim."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def timed_growth_flagged(resident: float | None, allocated: float | None, steps: int) -> bool:
    """Whether a rank's growth over `steps` steps is above TIMED_GROWTH_FLAG_BYTES's: its RssAnon's (any device) or
    its allocator's (CUDA); a growth not read flags nothing."""
    return any(growth is not None and growth > timed_growth_flag_bytes(kind, steps)
               for kind, growth in (("resident", resident), ("allocated", allocated)))


def timed_growth_flag_bytes(kind: str, steps: int) -> int:
    """The growth over `steps` steps of `kind` ("resident" or "allocated") a rank is flagged above."""
    return TIMED_GROWTH_FLAG_BYTES[kind].over(steps)


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
