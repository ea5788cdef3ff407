"""The bare loop's rank program (harness.strategies.bare): the plain loop's steps with nothing of the harness's among
them, timed as a whole.

    python -m harness run --matrix full --strategy plain,bare --world-sizes 1

The model, optimizer and step are the plain loop's (`Strategy.wrap` of the bare strategy, a Plain); so are the data,
made by the same function for the same steps. The warm-up steps run first. Then every timed step's micro-batches are
made, the device synchronised and the peak memory reset, one clock read, the timed steps run back to back with no
barrier, probe, counter, census or synchronisation between them, the device synchronised once and the clock read
again. The losses stay on the device until the end. What the worker's measured steps add to this is the harness's
cost on a step (harness.derive.harness_overhead).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch

from harness.rank.facts import cell_facts, host_load, host_load_figures, memory_figures, rank_memory
from harness.rank.memory_model import reset_peak_memory
from harness.spec import Precision, RunSpec
from harness.strategies import Strategy
from harness.strategies.base import RankContext
from harness.strategies.compiling import CompileReading, compile_figures, compiles
from workloads import count_parameters, get_workload


def run_bare_loop(spec: RunSpec, strategy: Strategy, context: RankContext) -> dict[str, Any]:
    """The row's measurements of one bare launch: every step's loss, the timed loop's time and steps, peak memory
    over the timed steps and the facts every row holds."""
    workload = get_workload(spec.workload)
    layout = strategy.layout(spec)
    torch.manual_seed(spec.seed)
    layers = workload.build_layers()            # on CPU from the seed, as the worker builds them
    workload.scale_auxiliary_losses(layers, 1 / layout.micro_batches)     # as the worker does
    parameters = count_parameters(torch.nn.Sequential(*layers))
    trainer = strategy.wrap(spec, context, workload, layers)

    def micro_batches(step: int) -> list:
        return [workload.batch(spec.seed, step, strategy.sample_indices(spec, context, index), context.device)
                for index in range(layout.micro_batches)]

    losses, outcomes = [], []

    def step(batches: list) -> None:
        losses.append(trainer.train_step(batches))
        # fp16: what the loss scaler did, which the step has read already (an attribute, no synchronisation).
        outcomes.append(trainer.step_outcome)

    for index in range(spec.warmup_steps):
        step(micro_batches(index))
    timed = [micro_batches(index) for index in range(spec.warmup_steps, spec.warmup_steps + spec.timed_steps)]
    _synchronize(context.device)
    compiled = compiles(strategy.resolved(spec))
    readings = {"timed_start": vars(CompileReading.now())} if compiled else {}
    peak_rss_since = reset_peak_memory(context.device)
    started = time.perf_counter()
    for batches in timed:
        step(batches)
    _synchronize(context.device)
    loop_time_s = time.perf_counter() - started
    if compiled:
        readings["timed_end"] = vars(CompileReading.now())
    memory = rank_memory(context, peak_rss_since)
    figures = {"loss_per_step": torch.stack(losses).float().tolist(), "loop_time_s": loop_time_s,
               "loop_steps": spec.timed_steps, "hosts": [socket.gethostname()],
               **cell_facts(workload, layout, context, trainer, parameters),
               **memory_figures(context, [memory]), **host_load_figures([host_load(context)]),
               **compile_figures(compiled, [readings]),
               "compute_only_unavailable_because": strategy.compute_only_unavailable(spec),
               "norms_unavailable_because": "the bare loop reads nothing between its steps",
               # The plain loop's, which parity's arithmetic follows (harness.derive.parity `arithmetic`).
               "gradient_reduce_dtypes": list(strategy.gradient_reduce_dtypes(spec, torch.nn.Sequential(*layers)))}
    if spec.precision is Precision.FP16:     # each step applied or skipped, and its scale, as the worker records
        applied = [outcome.applied for outcome in outcomes]
        figures.update(optimizer_step_applied=applied, optimizer_step_applied_by_rank=[applied],
                       loss_scale_per_step=[outcome.loss_scale for outcome in outcomes])
    trainer.close()
    return figures


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
