"""The compute-only pass: a rank's own step with no communication, the baseline of exposed communication.

Run by each rank (harness.rank.worker) after its timed steps, as its strategy's `compute_only_plan` says: the
unwrapped model, built from the same seed, its weights in the dtype the real recipe computes with, trained
on the same micro-batches, then an AdamW step over exactly the parameter elements this rank's optimizer
updates in the real step (`shard_pieces`): all of them for DDP and Horovod; for ZeRO and FSDP2 the rank's
1/N, cut as the library cuts it. Ranks run side by side and meet at a barrier before each step, so they
contend for the host as in the real step. The pass records raw step times, stall flags and the number of
elements its optimizer updates; harness.derive.exposed turns them into exposed communication.

What is not mirrored is the strategy's own bookkeeping around its collectives (bucket copies, flattening,
pre- and post-division): it counts as the strategy's cost, in the exposed figure.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
from torch import nn

from harness.spec import Precision, RunSpec
from harness.strategies.loss_scaling import scaler_for
from harness.strategies.base import (ComputeOnlyPlan, RankContext, Sharding, Strategy, accumulate, make_adamw)
from harness.strategies.compiling import blocks_as_run
from harness.strategies.plain import PlainTrainer
from harness.rank.timing import StepTimer
from workloads import Workload


class Piece(NamedTuple):
    """Elements [start, stop) of parameter `index`, in its flattened (row-major) order."""

    index: int
    start: int
    stop: int


def shard_pieces(shapes: Sequence[Sequence[int]], sharding: Sharding, rank: int, ranks: int) -> list[Piece]:
    """The elements of parameters of these shapes that rank `rank` of `ranks` updates.

    - replicated: every element;
    - flat (DeepSpeed ZeRO-1/2): all parameters concatenated and cut into `ranks` contiguous chunks of
      ceil(total / ranks) elements (DeepSpeed pads the flat buffer to an alignment first, which moves a
      boundary by fewer elements than the alignment);
    - per-parameter (DeepSpeed ZeRO-3): each parameter cut the same way on its own;
    - dim-0 rows (FSDP2): each parameter's rows cut into chunks of ceil(rows / ranks), torch.chunk's cut,
      so the last ranks may get fewer rows or none.
    """
    numels = [_numel(shape) for shape in shapes]
    if sharding is Sharding.REPLICATED:
        return [Piece(i, 0, n) for i, n in enumerate(numels) if n]
    if sharding is Sharding.FLAT:
        total = sum(numels)
        chunk = -(-total // ranks)
        low, high = rank * chunk, min((rank + 1) * chunk, total)
        pieces, offset = [], 0
        for i, n in enumerate(numels):
            start, stop = max(low, offset), min(high, offset + n)
            if start < stop:
                pieces.append(Piece(i, start - offset, stop - offset))
            offset += n
        return pieces
    if sharding is Sharding.PER_PARAMETER:
        pieces = []
        for i, n in enumerate(numels):
            chunk = -(-n // ranks)
            start, stop = min(rank * chunk, n), min((rank + 1) * chunk, n)
            if start < stop:
                pieces.append(Piece(i, start, stop))
        return pieces
    if sharding is Sharding.DIM0_ROWS:
        pieces = []
        for i, (shape, n) in enumerate(zip(shapes, numels)):
            rows = shape[0] if len(shape) else 1
            row = n // rows if rows else 0
            chunk = -(-rows // ranks)
            first, last = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
            if first < last:
                pieces.append(Piece(i, first * row, last * row))
        return pieces
    raise ValueError(f"unknown sharding {sharding!r}; known: {', '.join(s.value for s in Sharding)}")


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class ShardStep:
    """AdamW over one rank's pieces of a model's parameters, fed from the model's gradients.

    Flat and per-parameter sharding (DeepSpeed) step one flat fp32 tensor holding the rank's pieces and copy
    the result back into the weights, as DeepSpeed's fp32 partition is copied into its weights. Dim-0 rows
    (FSDP2) step one tensor per parameter: views into fp32 weights, updated in place like FSDP2's local
    shards, or fp32 copies of bf16 weights, cast back after the step."""

    def __init__(self, model: nn.Module, plan: ComputeOnlyPlan, rank: int, ranks: int, device: torch.device) -> None:
        self.parameters = list(model.parameters())
        self.pieces = shard_pieces([tuple(p.shape) for p in self.parameters], plan.sharding, rank, ranks)
        self.flat = plan.sharding in (Sharding.FLAT, Sharding.PER_PARAMETER)
        self.whole_gradients_in_fp32 = plan.whole_gradients_in_fp32
        self.elements = sum(piece.stop - piece.start for piece in self.pieces)
        with torch.no_grad():
            slices = [self._slice(piece) for piece in self.pieces]
            if self.flat:
                self.masters = [torch.cat([s.float() for s in slices])] if slices else []
            else:
                self.masters = [s if s.dtype == torch.float32 else s.float() for s in slices]
        self.in_place = not self.flat and all(p.dtype == torch.float32 for p in self.parameters)
        self.optimizer = make_adamw(self.masters, device) if self.masters else None

    def _slice(self, piece: Piece) -> torch.Tensor:
        return self.parameters[piece.index].detach().view(-1)[piece.start:piece.stop]

    def step(self) -> None:
        with torch.no_grad():
            gradients = []
            for piece in self.pieces:
                gradient = self.parameters[piece.index].grad
                if self.whole_gradients_in_fp32:
                    gradient = gradient.float()
                gradients.append(gradient.reshape(-1)[piece.start:piece.stop])
            if self.flat and self.masters:
                self.masters[0].grad = torch.cat([g.float() for g in gradients])
            else:
                for master, gradient in zip(self.masters, gradients):
                    master.grad = gradient if gradient.dtype == master.dtype else gradient.float()
            if self.optimizer is not None:
                self.optimizer.step()
            if not self.in_place:
                self._copy_back()
        for parameter in self.parameters:
            parameter.grad = None
        for master in self.masters:
            master.grad = None

    def _copy_back(self) -> None:
        if self.flat:
            offset = 0
            for piece in self.pieces:
                length = piece.stop - piece.start
                self._slice(piece).copy_(self.masters[0][offset:offset + length])
                offset += length
        else:
            for piece, master in zip(self.pieces, self.masters):
                self._slice(piece).copy_(master)


class CompletedPass(NamedTuple):
    times_s: list[float]
    stalled: list[bool]
    optimizer_elements: int


def compute_only_pass(spec: RunSpec, strategy: Strategy, context: RankContext, workload: Workload,
                      barrier: Callable[[], None]) -> CompletedPass:
    """One untimed warm-up step and `spec.timed_steps` timed steps of this rank's own work (module docstring)
    on the data of the real timed steps. Raises torch.OutOfMemoryError where the model does not fit."""
    plan = strategy.compute_only_plan(spec)
    layout = strategy.layout(spec)
    torch.manual_seed(spec.seed)
    # Checkpointed and compiled as the cell's blocks are: recomputation is the rank's own work, not communication,
    # and a compiled cell's own work is its compiled kernels' (the untimed first step compiles them). ZeRO's
    # engine.compile() compiles its whole module; this pass compiles the blocks, where nearly all the work is.
    layers = blocks_as_run(workload.build_layers(), strategy.resolved(spec))
    model = nn.Sequential(*layers).to(context.device, dtype=plan.weights_dtype)
    # Autocast or not is the plan's: a 16-bit-weights recipe computes in 16 bits without it.
    run_spec = spec.replace(precision=spec.precision if plan.autocast else Precision.FP32)
    if plan.sharding is Sharding.REPLICATED:
        trainer = PlainTrainer(context=context, model=model, optimizer=make_adamw(model.parameters(), context.device),
                               workload=workload, spec=run_spec, scaler=scaler_for(run_spec, context.device))
        step, elements = (lambda batches: trainer.train_step(batches)), sum(p.numel() for p in model.parameters())
    else:
        shard = ShardStep(model, plan, context.rank, layout.data_parallel, context.device)

        def step(batches):
            accumulate(model, workload.loss, batches, run_spec, context.device)
            shard.step()

        elements = shard.elements
    timer = StepTimer(context.device)
    for index in range(1 + spec.timed_steps):      # one untimed warm-up step
        data_step = spec.warmup_steps + max(0, index - 1)
        micro_batches = [workload.batch(spec.seed, data_step, strategy.sample_indices(spec, context, micro),
                                        context.device) for micro in range(layout.micro_batches)]
        barrier()
        with timer.measure(record=index >= 1):
            step(micro_batches)
    return CompletedPass(times_s=timer.seconds, stalled=timer.stalled, optimizer_elements=elements)
