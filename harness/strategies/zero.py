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

from harness.derive.memory import ModelStatePlan, zero_plan
from harness.memory_model import ModelStateTensors, deepspeed_estimate, optimizer_state_tensors
from harness.spec import RunSpec
from harness.strategies.base import (Launcher, MicroBatch, Option, PrecisionRecipe, Strategy, Trainer, make_adamw,
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

    def model_state_tensors(self) -> ModelStateTensors:
        return deepspeed_model_state_tensors(self.engine)

    def parameters_kept_whole(self) -> int:
        # Stage 3 keeps parameters below stage3_param_persistence_threshold gathered on every rank, beside
        # their shard (ds_persist, deepspeed/runtime/zero/parameter_offload.py).
        return sum(p.ds_numel for p in self.engine.module.parameters() if getattr(p, "ds_persist", False))


def deepspeed_model_state_tensors(engine: Any) -> ModelStateTensors:
    """The storages a DeepSpeed ZeRO optimizer (0.19) keeps model states in.

    Weights: the module's parameters, which stage 1/2 turn into views of one flat buffer
    (`bit16_groups_flat`) and stage 3 empties, keeping each rank's shard in `ds_tensor` (views of
    `fp16_partitioned_groups_flat`) and persistent parameters whole. Gradients: any .grad still on a
    parameter, and the reduced gradients of this rank's partition (`averaged_gradients`; stage 3's are views
    of `grad_partitions_flat_buffer`). Optimizer: the fp32 master partition (`single_partition_of_fp32_groups`
    in stages 1/2, `fp32_partitioned_groups_flat` in stage 3) and the wrapped torch AdamW's state."""
    optimizer = engine.optimizer
    parameters = list(engine.module.parameters())
    weights = parameters + [p.ds_tensor for p in parameters if getattr(p, "ds_tensor", None) is not None]
    gradients = [p.grad for p in parameters if p.grad is not None]
    for partition in (getattr(optimizer, "averaged_gradients", None) or {}).values():
        gradients.extend(t for t in (partition or []) if torch.is_tensor(t))
    masters = (getattr(optimizer, "single_partition_of_fp32_groups", None)
               or getattr(optimizer, "fp32_partitioned_groups_flat", None) or [])
    return ModelStateTensors(
        weights=weights, gradients=gradients,
        optimizer=list(masters) + optimizer_state_tensors(optimizer.optimizer),
        note="DeepSpeed's reduction buckets (ipg buffers) are communication buffers, not model states, and are "
             "not counted")


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

    def model_state_plan(self, data_parallel, recipe, options) -> ModelStatePlan:
        """The ZeRO paper's partitioning for this stage (sec. 5.1). In every recipe DeepSpeed's ZeRO
        optimizer keeps an fp32 master copy of its partition beside the model's weights, even when those
        are fp32 already (deepspeed/runtime/zero/stage_1_and_2.py, `single_partition_of_fp32_groups`, a
        clone; stage3.py, `fp32_partitioned_groups_flat`), so the optimizer state is the paper's K = 12
        (master weights, momentum, variance) and weights and gradients keep the model's 4 bytes, or 2 in
        DeepSpeed's bf16 recipe. (Stage 3 means to skip the copy for fp32 partitions on `self.device`, but
        compares a torch.device with a device-name string, which never match in 0.19.8; the census of a
        CPU run finds the copy.)"""
        weights = 2 if recipe is PrecisionRecipe.DEEPSPEED_BF16 else 4
        return zero_plan(self.stage, data_parallel, weights, weights, 12,
                         basis=f"{recipe.value}: DeepSpeed ZeRO-{self.stage}, {weights}-byte weights and gradients, "
                               f"fp32 master partition + AdamW moments (K = 12)")

    def deepspeed_estimate_bytes(self, parameters, largest_module_parameters, gpus_per_node, nodes, options):
        estimate = deepspeed_estimate(self.stage, parameters, largest_module_parameters, gpus_per_node, nodes=nodes,
                                      offload_optimizer=options.get("offload_optimizer") == "cpu",
                                      offload_param=options.get("offload_param") == "cpu")
        return estimate["gpu_bytes"] if estimate else None

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
