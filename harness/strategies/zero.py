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
from harness.strategies.deepspeed_common import PRECISION_OPTION, base_config, precision_config, start_deepspeed
from workloads import Workload


@dataclass
class DeepSpeedTrainer(Trainer):
    engine: Any = None
    workload: Workload | None = None

    def train_step(self, micro_batches: list[MicroBatch], gradients_ready=None) -> torch.Tensor:
        # The engine divides each loss by gradient_accumulation_steps in backward and steps the
        # optimizer at the accumulation boundary (the last micro-batch). Its backward at the boundary
        # finishes the gradient reduction (reduce_gradients / the stage-3 reduce-scatter epilogue).
        total = torch.zeros((), device=self.context.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            loss = self.workload.loss(self.engine(inputs), targets)
            self.engine.backward(loss)
            if gradients_ready is not None and index == len(micro_batches) - 1:
                gradients_ready()
            self.engine.step()
            total += loss.detach().float()
        return total / len(micro_batches)


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
                                config={"deepspeed_config": resolved, **optimizer_description(context.device)})
