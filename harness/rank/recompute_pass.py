"""The recompute pass: what activation checkpointing costs in step time, measured in the same run.

Run by each rank (harness.rank.worker) after its timed steps, where the cell checkpoints blocks: the unwrapped
model, built from the same seed, runs forward and backward over the rank's micro-batches of the timed steps,
alternately with the cell's checkpointing and without it (one model: the checkpointed one wraps the same
blocks), one untimed pair first, each pair in the other order from the last. Alternating puts both under the
same host conditions. No optimizer step:
checkpointing does not change it. harness.derive.techniques turns the two series into the recompute cost,
median(checkpointed) / median(kept) - 1; a checkpointed block runs its forward twice, so with every block
checkpointed the cost approaches the blocks' forward over the whole forward and backward (about a third).

It is the whole model on every rank, in the cell's precision (torch.autocast for bf16): for tensor and
pipeline parallelism a rank's own share is smaller, and the pass measures the cost of the recipe on the
model, not on that share.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from harness.rank.timing import StepTimer
from harness.spec import RunSpec
from harness.strategies.base import Strategy, accumulate
from harness.strategies.checkpointing import checkpointed_blocks
from harness.strategies.compiling import compiled_blocks, compiles
from workloads import Workload


class RecomputeTimes(NamedTuple):
    checkpointed_s: list[float]
    kept_s: list[float]


def recompute_pass(spec: RunSpec, strategy: Strategy, device: torch.device, workload: Workload, interval: int,
                   sample_indices: Callable[[int], torch.Tensor], barrier: Callable[[], None]) -> RecomputeTimes:
    """`spec.timed_steps` timed pairs after one untimed pair (module docstring); `sample_indices(micro)` are this
    rank's samples of a micro-batch. Raises torch.OutOfMemoryError where the model does not fit."""
    layout = strategy.layout(spec)
    torch.manual_seed(spec.seed)
    layers = workload.build_layers()
    kept = nn.Sequential(*layers).to(device)
    checkpointed = nn.Sequential(*checkpointed_blocks(list(kept), interval))
    # Compiled as the cell's blocks are, each version its own graph: the untimed first pair compiles them.
    compile_them = compiles(strategy.resolved(spec))
    kept_as_run = nn.Sequential(*compiled_blocks(list(kept), compile_them))
    checkpointed = nn.Sequential(*compiled_blocks(list(checkpointed), compile_them))
    timers = {"checkpointed": StepTimer(device), "kept": StepTimer(device)}
    for index in range(1 + spec.timed_steps):
        data_step = spec.warmup_steps + max(0, index - 1)
        micro_batches = [workload.batch(spec.seed, data_step, sample_indices(micro), device)
                         for micro in range(layout.micro_batches)]
        pair = (("checkpointed", checkpointed), ("kept", kept_as_run))
        for name, model in pair if index % 2 == 0 else pair[::-1]:    # neither always runs first
            barrier()
            with timers[name].measure(record=index >= 1):
                accumulate(model, workload.loss, micro_batches, spec, device)
            kept.zero_grad(set_to_none=True)
    return RecomputeTimes(checkpointed_s=timers["checkpointed"].seconds, kept_s=timers["kept"].seconds)
