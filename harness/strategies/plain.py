"""The plain single-device training loop with no wrapper: the reference every strategy is held against.

Its losses are the parity reference, and its speed at world size 1 is the yardstick for each wrapper's
own overhead (a strategy at world size 1 should cost almost nothing over this loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from harness.rank.memory_model import torch_model_state_tensors
from harness.spec import RunSpec, SpecError
from harness.strategies.base import (ExpectedTraffic, MicroBatch, RankContext, Strategy, Trainer, accumulate,
                                     apply_update, make_adamw, optimizer_description, place_rank, recipe_of,
                                     replicated_gradients, replicated_parameters, unwrapped_parameter_names)
from harness.strategies.loss_scaling import scaler_for
from harness.strategies.state_checkpoint import CHECKPOINT, OPTION_NAME as CHECKPOINT_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME, blocks_as_run
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME
from workloads import Workload


@dataclass
class PlainTrainer(Trainer):
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    workload: Workload | None = None
    spec: RunSpec | None = None
    scaler: torch.amp.GradScaler | None = None      # fp16's (harness.strategies.loss_scaling)

    def train_step(self, micro_batches: list[MicroBatch], gradients_ready=None) -> torch.Tensor:
        loss = accumulate(self.model, self.workload.loss, micro_batches, self.spec, self.context.device,
                          multipliers=self.loss_multipliers, scaler=self.scaler)
        self.finish_gradients()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)    # the reduced gradients are read and stepped unscaled
        if gradients_ready is not None:
            gradients_ready()
        self.step_outcome = apply_update(self.optimizer, self.scaler)
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def finish_gradients(self) -> None:
        """Between backward and the optimizer step: nothing in the plain loop (a tensor-parallel trainer sums the
        gradients its sequence parallelism left partial)."""

    def model_state_tensors(self):
        return torch_model_state_tensors(self.model, self.optimizer)

    def local_parameters(self):
        return replicated_parameters(self.model)

    def local_gradients(self):
        return replicated_gradients(self.model)

    def parameter_names(self):
        return unwrapped_parameter_names(self.model)


def plain_trainer(spec: RunSpec, context: RankContext, workload: Workload, model: nn.Module) -> PlainTrainer:
    """An unwrapped model on this rank's device with the common optimizer (also the compute-only baseline)."""
    model = model.to(context.device)
    return PlainTrainer(context=context, model=model, optimizer=make_adamw(model.parameters(), context.device),
                        workload=workload, spec=spec, precision_recipe=recipe_of(spec),
                        scaler=scaler_for(spec, context.device),
                        config=optimizer_description(context.device))


class Plain(Strategy):
    name = "plain"
    launcher = "python"
    checkpoint_method = "torch.save"
    description = "single device, no wrapper: the reference loop"
    comm_interception = "none: one process, no communication"
    options = {OPTION_NAME: ACTIVATION_CHECKPOINTING, CHECKPOINT_NAME: CHECKPOINT,
               ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD, COMPILE_NAME: COMPILE}

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return "the plain loop has no communication to expose"

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        return ExpectedTraffic()          # one process: nothing to exchange

    def gradient_reduce_dtypes(self, spec, model):
        return ()

    def validate(self, spec: RunSpec) -> None:
        if spec.world_size != 1:
            raise SpecError(f"strategy {self.name} runs on one device: world_size must be 1, got {spec.world_size}")

    def start(self, spec: RunSpec) -> RankContext:
        device, _, _ = place_rank(spec.device, 0, 1)
        return RankContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device,
                           backend="none", shared_device=False)

    def wrap(self, spec, context, workload, layers):
        return plain_trainer(spec, context, workload, nn.Sequential(*blocks_as_run(layers, self.resolved(spec))))
