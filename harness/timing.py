"""Step timing with the device synchronised: the only place the harness reads a clock inside a rank.

On CUDA the region is bracketed by CUDA events, after a device-wide synchronize so that earlier work
(data generation, the previous step) cannot leak in. A host clock around the same region, closed by a
second device-wide synchronize, is kept beside it: work a library left on a side stream after the end
event would show as a gap between the two. On CPU, kernels and gloo collectives are synchronous, so the
host clock is exact. Nothing here synchronises inside the region: the overlap of communication with
compute is part of what is measured.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: list[float] = []        # CUDA events on GPU, host clock on CPU
        self.wall_seconds: list[float] = []   # host clock between device-wide synchronizes

    @contextlib.contextmanager
    def measure(self, record: bool = True) -> Iterator[None]:
        """Time the body; keep the figures only when `record` (warm-up steps run the same path untimed)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        yield
        if cuda:
            end.record()
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - began
        if record:
            self.seconds.append(start.elapsed_time(end) / 1000.0 if cuda else wall)
            self.wall_seconds.append(wall)
