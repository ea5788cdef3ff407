"""DeepSpeed ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020) as three strategies.

Stage 1 shards optimizer states, stage 2 also gradients, stage 3 also parameters. The options default to
DeepSpeed's own defaults (DeepSpeedZeroConfig in deepspeed/runtime/zero/config.py, 0.19): overlap_comm
on for stage 3 and off for stages 1-2, contiguous gradients on, 5e8-element reduce and all-gather buckets,
5e7-element stage-3 prefetch bucket, 1e5-element persistence threshold, no offload. The resolved config is
recorded in every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.spec import RunSpec
from harness.strategies.base import (Launcher, MicroBatch, Option, Strategy, Trainer, make_adamw,
                                     optimizer_description)
from harness.strategies.deepspeed_common import (PRECISION_OPTION, base_config, precision_config, start_deepspeed,
                                                 throughput_timer_state)
from workloads import Workload


@dataclass
class DeepSpeedTrainer(Trainer):
    engine: Any = None
    workload: Workload | None = None

    # DeepSpeed's own norm of the reduced gradients, which it computes in the optimizer step (below).
    gradient_norm_after_step = True

    def train_step(self, micro_batches: list[MicroBatch], gradients_ready=None) -> torch.Tensor:
        # The engine divides each loss by gradient_accumulation_steps in backward and steps the
        # optimizer at the accumulation boundary (the last micro-batch). Its backward at the boundary
        # finishes the gradient reduction (reduce_gradients / the stage-3 reduce-scatter epilogue).
        total = torch.zeros((), device=self.context.device)
        multipliers = self.loss_multipliers
        for index, (inputs, targets) in enumerate(micro_batches):
            loss = self.workload.loss(self.engine(inputs), targets)
            self.engine.backward(loss if multipliers is None else loss * multipliers[index])
            if gradients_ready is not None and index == len(micro_batches) - 1:
                gradients_ready()
            self.engine.step()
            total += loss.detach().float()
        return total / len(micro_batches)

    def gradient_norm(self) -> float:
        # The engine's norm of the step just taken (DeepSpeed 0.19.8, engine._take_model_step copies the
        # optimizer's `_global_grad_norm` after optimizer.step()). Both ZeRO optimizers compute it inside
        # step() before any weight changes: stage 1/2 (stage_1_and_2.py, step -> scaled_global_norm ->
        # get_grad_norm_direct) over this rank's slices of `averaged_gradients`, padding skipped, squares
        # all-reduced over the data-parallel group; stage 3 (stage3.py, step -> _get_norm_groups) over the
        # reduce-scattered partitions, likewise. The gradients are those of losses divided by
        # gradient_accumulation_steps and averaged over the data-parallel ranks, as everywhere else here;
        # the norm is divided by the loss scale (1: no fp16 here) and taken before unscale_and_clip_grads,
        # which would clip only where gradient_clipping > 0 (it is 0).
        return float(self.engine.get_global_grad_norm())

    def local_parameters(self):
        module = self.engine.module
        if self.engine.zero_optimization_stage() < 3:      # stages 1-2 keep every parameter whole on every rank
            return [p for p in module.parameters() if p.requires_grad], False
        # Stage 3 leaves an empty placeholder in the module; each rank's partition is `ds_tensor`
        # (zero-padded at the end of the last partition, which adds nothing to a norm).
        return [p.ds_tensor for p in module.parameters() if p.requires_grad], True


class ZeRO(Strategy):
    launcher = Launcher.TORCHRUN
    requires = ("deepspeed",)
    multi_node_launcher = Launcher.DEEPSPEED

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"zero{stage}"
        self.description = f"DeepSpeed ZeRO stage {stage} (torchrun)"
        options = {
            "overlap_comm": Option(None, "overlap gradient reduction with backward; default: DeepSpeed's "
                                   "(on for stage 3 only)", choices=(None, True, False)),
            "contiguous_gradients": Option(True, "copy gradients into one contiguous buffer as produced"),
            "reduce_bucket_size": Option(500_000_000, "elements reduced at a time", minimum=1),
            "offload_optimizer": Option("none", "keep optimizer states (and step) on the CPU",
                                        choices=("none", "cpu")),
            "precision_recipe": PRECISION_OPTION,
        }
        if stage < 3:
            options["allgather_bucket_size"] = Option(500_000_000, "elements all-gathered at a time", minimum=1)
        else:
            options["prefetch_bucket_size"] = Option(50_000_000, "elements of parameters prefetched", minimum=0)
            options["param_persistence_threshold"] = Option(100_000, "parameters smaller than this stay whole "
                                                            "on every rank", minimum=0)
            options["offload_param"] = Option("none", "keep sharded parameters on the CPU", choices=("none", "cpu"))
        self.options = options

    def start(self, spec):
        return start_deepspeed(spec)

    def zero_config(self, spec: RunSpec) -> dict[str, Any]:
        o = spec.resolved_options
        config: dict[str, Any] = {"stage": self.stage, "contiguous_gradients": o["contiguous_gradients"],
                                  "reduce_bucket_size": o["reduce_bucket_size"]}
        if o["overlap_comm"] is not None:
            config["overlap_comm"] = o["overlap_comm"]
        if o["offload_optimizer"] != "none":
            config["offload_optimizer"] = {"device": o["offload_optimizer"]}
        if self.stage < 3:
            config["allgather_bucket_size"] = o["allgather_bucket_size"]
        else:
            config["stage3_prefetch_bucket_size"] = o["prefetch_bucket_size"]
            config["stage3_param_persistence_threshold"] = o["param_persistence_threshold"]
            if o["offload_param"] != "none":
                config["offload_param"] = {"device": o["offload_param"]}
        return config

    def wrap(self, spec, context, workload, layers):
        import deepspeed

        precision, recipe = precision_config(spec)
        config = {**base_config(spec, spec.layout.micro_batches), **precision,
                  "zero_optimization": self.zero_config(spec)}
        model = nn.Sequential(*layers).to(context.device)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_adamw(model.parameters(), context.device),
                                               config=config)
        zero = engine._config.zero_config
        resolved = {**config, "zero_optimization": {**config["zero_optimization"],
                                                    "overlap_comm": zero.overlap_comm}}
        return DeepSpeedTrainer(context=context, engine=engine, workload=workload, precision_recipe=recipe,
                                config={"deepspeed_config": resolved, **throughput_timer_state(engine),
                                        **optimizer_description(context.device)})
