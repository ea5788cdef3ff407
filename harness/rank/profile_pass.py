"""Optional GPU profiler pass: how long NCCL kernels ran per step, and how much of that hid behind compute.

Run after the timed steps (`--profile-steps N`), never during them: the profiler's own cost must not touch
the timed figures. torch.profiler records every CUDA kernel with its start and end on the device; kernels
whose name contains "nccl" are communication, the others compute. Per step:
- nccl_kernel_s: the union of NCCL kernel intervals (time the GPU spent in communication);
- overlapped fraction: the part of that union during which a compute kernel ran too, i.e. hidden
  communication. 1 - overlapped is the exposed share of NCCL time as the device saw it.
On CPU there are no device kernels to separate, so the pass is not available.
"""

from __future__ import annotations

from typing import Callable, Iterable


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_figures(kernels: Iterable[tuple[str, float, float]], steps: int) -> dict[str, float]:
    """From (name, start_s, end_s) of device kernels over `steps` steps: NCCL time per step and its
    overlapped fraction."""
    kernels = list(kernels)
    nccl = _union((s, e) for name, s, e in kernels if "nccl" in name.lower())
    compute = _union((s, e) for name, s, e in kernels if "nccl" not in name.lower())
    nccl_time = _length(nccl)
    hidden = _intersection(nccl, compute)
    return {"nccl_kernel_s_per_step": nccl_time / steps,
            "nccl_overlapped_fraction": hidden / nccl_time if nccl_time else None}


def profile_steps(run_step: Callable[[int], None], steps: int) -> dict[str, float]:
    """Run `steps` steps under torch.profiler (CUDA activity) and return `overlap_figures` of them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for step in range(steps):
            run_step(step)
        torch.cuda.synchronize()
    kernels = [(event.name, event.time_range.start / 1e6, event.time_range.end / 1e6)
               for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    return overlap_figures(kernels, steps)
