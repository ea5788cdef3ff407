"""Horovod all-reduce data parallelism, started by `horovodrun` (gloo on CPU, NCCL on GPU).

As Horovod's own examples train: the common optimizer wrapped in `hvd.DistributedOptimizer` with the
model's named parameters, rank 0's parameters and buffers broadcast before the first step, and gradient
averaging (`op=hvd.Average`). Accumulation uses `backward_passes_per_step`, which delays the all-reduce
to the last micro-batch; it does not rescale gradients, so each micro-batch loss is divided by their
count, as for every other strategy. Tensor fusion threshold and cycle time are horovodrun flags
(Horovod >= 0.21 defaults: 128 MiB, 1 ms), recorded in the row with the library's build flags.

Unlike those examples, the optimizer state is not broadcast. It is fresh, so empty and equal on every
rank, and `hvd.broadcast_optimizer_state` fills an empty state by calling `step()` with zero gradients
(horovod/torch/functions.py, 0.28.1). With the examples' plain SGD that step changes nothing; with
AdamW's decoupled weight decay it scales every initial weight by (1 - lr * wd) before training starts,
which put Horovod's ResNet-20 losses 3.6e-4 off the plain loop's within three steps where every other
strategy matched it bit for bit at one rank. Horovod's maintainers describe the call as being for
restoring from a checkpoint (horovod/horovod#936).
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.derive.comm import Collective
from harness.environment import horovod_build_flags
from harness.rank.memory_model import torch_model_state_tensors
from harness.spec import RunSpec, SpecError
from harness.strategies.base import (ExpectedCollective, ExpectedTraffic, MicroBatch, Option, RankContext, Strategy,
                                     Trainer, accumulate, apply_update, make_adamw, optimizer_description, place_rank,
                                     recipe_of, replicated_gradients, replicated_parameters, unwrapped_parameter_names)
from harness.strategies.loss_scaling import scaler_for
from harness.strategies.state_checkpoint import CHECKPOINT, OPTION_NAME as CHECKPOINT_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME, blocks_as_run
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME
from workloads import Workload


@dataclass
class HorovodTrainer(Trainer):
    model: nn.Module | None = None
    optimizer: Any = None
    workload: Workload | None = None
    spec: RunSpec | None = None
    hvd: Any = None
    scaler: torch.amp.GradScaler | None = None      # fp16's (harness.strategies.loss_scaling)

    def train_step(self, micro_batches: list[MicroBatch], gradients_ready=None) -> torch.Tensor:
        loss = accumulate(self.model, self.workload.loss, micro_batches, self.spec, self.context.device,
                          multipliers=self.loss_multipliers, scaler=self.scaler)
        if self.scaler is not None:
            # Horovod's AMP recipe (examples/pytorch/pytorch_mnist.py): wait for the all-reduces, unscale the
            # averaged gradients, then let the scaler step (or skip) without synchronising again.
            self.optimizer.synchronize()
            self.scaler.unscale_(self.optimizer)
            if gradients_ready is not None:
                gradients_ready()
            with self.optimizer.skip_synchronize():
                self.step_outcome = apply_update(self.optimizer, self.scaler)
        elif gradients_ready is None:
            self.optimizer.step()      # waits for the outstanding all-reduces, then updates
        else:
            # Horovod's documented split (as for gradient clipping): wait for the all-reduces, then update.
            self.optimizer.synchronize()
            gradients_ready()
            with self.optimizer.skip_synchronize():
                self.optimizer.step()
        self.optimizer.zero_grad()     # Horovod's takes no arguments; torch's default sets grads to None
        return loss

    def model_state_tensors(self):
        return torch_model_state_tensors(self.model, self.optimizer,
                                         note="Horovod's fusion buffer is a communication buffer in its C++ "
                                              "core, not a model state, and is not counted")

    # Whole replicas: the norms need no collective (torch.distributed is not started under Horovod).
    def local_parameters(self):
        return replicated_parameters(self.model)

    def local_gradients(self):
        return replicated_gradients(self.model)     # synchronize() wrote the averaged gradients back

    def parameter_names(self):
        return unwrapped_parameter_names(self.model)

    def global_losses(self, local_losses: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(local_losses, op=self.hvd.Average, name="parbench.losses")

    def gather(self, value: Any) -> list[Any]:
        return self.hvd.allgather_object(value, name="parbench.gather")

    def barrier(self) -> None:
        if self.context.world_size > 1:
            self.hvd.barrier()

    def close(self) -> None:
        self.hvd.shutdown()


class Horovod(Strategy):
    name = "horovod"
    launcher = "horovodrun"
    checkpoint_method = "horovod rank 0"
    description = "Horovod DistributedOptimizer all-reduce (horovodrun)"
    comm_interception = "Horovod's all-reduce entry points (and torch.distributed, unused by Horovod)"
    requires = ("horovod.torch",)
    options = {
        "fusion_threshold_mb": Option(128, "tensor fusion buffer in MiB (horovodrun --fusion-threshold-mb)",
                                      minimum=0),
        "cycle_time_ms": Option(1.0, "background cycle time in ms (horovodrun --cycle-time-ms)", minimum=0),
        OPTION_NAME: ACTIVATION_CHECKPOINTING, CHECKPOINT_NAME: CHECKPOINT, ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD,
        COMPILE_NAME: COMPILE,
    }

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        # One all-reduce of every gradient per step (in fusion buffers): backward_passes_per_step holds
        # the reduction back to the last micro-batch.
        return ExpectedTraffic(collectives=(ExpectedCollective(collective=Collective.ALL_REDUCE,
                                                               size_bytes=traffic.gradients_reduced, calls=1,
                                                               ranks=data_parallel),))

    def working_memory_bytes(self, rank, recipe, options):
        """The tensor fusion buffer (Horovod's docs, "Tensor Fusion": HOROVOD_FUSION_THRESHOLD, here
        --fusion-threshold-mb), allocated once on the device beside the gradients; none with fusion off."""
        threshold = float(options["fusion_threshold_mb"]) * 2 ** 20
        return {"buckets": threshold} if threshold > 0 else {}

    def wire_calls(self, *, collective, counted_calls, bytes_per_step, backward_s, options):
        """Tensor fusion (Horovod's docs, "Tensor Fusion"; horovodrun --cycle-time-ms, --fusion-threshold-mb):
        every cycle the background thread packs the tensors submitted since the last one into fusion buffers
        of up to the threshold and all-reduces each buffer once. The counter sees one call per gradient
        tensor; the wire sees one per cycle in which gradients arrived, and no fewer than the bytes need
        buffers: min(calls, max(ceil(backward / cycle), ceil(bytes / threshold))). Gradients arrive over the
        last micro-batch's backward (backward_passes_per_step holds the rest back). It takes the arrivals as
        spread evenly over that backward; a threshold or cycle time of 0 turns fusion off."""
        threshold = float(options["fusion_threshold_mb"]) * 2 ** 20
        cycle = float(options["cycle_time_ms"]) * 1e-3
        if collective != Collective.ALL_REDUCE or threshold <= 0 or cycle <= 0 or counted_calls <= 1:
            return counted_calls
        buffers = max(math.ceil(backward_s / cycle), math.ceil(bytes_per_step / threshold), 1)
        return float(min(counted_calls, buffers))

    def validate(self, spec: RunSpec) -> None:
        from harness.launch.launcher.horovodrun import HOROVOD_DEFAULTS   # lazily: the launchers import the registry
        from harness.strategies.state_checkpoint import plan_of

        plan = plan_of(spec)
        options = self.resolved(spec)
        if plan is not None and plan.kill_step is not None and all(
                float(options[name]) != default for name, default in HOROVOD_DEFAULTS.items()):
            raise SpecError(f"option checkpoint={plan.value} runs Horovod Elastic, whose hvd.init() after a lost rank "
                            "dies of SIGSEGV (Horovod 0.28.1) where fusion_threshold_mb and cycle_time_ms are both "
                            "set: keep one at Horovod's own value (128, 1.0)")

    def instrument(self, counter) -> None:
        counter.install_torch()
        counter.install_horovod()

    def start(self, spec: RunSpec) -> RankContext:
        import horovod.torch as hvd

        check_own_host_name()
        hvd.init()
        device, _, shared = place_rank(spec.device, hvd.local_rank(), hvd.local_size())
        backend = "nccl" if device.type == "cuda" and hvd.nccl_built() else "gloo"
        return RankContext(rank=hvd.rank(), world_size=hvd.size(), local_rank=hvd.local_rank(),
                           local_world_size=hvd.local_size(), device=device, backend=backend,
                           shared_device=shared)

    def wrap(self, spec, context, workload, layers):
        import horovod.torch as hvd

        model = nn.Sequential(*blocks_as_run(layers, self.resolved(spec))).to(context.device)
        optimizer = make_adamw(model.parameters(), context.device)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # not the optimizer: see the docstring
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             op=hvd.Average, backward_passes_per_step=self.layout(spec).micro_batches)
        return HorovodTrainer(context=context, model=model, optimizer=optimizer, workload=workload, spec=spec,
                              hvd=hvd, precision_recipe=recipe_of(spec), scaler=scaler_for(spec, context.device),
                              config={**self.resolved(spec), "op": "Average",
                                      "broadcast_from_rank_0": "parameters and buffers",
                                      "backward_passes_per_step": self.layout(spec).micro_batches,
                                      "horovod_build": horovod_build_flags(hvd),
                                      **optimizer_description(context.device)})


def check_own_host_name() -> None:
    """Stop in one line where this host's own name does not resolve: Horovod 0.28.1's Gloo initialisation
    dies of SIGSEGV there (measured in a network and UTS namespace with only loopback, as in `docker run
    --network none --hostname X`), leaving a row that says only "exit code 139"."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except (socket.gaierror, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise RuntimeError(f"this host's name {name!r} does not resolve ({reason}), and Horovod's Gloo start-up "
                           "crashes without it: add it to /etc/hosts (docker run --add-host "
                           f"{name}:127.0.0.1, or --hostname localhost)") from None
