"""Step timing with the device synchronised: the only place the harness reads a clock inside a rank.

On CUDA the region is bracketed by CUDA events, after a device-wide synchronize so that earlier work
(data generation, the previous step) cannot leak in. A host clock around the same region, closed by a
second device-wide synchronize, is kept beside it: work a library left on a side stream after the end
event would show as a gap between the two. On CPU, kernels and gloo collectives are synchronous, so the
host clock is exact. Nothing here synchronises inside the region: the overlap of communication with
compute is part of what is measured.

Each step also records how much CPU time the operating system accounted to the whole machine while the
step ran (`HostClock`). On a virtual machine whose host deschedules it (CPU quota, steal), a step can
take a second of wall time during which the guest ran for a fraction of it; such a step measures the
host, not the strategy. `stalled_steps` names them so that reports can show, and `compare` set aside,
steps that say nothing about the software; the raw step times are always kept and stay the headline.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Iterator

import torch


# A step is stalled when at least one CPU's worth of time went missing for half of its wall time or more
# (a hypervisor often pauses one vCPU, the one running the rank, while the other sits idle), and at least
# STALL_MIN_LOST_S in all: /proc/stat counts in 10 ms ticks, so a 30 ms step can look a tick or two
# short without anything having happened.
STALL_MIN_LOST_S = 0.1
STALL_MIN_LOST_SHARE_OF_WALL = 0.5


class HostClock:
    """CPU time the kernel accounted to the whole machine, from /proc/stat (Linux; None elsewhere).

    Running time is user + nice + system + idle + iowait + irq + softirq: every state of a CPU that the
    guest actually had. Steal (the hypervisor ran someone else) and time the VM was paused are missing
    from it, which is what a stall is."""

    def __init__(self) -> None:
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self.cpus = max(1, self._cpu_lines())

    @staticmethod
    def _cpu_lines() -> int:
        try:
            with open("/proc/stat") as stat:
                return sum(1 for line in stat if re.match(r"cpu\d+ ", line))
        except OSError:
            return 0

    def running_s(self) -> float | None:
        try:
            with open("/proc/stat") as stat:
                fields = stat.readline().split()
        except OSError:
            return None
        user, nice, system, idle, iowait, irq, softirq = (int(x) for x in fields[1:8])
        return (user + nice + system + idle + iowait + irq + softirq) * self.tick_s

    def lost_s(self, running_s: float, wall_s: float) -> float:
        """CPU time the machine should have had over `wall_s` but was not given."""
        return self.cpus * wall_s - running_s

    def stalled(self, running_s: float, wall_s: float) -> bool:
        lost = self.lost_s(running_s, wall_s)
        return lost >= STALL_MIN_LOST_S and lost >= STALL_MIN_LOST_SHARE_OF_WALL * wall_s


_HOST_CLOCK = HostClock()


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: list[float] = []        # CUDA events on GPU, host clock on CPU
        self.wall_seconds: list[float] = []   # host clock between device-wide synchronizes
        self.host_lost_seconds: list[float | None] = []   # CPU time the host withheld (HostClock)
        self.stalled: list[bool] = []

    def forget(self) -> None:
        """Drop the steps recorded so far (an elastic job runs them again from its last commit)."""
        self.seconds, self.wall_seconds, self.host_lost_seconds, self.stalled = [], [], [], []

    @contextlib.contextmanager
    def measure(self, record: bool = True) -> Iterator[None]:
        """Time the body; keep the figures only when `record` (warm-up steps run the same path untimed)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        running_before = _HOST_CLOCK.running_s()
        began = time.perf_counter()
        yield
        if cuda:
            end.record()
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - began
        running_after = _HOST_CLOCK.running_s()
        if record:
            self.seconds.append(start.elapsed_time(end) / 1000.0 if cuda else wall)
            self.wall_seconds.append(wall)
            if running_before is None or running_after is None:
                self.host_lost_seconds.append(None)
                self.stalled.append(False)
            else:
                running = running_after - running_before
                self.host_lost_seconds.append(_HOST_CLOCK.lost_s(running, wall))
                self.stalled.append(_HOST_CLOCK.stalled(running, wall))
