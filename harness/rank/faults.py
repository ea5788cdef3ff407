"""Faults injected into a rank on purpose, so that the harness's checks are tested against the real thing:
a rank that dies, hangs or runs out of memory in the middle of a cell, a rank whose gradients are
silently wrong, which only loss parity (harness.derive.parity) can notice, and a strategy whose step got
slower, which only a timed comparison (`harness ab`, harness/ab.py) can notice.

    PARBENCH_FAULT=kill:rank=1:step=2 python -m harness run --matrix smoke --strategy ddp
    PARBENCH_FAULT=grad-scale:factor=2:rank=1:step=0 python -m harness run --matrix smoke --strategy ddp
    PARBENCH_FAULT='grad-scale:factor=0.5:tensors=*.c_attn.weight:rank=all:step=0' python -m harness run ...
    PARBENCH_FAULT=slow-step:factor=1.3:rank=all:step=0:strategy=ddp python -m harness run --matrix smoke

kinds:
- `kill`: the rank sends itself SIGKILL, as the kernel's out-of-memory killer would;
- `hang`: the rank stops (sleeps) and never reaches its next collective, as a deadlocked rank would;
- `oom`: the rank raises `torch.OutOfMemoryError`, as the CUDA caching allocator does;
- `crash`: the rank raises RuntimeError, as a bug would;
- `grad-scale` (with `factor=F`): the rank's gradients of that step are F times too large before they are
  reduced, as a rank that sums where it should average would make them;
- `skip-microbatch`: the rank leaves its first micro-batch of that step out of its accumulated gradient, as
  a lost accumulation step would;
- `slow-step` (with `factor=F >= 1`, optionally `strategy=NAME`): from the given step on, the rank sleeps
  at the end of each train step, inside its timed region, F - 1 times the time that train step took, so
  the step takes F times as long, as a strategy whose step got slower would; with `strategy=` only in the
  cells of that strategy (one results file holds several). Nothing else about the step changes.
The first four fire at the start of the given step (warm-up steps count) on the given rank (`rank=all`:
on every rank). The two silent kinds multiply that rank's loss of each micro-batch before its backward (by
F, or by 0 for the first micro-batch), so every rank still runs every backward and issues every collective:
a rank that really skipped a micro-batch would leave ZeRO-2's per-micro-batch reduce-scatter waiting for it
forever. `grad-scale` with `tensors=PATTERN` (fnmatch over parameter names in the unwrapped model, e.g.
`*.c_attn.weight`) scales only those parameters' gradients, as a strategy that mishandles some tensors
would: a hook on each matching parameter multiplies its gradient by F as backward computes it, before any
strategy accumulates or reduces it, and the losses are left alone. Rows record PARBENCH_* variables with
the rest of the environment, so a row from a run with a fault says so.
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
LOUD_KINDS = ("kill", "hang", "oom", "crash")
SILENT_KINDS = ("grad-scale", "skip-microbatch")
SLOW_STEP = "slow-step"
KINDS = LOUD_KINDS + SILENT_KINDS + (SLOW_STEP,)
USAGE = ("KIND:rank=R:step=S (R a rank or all; grad-scale also :factor=F and optionally :tensors=PATTERN; "
         "slow-step also :factor=F >= 1 and optionally :strategy=NAME)")
FACTOR_KINDS = ("grad-scale", SLOW_STEP)
ALL_RANKS = -1           # rank=all


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int                # ALL_RANKS: every rank
    step: int
    factor: float = 1.0      # grad-scale: what that rank's gradients are multiplied by; slow-step: its step time
    tensors: str = ""        # grad-scale only: a pattern of parameter names whose gradients alone it scales
    strategy: str = ""       # slow-step only: the strategy whose cells it slows ("": every cell)

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """'kill:rank=1:step=2' or 'grad-scale:factor=2:rank=1:step=0' -> Fault; ValueError naming what
        is allowed otherwise."""
        kind, *fields = text.split(":")
        try:
            values = dict(field.split("=", 1) for field in fields)
            rank_text, step = values.pop("rank"), int(values.pop("step"))
            rank = ALL_RANKS if rank_text == "all" else int(rank_text)
            factor = float(values.pop("factor")) if kind in FACTOR_KINDS else 1.0
            tensors = values.pop("tensors", "") if kind == "grad-scale" else ""
            strategy = values.pop("strategy", "") if kind == SLOW_STEP else ""
        except (KeyError, ValueError):
            raise ValueError(f"{FAULT_ENV}={text!r}: expected {USAGE}, KIND one of {', '.join(KINDS)}") from None
        if kind not in KINDS or values:
            raise ValueError(f"{FAULT_ENV}={text!r}: kind must be one of {', '.join(KINDS)}, with only rank= "
                             "and step= (and factor=, optionally tensors=, for grad-scale; factor=, optionally "
                             "strategy=, for slow-step)")
        if (rank < 0 and rank_text != "all") or step < 0 or not math.isfinite(factor):
            raise ValueError(f"{FAULT_ENV}={text!r}: rank must be >= 0 or all, step >= 0 and factor a finite "
                             "number")
        if kind == SLOW_STEP and factor < 1:
            raise ValueError(f"{FAULT_ENV}={text!r}: slow-step's factor must be >= 1 (a sleep only slows a step)")
        if strategy:
            from harness.strategies import STRATEGIES   # lazily: the registry imports every strategy's library

            if strategy not in STRATEGIES:
                raise ValueError(f"{FAULT_ENV}={text!r}: no strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        return cls(kind, rank, step, factor, tensors, strategy)

    def _fires(self, rank: int, step: int) -> bool:
        return step == self.step and self.rank in (rank, ALL_RANKS)

    def fire(self, rank: int, step: int) -> None:
        """At the start of a step: the loud kinds end, stop or fail the rank here."""
        if not self._fires(rank, step) or self.kind not in LOUD_KINDS:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        if self.kind == "oom":
            raise torch.OutOfMemoryError(f"injected by {FAULT_ENV}")
        raise RuntimeError(f"crash injected by {FAULT_ENV}")

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
        return [0.0] + [1.0] * (micro_batches - 1)

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


def fault_from_environment() -> Fault | None:
    text = os.environ.get(FAULT_ENV)
    return Fault.parse(text) if text else None
