"""Faults injected into a rank on purpose, so that the harness's checks are tested against the real thing:
a rank that dies, hangs or runs out of memory in the middle of a cell, a rank whose gradients are
silently wrong, which only loss parity (harness.derive.parity) can notice, a strategy whose traffic, memory
or learning rate changed, which the exact gates (harness.derive.expectations) must notice, and a strategy whose
step got slower, which only a timed comparison (`harness ab`, harness/ab.py) can notice.

    PARBENCH_FAULT=kill:rank=1:step=2 python -m harness run --matrix smoke --strategy ddp
    PARBENCH_FAULT=grad-scale:factor=2:rank=1:step=0 python -m harness run --matrix smoke --strategy ddp
    PARBENCH_FAULT='grad-scale:factor=0.5:tensors=*.c_attn.weight:rank=all:step=0' python -m harness run ...
    PARBENCH_FAULT='grad-scale:factor=64:rank=all:step=0+' python -m harness run --precision fp16 ...
    PARBENCH_FAULT=extra-all-reduce:rank=all:step=0 python -m harness run --matrix ci --strategy ddp
    PARBENCH_FAULT=untracked-weight-copy:rank=all:step=0 python -m harness run --matrix ci --strategy fsdp2
    PARBENCH_FAULT=slow-step:factor=1.3:rank=all:step=0:strategy=ddp python -m harness run --matrix smoke
    PARBENCH_FAULT=leak:bytes=100MiB:in=numpy:rank=all:step=0 python -m harness run --matrix smoke --strategy plain
    PARBENCH_FAULT=leak-per-step:bytes=1MiB:in=tensor:rank=all:step=0 python -m harness run --matrix smoke ...

kinds:
- `kill`: the rank sends itself SIGKILL, as the kernel's out-of-memory killer would;
- `kill-node`: the rank kills its node's share of the job: its launcher's agent (its parent process: torchrun's
  elastic agent), then itself, as a host that fails does;
- `hang`: the rank stops (sleeps) and never reaches its next collective, as a deadlocked rank would;
- `oom`: the rank raises `torch.OutOfMemoryError`, as the CUDA caching allocator does;
- `crash`: the rank raises RuntimeError, as a bug would;
- `grad-scale` (with `factor=F`): the rank's gradients of that step are F times too large before they are
  reduced, as a rank that sums where it should average would make them;
- `skip-microbatch`: the rank leaves its first micro-batch of that step out of its accumulated gradient, as
  a lost accumulation step would;
- `overflow`: the rank's losses of that step are multiplied by inf before backward, so its gradients hold
  infs and NaNs, as an fp16 overflow would: fp16's loss scaling (harness.strategies.loss_scaling) must skip
  that step on every rank, and every strategy at the same step; with `tensors=PATTERN` only those parameters'
  gradients on that rank are (as `grad-scale` scales them), an overflow confined to one rank's shard of a
  tensor-parallel weight, which no collective carries to the other ranks unless the scaler's verdict is shared;
- `slow-step` (with `factor=F >= 1`, optionally `strategy=NAME`): from the given step on, the rank sleeps
  at the end of each train step, inside its timed region, F - 1 times the time that train step took, so
  the step takes F times as long, as a strategy whose step got slower would; with `strategy=` only in the
  cells of that strategy (one results file holds several). Nothing else about the step changes.
The first five fire at the start of the given step (warm-up steps count) on the given rank (`rank=all`:
on every rank). The three silent kinds multiply that rank's loss of each micro-batch before its backward (by
F, by 0 for the first micro-batch, or by inf), so every rank still runs every backward and issues every collective:
a rank that really skipped a micro-batch would leave ZeRO-2's per-micro-batch reduce-scatter waiting for it
forever. `grad-scale` with `tensors=PATTERN` (fnmatch over parameter names in the unwrapped model, e.g.
`*.c_attn.weight`) scales only those parameters' gradients, as a strategy that mishandles some tensors
would: a hook on each matching parameter multiplies its gradient by F as backward computes it, before any
strategy accumulates or reduces it, and the losses are left alone. `step=S+` makes a silent kind fire in step S
and every later one: with `grad-scale` and rank=all, a model whose gradients are F times larger throughout, which is
what an fp16 loss scale too high for its gradients meets at every step (harness.strategies.loss_scaling).

Four kinds change what a strategy does from the given step on, as a change to its code would:
- `extra-all-reduce` (`rank=all` only: a collective one rank issues alone never completes): in that step and
  every later one, each rank all-reduces EXTRA_ALL_REDUCE_ELEMENTS zeros in fp32 inside the counted step,
  before the strategy's own step, through `torch.distributed` (so not in the plain loop nor on Horovod's ranks,
  which start no torch process group): one all-reduce per step more, weights untouched;
- `weight-copy`: after that step's update the rank keeps an fp32 copy of every tensor its torch optimizer
  updates in that optimizer's state (so after the update, when AdamW has made its own state), as a strategy
  keeping a stray master copy would; the model-state census counts it under `optimizer`;
- `untracked-weight-copy`: after that step's update the rank keeps an fp32 copy of its local weights (of each
  tensor its torch optimizer updates, a DTensor's local shard) in a list on the trainer object, outside the
  optimizer's state, as a strategy keeping a stray master copy of its own would: the census does not see it,
  the tensors outside the census (harness.rank.memory_model.untracked_tensor_bytes) do;
- `lr-scale` (with `factor=F`): before that step the rank multiplies its torch optimizer's learning rate by F,
  for that step and every later one.
Two kinds hold memory that no model state accounts for, as a leak would, which the memory readings outside the
census must flag (harness.rank.memory_model: the gap at the last warm-up step, the growth over the timed steps):
- `leak` (with `bytes=N`, optionally `in=tensor|numpy`): in that step, inside the counted step, the rank allocates N
  bytes of ones (so every page is resident) and holds them to its end: a torch tensor on the rank's device (`in=tensor`,
  the default; the tensors outside the census see it too) or a numpy array in host memory (`in=numpy`: no tensor, so
  only the resident growth sees it);
- `leak-per-step` (the same fields): the same, in that step and every later one, each step's N bytes held beside the
  ones before: a leak of N bytes a step.
N is a whole number of bytes, or one with a unit: `KiB`, `MiB`, `GiB` (`bytes=100MiB`).
Two kinds are bugs of a checkpoint cell (harness.strategies.state_checkpoint), which its resume check must catch
(`rank=all:step=0`, the only values they take):
- `checkpoint-without-optimizer`: the save and the load leave the optimizer's state out (DeepSpeed's load skips its
  optimizer partitions), so the resumed run starts AdamW's moments and step count again;
- `resume-data-from-start`: a resumed launch reads the data of step 0, 1, ... again from its first step.
Two kinds are bugs of an expert-parallel dispatch (harness.strategies.expert_parallel), which parity must catch
(`rank=all:step=0`, the only values they take; every rank's dispatch is wrong from the first step):
- `misroute`: each rank sends the rows meant for one rank's experts to the next rank's, which run them through the
  expert at the same place among theirs, and the outputs come back to their tokens: tokens sent to the wrong rank;
- `ungated-combine`: the combine adds each expert's output to its token without the router's gate weight.
- `causal-leak`: the attention core's causal mask lets the last query before each shard boundary of a sequence split
  over ranks see the first key after it (workloads.attention), as a wrong offset in a sharded mask would: a
  sequence-parallel cell whose core sees the whole sequence (`ulysses`) alone; parity must call it a mismatch.
A loud kind fires in the first attempt of a group alone: an attempt its launcher restarted (torchrun's
TORCHELASTIC_RESTART_COUNT > 0) resumes past it, as a job does once the failed host is replaced.

The optimizer is the torch AdamW every strategy steps (`Trainer.torch_optimizer`). Rows record PARBENCH_*
variables with the rest of the environment, so a row from a run with a fault says so.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

import torch

FAULT_ENV = "PARBENCH_FAULT"
KILL_NODE = "kill-node"
LOUD_KINDS = ("kill", KILL_NODE, "hang", "oom", "crash")
OVERFLOW = "overflow"
SILENT_KINDS = ("grad-scale", "skip-microbatch", OVERFLOW)
EXTRA_ALL_REDUCE, WEIGHT_COPY, UNTRACKED_WEIGHT_COPY, LR_SCALE = CHANGE_KINDS = (
    "extra-all-reduce", "weight-copy", "untracked-weight-copy", "lr-scale")
SLOW_STEP = "slow-step"
CHECKPOINT_WITHOUT_OPTIMIZER, RESUME_DATA_FROM_START = CHECKPOINT_KINDS = ("checkpoint-without-optimizer",
                                                                          "resume-data-from-start")
LEAK, LEAK_PER_STEP = LEAK_KINDS = ("leak", "leak-per-step")
MISROUTE, UNGATED_COMBINE = DISPATCH_KINDS = ("misroute", "ungated-combine")
CAUSAL_LEAK = "causal-leak"
KINDS = (LOUD_KINDS + SILENT_KINDS + CHANGE_KINDS + (SLOW_STEP,) + CHECKPOINT_KINDS + LEAK_KINDS + DISPATCH_KINDS
         + (CAUSAL_LEAK,))
FACTOR_KINDS = ("grad-scale", LR_SCALE, SLOW_STEP)
LEAK_IN = ("tensor", "numpy")       # what a leak allocates: a torch tensor on the rank's device, a numpy array
BYTE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
USAGE = ("KIND:rank=R:step=S (R a rank or all; S+ for step S and every later one, silent kinds only; grad-scale and "
         "lr-scale also :factor=F, grad-scale and overflow optionally :tensors=PATTERN; slow-step also :factor=F >= 1 "
         "and optionally :strategy=NAME; leak and leak-per-step also :bytes=N (100MiB) and optionally "
         ":in=tensor|numpy)")
# What the leaking kinds hold, for the rest of the rank's life: nothing else references it.
LEAKED: list = []
ALL_RANKS = -1           # rank=all
EXTRA_ALL_REDUCE_ELEMENTS = 1024       # 4,096 bytes in fp32: one all-reduce's calls and bytes, plainly seen
WEIGHT_COPY_STATE = "parbench_fault_weight_copy"     # the optimizer-state key the copy is kept under
UNTRACKED_WEIGHT_COPY_ATTRIBUTE = "parbench_fault_weight_copy"   # the trainer attribute holding the untracked copy


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int                # ALL_RANKS: every rank
    step: int
    factor: float = 1.0      # grad-scale: what that rank's gradients are multiplied by; lr-scale: its learning
                             # rate; slow-step: its step time
    tensors: str = ""        # grad-scale only: a pattern of parameter names whose gradients alone it scales
    strategy: str = ""       # slow-step only: the strategy whose cells it slows ("": every cell)
    onward: bool = False     # a silent kind only (`step=S+`): in step S and every later one
    leak_bytes: int = 0      # leak, leak-per-step: the bytes held in (each) step
    leak_in: str = ""        # leak, leak-per-step: one of LEAK_IN

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """'kill:rank=1:step=2' or 'grad-scale:factor=2:rank=1:step=0' -> Fault; ValueError naming what
        is allowed otherwise."""
        kind, *fields = text.split(":")
        try:
            values = dict(field.split("=", 1) for field in fields)
            rank_text, step_text = values.pop("rank"), values.pop("step")
            onward = step_text.endswith("+")
            step = int(step_text.removesuffix("+"))
            rank = ALL_RANKS if rank_text == "all" else int(rank_text)
            factor = float(values.pop("factor")) if kind in FACTOR_KINDS else 1.0
            tensors = values.pop("tensors", "") if kind in ("grad-scale", OVERFLOW) else ""
            strategy = values.pop("strategy", "") if kind == SLOW_STEP else ""
            leak_bytes = _bytes(values.pop("bytes")) if kind in LEAK_KINDS else 0
            leak_in = values.pop("in", LEAK_IN[0]) if kind in LEAK_KINDS else ""
        except (KeyError, ValueError):
            raise ValueError(f"{FAULT_ENV}={text!r}: expected {USAGE}, KIND one of {', '.join(KINDS)}") from None
        if kind not in KINDS or values:
            raise ValueError(f"{FAULT_ENV}={text!r}: kind must be one of {', '.join(KINDS)}, with only rank= "
                             "and step= (and factor= for grad-scale and lr-scale, optionally tensors= for "
                             "grad-scale and overflow; factor=, optionally strategy=, for slow-step; bytes=, "
                             "optionally in=, for leak and leak-per-step)")
        if (rank < 0 and rank_text != "all") or step < 0 or not math.isfinite(factor):
            raise ValueError(f"{FAULT_ENV}={text!r}: rank must be >= 0 or all, step >= 0 and factor a finite "
                             "number")
        if onward and kind not in (*SILENT_KINDS, LEAK_PER_STEP):
            raise ValueError(f"{FAULT_ENV}={text!r}: step=S+ (every step from S on) is for the silent kinds alone: "
                             f"{', '.join(SILENT_KINDS)}")
        if kind in (*CHECKPOINT_KINDS, *DISPATCH_KINDS, CAUSAL_LEAK) and (rank != ALL_RANKS or step != 0):
            raise ValueError(f"{FAULT_ENV}={text!r}: {kind} takes rank=all:step=0 alone: it changes every rank's "
                             "save, load or resumed data, or every rank's dispatch or attention from the start")
        if kind == EXTRA_ALL_REDUCE and rank != ALL_RANKS:
            raise ValueError(f"{FAULT_ENV}={text!r}: {EXTRA_ALL_REDUCE} needs rank=all: an all-reduce that one "
                             "rank issues alone never completes")
        if kind in LEAK_KINDS and (leak_bytes <= 0 or leak_in not in LEAK_IN):
            raise ValueError(f"{FAULT_ENV}={text!r}: {kind} needs bytes= above 0 and in= one of {', '.join(LEAK_IN)}")
        if kind == SLOW_STEP and factor < 1:
            raise ValueError(f"{FAULT_ENV}={text!r}: slow-step's factor must be >= 1 (a sleep only slows a step)")
        if strategy:
            from harness.strategies import STRATEGIES   # lazily: the registry imports every strategy's library

            if strategy not in STRATEGIES:
                raise ValueError(f"{FAULT_ENV}={text!r}: no strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        if kind == OVERFLOW:
            factor = math.inf        # what `scale_tensor_gradients` multiplies the gradients by
        return cls(kind, rank, step, factor, tensors, strategy, onward or kind == LEAK_PER_STEP, leak_bytes, leak_in)

    def _fires(self, rank: int, step: int) -> bool:
        return (step >= self.step if self.onward else step == self.step) and self.rank in (rank, ALL_RANKS)

    def fire(self, rank: int, step: int) -> None:
        """At the start of a step: the loud kinds end, stop or fail the rank here."""
        if not self._fires(rank, step) or self.kind not in LOUD_KINDS:
            return
        if self.kind == KILL_NODE:
            os.kill(os.getppid(), signal.SIGKILL)
        if self.kind in ("kill", KILL_NODE):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        if self.kind == "oom":
            raise torch.OutOfMemoryError(f"injected by {FAULT_ENV}")
        raise RuntimeError(f"crash injected by {FAULT_ENV}")

    def kills(self, rank: int, step: int) -> bool:
        """Does this fault kill this rank at the start of this step?"""
        return self.kind in ("kill", KILL_NODE) and self._fires(rank, step)

    def slows(self, rank: int, step: int, strategy: str) -> bool:
        """Does this rank sleep at the end of this step's train step (slow-step: every step from `step` on)?"""
        return (self.kind == SLOW_STEP and step >= self.step and self.rank in (rank, ALL_RANKS)
                and self.strategy in ("", strategy))

    def slowdown_s(self, step_s: float) -> float:
        """The sleep that makes a train step of `step_s` seconds take `factor` times as long."""
        return (self.factor - 1.0) * step_s

    def loss_multipliers(self, rank: int, step: int, micro_batches: int) -> list[float] | None:
        """What this rank multiplies each micro-batch's loss by before backward in this step, or None
        where the fault leaves the step alone (every honest step)."""
        if not self._fires(rank, step) or self.kind not in SILENT_KINDS or self.tensors:
            return None
        if self.kind == "grad-scale":
            return [self.factor] * micro_batches
        if self.kind == OVERFLOW:
            return [math.inf] * micro_batches
        return [0.0] + [1.0] * (micro_batches - 1)

    def before_step(self, rank: int, step: int, optimizer: Callable[[], torch.optim.Optimizer]) -> None:
        """Before a step: `lr-scale` changes the learning rate of `optimizer()` (the trainer's torch optimizer)."""
        if self.kind == LR_SCALE and self._fires(rank, step):
            for group in optimizer().param_groups:
                group["lr"] *= self.factor

    def in_step(self, rank: int, step: int, device: torch.device) -> None:
        """Inside the counted step, before the strategy's own: `extra-all-reduce`'s collective, from its step on; the
        leaking kinds' allocation, held in LEAKED."""
        if self.kind in LEAK_KINDS and self._fires(rank, step):
            LEAKED.append(self._allocate(device))
        if self.kind != EXTRA_ALL_REDUCE or step < self.step:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(f"{FAULT_ENV}: {EXTRA_ALL_REDUCE} needs a torch.distributed process group, and "
                               "this rank has none (the plain loop and Horovod start none)")
        dist.all_reduce(torch.zeros(EXTRA_ALL_REDUCE_ELEMENTS, dtype=torch.float32, device=device))

    def after_step(self, rank: int, step: int, optimizer: Callable[[], torch.optim.Optimizer],
                   trainer: object = None) -> None:
        """After a step's update: `weight-copy` keeps an fp32 copy of every tensor `optimizer()` updates in its
        state, where the model-state census reads optimizer state (harness.rank.memory_model);
        `untracked-weight-copy` keeps one of their local parts on `trainer`, where the census does not look."""
        if self.kind == UNTRACKED_WEIGHT_COPY and self._fires(rank, step):
            weights = [p for group in optimizer().param_groups for p in group["params"]]
            local = [p.to_local() if hasattr(p, "to_local") else p for p in weights]    # a DTensor's shard
            setattr(trainer, UNTRACKED_WEIGHT_COPY_ATTRIBUTE,
                    [part.detach().to(torch.float32, copy=True) for part in local])
        if self.kind != WEIGHT_COPY or not self._fires(rank, step):
            return
        # Only beside state the optimizer has made: a tensor whose state is not empty is never initialised.
        for tensor, state in optimizer().state.items():
            if state:
                state[WEIGHT_COPY_STATE] = tensor.detach().to(torch.float32, copy=True)

    def _allocate(self, device: torch.device) -> object:
        """`leak_bytes` of ones (written, so resident): a uint8 tensor on `device`, or a numpy array."""
        if self.leak_in == "numpy":
            import numpy as np

            return np.ones(self.leak_bytes, dtype=np.uint8)
        return torch.ones(self.leak_bytes, dtype=torch.uint8, device=device)

    def scale_tensor_gradients(self, rank: int, step: int, model: torch.nn.Module) -> Callable[[], None]:
        """Before a step: with `tensors=`, arm `model`'s (the unwrapped layers') matching parameters so that
        this step's backward multiplies their gradients by the factor; returns what disarms them after the
        step (and fails the rank if no gradient was scaled: a pattern no parameter of this rank took part
        with). A no-op pair for every other fault and step."""
        if not self.tensors or not self._fires(rank, step):
            return lambda: None
        handles: list[torch.utils.hooks.RemovableHandle] = []
        hooked: set[int] = set()
        scaled: list[int] = []

        def scale(gradient: torch.Tensor) -> torch.Tensor:
            scaled.append(1)
            return gradient * self.factor

        def arm(names: list[str], module: torch.nn.Module, _inputs) -> None:
            # The parameter forward uses is read here, when the module runs: FSDP2 sets its gathered
            # (unsharded) copy in place of the sharded one only then. One hook per tensor per step, however
            # many micro-batches run through it.
            for name in names:
                tensor = getattr(module, name)
                if id(tensor) not in hooked:
                    hooked.add(id(tensor))
                    handles.append(tensor.register_hook(scale))

        for prefix, module in model.named_modules():
            names = [name for name, _ in module.named_parameters(recurse=False)
                     if fnmatch.fnmatchcase(f"{prefix}.{name}" if prefix else name, self.tensors)]
            if names:
                handles.append(module.register_forward_pre_hook(functools.partial(arm, names)))
        if not handles:
            raise ValueError(f"{FAULT_ENV}: tensors={self.tensors!r} matches no parameter of the model")

        def disarm() -> None:
            for handle in handles:
                handle.remove()
            if not scaled:
                raise RuntimeError(f"{FAULT_ENV}: tensors={self.tensors!r} scaled no gradient on rank {rank} in "
                                   f"step {step}")
        return disarm


def _bytes(text: str) -> int:
    """'100MiB' -> 104857600, '4096' -> 4096; ValueError otherwise."""
    number = text.rstrip("BKMGi")
    unit = text[len(number):] or "B"
    if unit not in BYTE_UNITS:
        raise ValueError(text)
    return int(number) * BYTE_UNITS[unit]


def fault_from_environment() -> Fault | None:
    text = os.environ.get(FAULT_ENV)
    return Fault.parse(text) if text else None
