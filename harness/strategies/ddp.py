"""PyTorch DistributedDataParallel, started by torchrun, configured as a tuned DDP job would be.

Gradients are all-reduced by DDP's Python `allreduce_hook` (the same averaging all-reduce as its built-in
C++ path, one call per bucket) so that the harness's collective counter sees each bucket.

Defaults: gradients as views into the communication buckets (no copy per step), a static graph where it is
valid (our models use every parameter every step; DDP's reducer asserts when `no_sync` accumulation meets
a static graph, so with several micro-batches per step the graph is left dynamic), 25 MB buckets (DDP's
default), and `no_sync` on all but the last micro-batch of an accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from harness.derive.comm import Collective
from harness.derive.memory import ModelStatePlan, ShardedState
from harness.rank.memory_model import torch_model_state_tensors
from harness.spec import RunSpec
from harness.strategies.base import (ADAMW_STATE_BYTES, ExpectedCollective, ExpectedTraffic, MicroBatch, Option,
                                     Strategy, Trainer, accumulate, apply_update, make_adamw, optimizer_description,
                                     recipe_of, replicated_gradients, replicated_parameters, torchrun_context,
                                     unwrapped_parameter_names)
from harness.strategies.loss_scaling import scaler_for
from harness.strategies.state_checkpoint import CHECKPOINT, OPTION_NAME as CHECKPOINT_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME, blocks_as_run
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME
from workloads import Workload


@dataclass
class DDPTrainer(Trainer):
    model: DistributedDataParallel | None = None
    optimizer: torch.optim.Optimizer | None = None
    workload: Workload | None = None
    spec: RunSpec | None = None
    scaler: torch.amp.GradScaler | None = None      # fp16's (harness.strategies.loss_scaling)

    def train_step(self, micro_batches: list[MicroBatch], gradients_ready=None) -> torch.Tensor:
        loss = accumulate(self.model, self.workload.loss, micro_batches, self.spec, self.context.device,
                          no_sync=self.model.no_sync, multipliers=self.loss_multipliers, scaler=self.scaler)
        if self.scaler is not None:         # every rank unscales the same averaged gradients: the same verdict
            self.scaler.unscale_(self.optimizer)
        if gradients_ready is not None:     # DDP's last backward has waited for every bucket's all-reduce
            gradients_ready()
        self.step_outcome = apply_update(self.optimizer, self.scaler)
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def model_state_tensors(self):
        note = ("" if self.model.gradient_as_bucket_view else
                "DDP's communication buckets, a second copy of the gradients, live in its C++ reducer, out of "
                "the census's reach")
        return torch_model_state_tensors(self.model, self.optimizer, note=note)

    def local_parameters(self):
        return replicated_parameters(self.model)

    def local_gradients(self):
        return replicated_gradients(self.model)     # every rank holds the averaged gradients whole

    def parameter_names(self):
        return unwrapped_parameter_names(self.model)


class DDP(Strategy):
    name = "ddp"
    launcher = "torchrun"
    checkpoint_method = "dcp"
    description = "torch DistributedDataParallel (torchrun)"
    comm_interception = "torch.distributed, through DDP's allreduce_hook (one call per bucket)"
    options = {
        "bucket_cap_mb": Option(25.0, "gradient bucket size in MiB", minimum=0.001),
        "gradient_as_bucket_view": Option(True, "gradients alias the all-reduce buckets (saves a copy)"),
        "static_graph": Option(None, "declare the graph static; default: when a step has one micro-batch",
                               choices=(None, True, False)),
        "broadcast_buffers": Option(True, "broadcast BatchNorm buffers from rank 0 before each forward"),
        OPTION_NAME: ACTIVATION_CHECKPOINTING, CHECKPOINT_NAME: CHECKPOINT, ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD,
        COMPILE_NAME: COMPILE,
    }

    def start(self, spec):
        return torchrun_context(spec.device)

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        # One all-reduce of every gradient per step: no_sync keeps the other micro-batches local.
        return ExpectedTraffic(collectives=(ExpectedCollective(collective=Collective.ALL_REDUCE,
                                                               size_bytes=traffic.gradients_reduced, calls=1,
                                                               ranks=data_parallel),))

    def working_memory_bytes(self, rank, recipe, options):
        """The reducer's buckets hold a copy of every gradient unless gradients are views of them
        (`gradient_as_bucket_view`, on by default here; torch/nn/parallel/distributed.py). With it, the buckets are
        the gradients, allocated when DDP wraps the model and alive through the step (on an H200 DDP's peak
        exceeded the plain loop's by 498,924,544 B on GPT-2 small, its 497,759,232 B of fp32 gradients, which the
        plain loop allocates only in backward: ../shared/gpu-h200, a3663fd), so nothing beyond the model states."""
        if options.get("gradient_as_bucket_view", True):
            return {}
        return {"buckets": rank.held * ADAMW_STATE_BYTES[recipe][1]}

    def model_state_plan(self, data_parallel, recipe, options) -> ModelStatePlan:
        plan = super().model_state_plan(data_parallel, recipe, options)
        if options["gradient_as_bucket_view"]:
            return plan
        # Without bucket views the reducer copies every gradient into its all-reduce buckets and keeps
        # them: "the saved memory size will be equal to the total gradients size" (DistributedDataParallel
        # docs, gradient_as_bucket_view).
        gradients = plan.gradients.bytes_per_parameter
        return ModelStatePlan(weights=plan.weights, gradients=ShardedState(bytes_per_parameter=2 * gradients),
                              optimizer=plan.optimizer,
                              basis=plan.basis + "; gradients twice: .grad and DDP's bucket copy")

    def wrap(self, spec, context, workload, layers):
        options = self.resolved(spec)
        if options["static_graph"] is None:
            options["static_graph"] = self.layout(spec).micro_batches == 1
        model = nn.Sequential(*blocks_as_run(layers, options)).to(context.device)
        ddp = DistributedDataParallel(
            model,
            device_ids=[context.device.index] if context.device.type == "cuda" else None,
            bucket_cap_mb=options["bucket_cap_mb"],
            gradient_as_bucket_view=options["gradient_as_bucket_view"],
            static_graph=options["static_graph"],
            broadcast_buffers=options["broadcast_buffers"],
        )
        ddp.register_comm_hook(state=None, hook=allreduce_hook)
        return DDPTrainer(context=context, model=ddp, optimizer=make_adamw(ddp.parameters(), context.device),
                          workload=workload, spec=spec, precision_recipe=recipe_of(spec),
                          scaler=scaler_for(spec, context.device),
                          config={**options, "comm_hook": "allreduce_hook",
                                  **optimizer_description(context.device)})
