"""Faults injected into a rank on purpose, so that the harness's checks are tested against the real thing:
a rank that dies, hangs or runs out of memory in the middle of a cell, and a rank whose gradients are
silently wrong, which only loss parity (harness.derive.parity) can notice.

    PARBENCH_FAULT=kill:rank=1:step=2 python -m harness run --matrix smoke --strategy ddp
    PARBENCH_FAULT=grad-scale:factor=2:rank=1:step=0 python -m harness run --matrix smoke --strategy ddp

kinds:
- `kill`: the rank sends itself SIGKILL, as the kernel's out-of-memory killer would;
- `hang`: the rank stops (sleeps) and never reaches its next collective, as a deadlocked rank would;
- `oom`: the rank raises `torch.OutOfMemoryError`, as the CUDA caching allocator does;
- `crash`: the rank raises RuntimeError, as a bug would;
- `grad-scale` (with `factor=F`): the rank's gradients of that step are F times too large before they are
  reduced, as a rank that sums where it should average would make them;
- `skip-microbatch`: the rank leaves its first micro-batch of that step out of its accumulated gradient, as
  a lost accumulation step would.
The first four fire at the start of the given step (warm-up steps count) on the given rank. The two silent
kinds multiply that rank's loss of each micro-batch before its backward (by F, or by 0 for the first
micro-batch), so every rank still runs every backward and issues every collective: a rank that really
skipped a micro-batch would leave ZeRO-2's per-micro-batch reduce-scatter waiting for it forever. Rows
record PARBENCH_* variables with the rest of the environment, so a row from a run with a fault says so.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass

import torch

FAULT_ENV = "PARBENCH_FAULT"
LOUD_KINDS = ("kill", "hang", "oom", "crash")
SILENT_KINDS = ("grad-scale", "skip-microbatch")
KINDS = LOUD_KINDS + SILENT_KINDS
USAGE = "KIND:rank=R:step=S (grad-scale also :factor=F)"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    factor: float = 1.0      # grad-scale only: what that rank's gradients are multiplied by

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """'kill:rank=1:step=2' or 'grad-scale:factor=2:rank=1:step=0' -> Fault; ValueError naming what
        is allowed otherwise."""
        kind, *fields = text.split(":")
        try:
            values = dict(field.split("=", 1) for field in fields)
            rank, step = int(values.pop("rank")), int(values.pop("step"))
            factor = float(values.pop("factor")) if kind == "grad-scale" else 1.0
        except (KeyError, ValueError):
            raise ValueError(f"{FAULT_ENV}={text!r}: expected {USAGE}, KIND one of {', '.join(KINDS)}") from None
        if kind not in KINDS or values:
            raise ValueError(f"{FAULT_ENV}={text!r}: kind must be one of {', '.join(KINDS)}, with only rank= "
                             "and step= (and factor= for grad-scale)")
        if rank < 0 or step < 0 or not math.isfinite(factor):
            raise ValueError(f"{FAULT_ENV}={text!r}: rank and step must be >= 0 and factor a finite number")
        return cls(kind, rank, step, factor)

    def fire(self, rank: int, step: int) -> None:
        """At the start of a step: the loud kinds end, stop or fail the rank here."""
        if (rank, step) != (self.rank, self.step) or self.kind in SILENT_KINDS:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        if self.kind == "oom":
            raise torch.OutOfMemoryError(f"injected by {FAULT_ENV}")
        raise RuntimeError(f"crash injected by {FAULT_ENV}")

    def loss_multipliers(self, rank: int, step: int, micro_batches: int) -> list[float] | None:
        """What this rank multiplies each micro-batch's loss by before backward in this step, or None
        where the fault leaves the step alone (every honest step)."""
        if (rank, step) != (self.rank, self.step) or self.kind not in SILENT_KINDS:
            return None
        if self.kind == "grad-scale":
            return [self.factor] * micro_batches
        return [0.0] + [1.0] * (micro_batches - 1)


def fault_from_environment() -> Fault | None:
    text = os.environ.get(FAULT_ENV)
    return Fault.parse(text) if text else None
