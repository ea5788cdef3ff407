"""Faults injected into a rank on purpose, so that the harness's failure isolation is tested against the
real thing: a rank that dies, hangs or runs out of memory in the middle of a cell.

    PARBENCH_FAULT=kill:rank=1:step=2 python -m harness run --matrix smoke --strategy ddp

kinds:
- `kill`: the rank sends itself SIGKILL, as the kernel's out-of-memory killer would;
- `hang`: the rank stops (sleeps) and never reaches its next collective, as a deadlocked rank would;
- `oom`: the rank raises `torch.OutOfMemoryError`, as the CUDA caching allocator does;
- `crash`: the rank raises RuntimeError, as a bug would.
The fault fires at the start of the given step (warm-up steps count) on the given rank. Rows record
PARBENCH_* variables with the rest of the environment, so a row from a run with a fault says so.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

FAULT_ENV = "PARBENCH_FAULT"
KINDS = ("kill", "hang", "oom", "crash")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """'kill:rank=1:step=2' -> Fault; ValueError naming what is allowed otherwise."""
        kind, *fields = text.split(":")
        try:
            values = dict(field.split("=", 1) for field in fields)
            fault = cls(kind, int(values.pop("rank")), int(values.pop("step")))
        except (KeyError, ValueError):
            raise ValueError(f"{FAULT_ENV}={text!r}: expected KIND:rank=R:step=S") from None
        if kind not in KINDS or values:
            raise ValueError(f"{FAULT_ENV}={text!r}: kind must be one of {', '.join(KINDS)}, "
                             "with only rank= and step=")
        return fault

    def fire(self, rank: int, step: int) -> None:
        if (rank, step) != (self.rank, self.step):
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        if self.kind == "oom":
            raise torch.OutOfMemoryError(f"injected by {FAULT_ENV}")
        raise RuntimeError(f"crash injected by {FAULT_ENV}")


def fault_from_environment() -> Fault | None:
    text = os.environ.get(FAULT_ENV)
    return Fault.parse(text) if text else None
