"""An asynchronous parameter server, started by torchrun: Downpour SGD's scheme (Dean et al. 2012, "Large Scale
Distributed Deep Networks", NIPS), on the same shards and messages as the synchronous `ps`
(harness.strategies.parameter_server) with dedicated servers.

Each worker runs forward and backward over its own micro-batches, pushes shard s of its gradient to server s and
pulls shard s back, without waiting for any other worker. Each server takes gradients in the order they arrive
(`recv` from any worker), runs AdamW on its shard with that one worker's gradient, and sends the updated shard back
to that worker alone. So every worker's push is an optimizer step of its own: W per step of the workers, not one.

What cannot be identical, and what is recorded instead:
- the arithmetic: an update applies one worker's gradient, computed on parameters other workers have since
  moved. Each applied update's *staleness* is recorded: how many updates its server applied between the worker's
  last pull and this gradient's arrival (0 for every update of a synchronous server). Parity says
  `not comparable: asynchronous` with the final loss against the plain loop's after the same samples, never
  `match` (harness.derive.parity).
- the step: a worker does not meet the others before a step (`barrier` meets once, before the first), so its
  steps are its own; the row's step time is the one at which all workers together deliver a global batch
  (`combined_step_times`), and samples per second are all workers' together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from harness.spec import DeviceKind, RunSpec
from harness.strategies.base import MicroBatch, Option, accumulate
from harness.strategies.parameter_server import (DEDICATED, GRADIENT_TAG, PARAMETER_TAG, ParameterServer,
                                                 ParameterServerTrainer)

ASYNCHRONOUS = "asynchronous"


@dataclass
class AsyncParameterServerTrainer(ParameterServerTrainer):
    applied: int = 0                                         # updates this server applied to its shard
    pulled_at: dict[int, int] = field(default_factory=dict)  # worker -> `applied` when it last received the shard
    staleness: list[int] = field(default_factory=list)       # of each applied update, in order
    _met: bool = False

    # The probe's norms are collectives every rank joins inside a step; an asynchronous step has no point where
    # every worker's gradient is reduced, and nothing of the plain loop's to hold them against.
    reaches_gradients_ready = False
    norms_unavailable_because = ("asynchronous updates: no step has one reduced gradient (each worker's gradient "
                                 "is its own update)")

    def barrier(self) -> None:
        """Every rank meets once, before the first step; after that no worker waits for another."""
        if not self._met:
            super().barrier()
            self._met = True

    def train_step(self, micro_batches: Sequence[MicroBatch], gradients_ready=None) -> torch.Tensor:
        if self._is_worker:
            return self._push_and_pull(micro_batches)
        pending = self.serve()
        for work in pending:
            work.wait()
        return torch.zeros((), device=self.context.device)

    def _push_and_pull(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        loss = accumulate(self.model, self.workload.loss, micro_batches, self.spec, self.context.device,
                          multipliers=self.loss_multipliers)
        gradient = torch.cat([p.grad.reshape(-1) for p in self._parameters()])
        pushed = [dist.isend(gradient[start:stop].contiguous(), dst=server, tag=GRADIENT_TAG)
                  for (start, stop), server in zip(self.bounds, self.roles.servers)]
        self._receive_parameters()
        for work in pushed:
            work.wait()
        self.model.zero_grad(set_to_none=True)
        return loss

    def serve(self) -> list[dist.Work]:
        """One step of a server: W gradients, whichever workers they come from, each applied on arrival and
        answered with the updated shard. Returns the replies still in flight."""
        pending = []
        for _ in self.roles.workers:
            worker, gradient = self._next_gradient()
            pending.append(self._apply(worker, gradient))
        return pending

    def _next_gradient(self) -> tuple[int, torch.Tensor]:
        start, stop = self.bounds[self.roles.shard_of(self._rank)]
        buffer = torch.empty(stop - start, device=self.context.device)
        worker = dist.recv(buffer, src=None, tag=GRADIENT_TAG)      # from whichever worker is first
        return worker, buffer

    def _apply(self, worker: int, gradient: torch.Tensor) -> dist.Work:
        self.staleness.append(self.applied - self.pulled_at.get(worker, 0))
        self.shard.grad = gradient
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.applied += 1
        self.pulled_at[worker] = self.applied
        # A copy: the next update changes the shard in place while this reply may still be in flight.
        return dist.isend(self.shard.detach().clone(), dst=worker, tag=PARAMETER_TAG)

    def rank_figures(self) -> dict:
        if self.shard is None:
            return {}
        return {"updates_applied": self.applied, "staleness": list(self.staleness)}

    def combined_step_times(self, times_by_rank: list[list[float]]) -> list[float]:
        """Step k's time as all workers together deliver it: they each run their share of the global batch at
        their own pace, so together they deliver a global batch in 1 / mean_w(1 / t_w,k), the harmonic mean of
        their k-th steps (the servers' steps are not the workers': they serve whoever arrives). This is the
        workers' rates added up, what an asynchronous job whose workers never wait runs at; a run of a fixed
        number of steps a worker ends with its slowest worker, whose wall clock is slower where the workers'
        speeds differ (one worker slowed x3 of 2: a global batch every 1.5 t here, every 3 t by that clock)."""
        workers = [times_by_rank[rank] for rank in self.roles.workers]
        return [len(steps) / sum(1.0 / t for t in steps) for steps in zip(*workers)]


class AsyncParameterServer(ParameterServer):
    name = "ps-async"
    description = "asynchronous parameter server (Downpour SGD) on torch.distributed send/recv (torchrun)"
    options = {
        "servers": Option(1, "dedicated server ranks, the last of the launch", minimum=1),
        **{name: option for name, option in ParameterServer.options.items() if name not in ("servers", "placement")},
    }
    trainer_class = AsyncParameterServerTrainer
    # Its servers are always ranks of their own: the generic matrices launch them beside the workers
    # (harness.matrix.Cells.servers_beside), so that its workers are the world size the others run.
    servers_beside_workers = True

    def resolve_options(self, given):
        """Its servers are always dedicated: an asynchronous colocated server would serve while it computes."""
        return {**super().resolve_options(given), "placement": DEDICATED}

    def layout_refusal(self, spec: RunSpec) -> str | None:
        if spec.device is DeviceKind.CUDA:
            # NCCL, torchrun's backend where every rank has a GPU, has no receive from any source.
            return ("ps-async's servers receive from whichever worker is first (torch.distributed.recv with no "
                    "source), which gloo and MPI offer and NCCL does not: not run on GPUs")
        return super().layout_refusal(spec)

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return ("a dedicated server steps the optimizer and a worker runs forward and backward: no one rank's work "
                "without communication is the step's")

    def wrap(self, spec, context, workload, layers):
        trainer = super().wrap(spec, context, workload, layers)
        trainer.config["updates"] = ASYNCHRONOUS
        return trainer
