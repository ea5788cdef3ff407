"""DeepSpeed pipeline parallelism: the workload's layer list cut into `stages`, balanced by parameters.

With world size W and S stages there are W/S pipeline replicas trained data-parallel. DeepSpeed's
topology puts the pipeline axis outermost (PipeDataParallelTopology: rank = stage * replicas + replica),
so a rank's data-parallel index is rank % replicas. Each optimizer step runs the micro-batches of the
rank's replica through DeepSpeed's 1F1B schedule (`train_batch`).

Weights shared between layers (GPT's tied embedding and head) become DeepSpeed `TiedLayerSpec`s, which
DeepSpeed builds on each stage that uses them and keeps equal by all-reducing their gradients; the copies
are then loaded with the reference layer's weights so every strategy starts from the same numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from harness.derive.memory import ModelSplit, ModelStatePlan, ShardedState
from harness.rank.memory_model import ModelStateTensors, optimizer_state_tensors
from harness.spec import DeviceKind, Layout, Precision, RunSpec, SpecError
from harness.strategies.base import (BLOCK_CLASS_NAMES, ExpectedCollective, ExpectedTraffic, MicroBatch, Option,
                                     PrecisionRecipe, Strategy, Trainer, half_dtype_names, make_adamw,
                                     optimizer_description)
from harness.strategies.state_checkpoint import CHECKPOINT, OPTION_NAME as CHECKPOINT_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME, interval_of
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME
from harness.strategies.deepspeed_common import (DEEPSPEED_RECIPES, PRECISION_OPTION, base_config, precision_config,
                                                 sixteen_bit_weights, start_deepspeed, throughput_timer_state)
from harness.strategies.loss_scaling import deepspeed_loss_scale, deepspeed_step_outcome
from workloads import get_workload


class PlantedLoss:
    """The workload's loss as the pipeline's last stage computes it inside `train_batch`, its gradient (not its
    value, which train_batch reports) multiplied by a planted fault's factor for the micro-batch
    (`Trainer.loss_multipliers`), as every other strategy multiplies the loss it backpropagates."""

    def __init__(self, loss: Any):
        self.loss = loss
        self.multipliers: list[float] | None = None
        self.calls = 0              # micro-batches seen this step: the last stage computes them in order

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss(outputs, targets)
        if self.multipliers is not None:
            loss = _ScaleGradient.apply(loss, self.multipliers[self.calls])
        self.calls += 1
        return loss


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor` (inf plants an overflow)."""

    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.clone()

    @staticmethod
    def backward(ctx, gradient):
        return gradient * ctx.factor, None


@dataclass
class PipelineTrainer(Trainer):
    engine: Any = None
    planted_loss: PlantedLoss | None = None
    loss_scaled: bool = False       # fp16: read what each step did under loss scaling (harness.strategies.loss_scaling)

    reaches_gradients_ready = False      # train_batch reduces and updates in one call
    norms_unavailable_because = (
        "DeepSpeed's pipeline reduces the gradients and updates the weights inside one train_batch call, "
        "with no point between them to read the gradients")

    def train_step(self, micro_batches: list[MicroBatch], gradients_ready=None) -> torch.Tensor:
        self.planted_loss.multipliers, self.planted_loss.calls = self.loss_multipliers, 0
        if self.loss_scaled:
            skipped, scale = self.engine.skipped_steps, deepspeed_loss_scale(self.engine)
        # train_batch returns the step's mean loss, already averaged over the replicas, on every stage.
        loss = self.engine.train_batch(data_iter=iter(micro_batches)).detach().float()
        if self.loss_scaled:
            self.step_outcome = deepspeed_step_outcome(self.engine, skipped, scale)
        return loss

    def model_state_tensors(self) -> ModelStateTensors:
        optimizer = self.engine.optimizer
        # DeepSpeed's bf16 recipe wraps the torch AdamW in its BF16_Optimizer, which keeps an fp32 master
        # partition per data-parallel rank (deepspeed/runtime/bf16_optimizer.py, fp32_groups_flat_partition).
        inner = getattr(optimizer, "optimizer", optimizer)
        masters = list(getattr(optimizer, "fp32_groups_flat_partition", None) or [])
        return ModelStateTensors(weights=list(self.engine.module.parameters()), gradients=None,
                                 optimizer=masters + optimizer_state_tensors(inner),
                                 note="read after train_batch, whose optimizer step has released the gradients")

    def torch_optimizer(self) -> torch.optim.Optimizer:
        # The client AdamW itself, or the one DeepSpeed's bf16 recipe wraps (as `model_state_tensors` reads it).
        optimizer = self.engine.optimizer
        return getattr(optimizer, "optimizer", optimizer)

    def parameters_held(self, whole_model: int) -> int:
        # This stage's layers, a tied weight's copy included: DeepSpeed builds the whole tied module (GPT's
        # token embedding, wpe with it) on every stage that uses it.
        return sum(p.numel() for p in self.engine.module.parameters())


class Pipeline(Strategy):
    name = "pipeline"
    launcher = "deepspeed"
    checkpoint_method = "deepspeed"
    description = "DeepSpeed pipeline parallelism, 1F1B schedule (DeepSpeed's launcher)"
    comm_interception = "torch.distributed collectives and point-to-point sends (DeepSpeed's p2p)"
    requires = ("deepspeed",)
    precision_recipes = DEEPSPEED_RECIPES
    options = {
        "stages": Option(2, "pipeline stages; world_size / stages replicas are data-parallel", minimum=1),
        "partition_method": Option("parameters", "how layers are balanced over stages",
                                   choices=("parameters", "uniform")),
        "precision_recipe": PRECISION_OPTION,
        OPTION_NAME: ACTIVATION_CHECKPOINTING, CHECKPOINT_NAME: CHECKPOINT, ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD,
        COMPILE_NAME: COMPILE,
    }
    cannot_compile_because = ("DeepSpeed runs the stages' layers inside train_batch's schedule, and its "
                              "PipelineModule.compile is not wired here")

    def skip_reason(self, spec: RunSpec, machine=None) -> str | None:
        if spec.precision is Precision.FP16 and spec.device is DeviceKind.CPU:
            # Measured (DeepSpeed 0.19.8, gloo, gpt-tiny at 2 stages): rank 0 failed with "Attempted step but
            # _scale is None".
            return ("fp16 on CPU is DeepSpeed's torch_autocast float16, whose GradScaler the pipeline steps on "
                    "every stage but scales the loss with only on the last (deepspeed/runtime/pipe/engine.py, "
                    "0.19.8), so the first stage fails; its fp16 section, which the pipeline supports, runs on GPUs")
        return super().skip_reason(spec, machine)

    def validate(self, spec: RunSpec) -> None:
        if self.resolved(spec)[ACTIVATION_OFFLOAD_NAME] != "none":
            raise SpecError("strategy pipeline cannot take activation_offload: DeepSpeed runs forward and backward "
                            "inside train_batch, where torch's save_on_cpu hook does not reach; use none")
        if interval_of(self.resolved(spec)) > 1:
            raise SpecError(f"pipeline takes {OPTION_NAME}=none or blocks: DeepSpeed's activation_checkpoint_interval "
                            "checkpoints runs of K layers as one, not one block in K")
        stages = self.resolved(spec)["stages"]
        layers = get_workload(spec.workload).layer_count
        if stages > layers:
            raise SpecError(f"pipeline stages={stages} exceeds the {layers} layers of {spec.workload}; "
                            f"allowed: 1..{layers}")
        if spec.world_size % stages:
            raise SpecError(f"world_size {spec.world_size} is not divisible by pipeline stages={stages}")
        replicas = spec.world_size // stages
        if spec.global_batch % (replicas * spec.micro_batch):
            raise SpecError(f"global_batch {spec.global_batch} must be divisible by pipeline replicas x "
                            f"micro_batch = {replicas} x {spec.micro_batch}")

    def layout(self, spec: RunSpec) -> Layout:
        stages = self.resolved(spec)["stages"]
        replicas = spec.world_size // stages
        per_replica = spec.global_batch // replicas
        return Layout(data_parallel=replicas, pipeline_stages=stages, per_replica_batch=per_replica,
                      micro_batches=per_replica // spec.micro_batch)

    def replica(self, spec, context) -> int:
        return context.rank % self.layout(spec).data_parallel

    def start(self, spec):
        return start_deepspeed(spec)

    def model_state_plan(self, data_parallel, recipe, options) -> ModelStatePlan:
        """Each stage keeps its own layers whole (ZeRO stage 0). In DeepSpeed's bf16 recipe the engine
        wraps the optimizer in its BF16_Optimizer: bf16 weights and gradients (gradient accumulation in the
        model's dtype unless data_types.grad_accum_dtype says otherwise, engine.get_data_types), and fp32
        master weights with the AdamW moments partitioned over the data-parallel replicas
        (deepspeed/runtime/bf16_optimizer.py, fp32_groups_flat_partition)."""
        if recipe is PrecisionRecipe.DEEPSPEED_FP16:
            # The fp16 section's FP16_Optimizer (deepspeed/runtime/fp16/fused_optimizer.py): fp16 weights and
            # gradients, fp32 master weights and the AdamW moments whole on every replica.
            return ModelStatePlan(weights=ShardedState(bytes_per_parameter=2),
                                  gradients=ShardedState(bytes_per_parameter=2),
                                  optimizer=ShardedState(bytes_per_parameter=12),
                                  basis=f"{recipe.value}: DeepSpeed FP16_Optimizer, fp16 weights and gradients, "
                                        "fp32 master weights + AdamW moments whole on every replica")
        if recipe is not PrecisionRecipe.DEEPSPEED_BF16:
            return super().model_state_plan(data_parallel, recipe, options)
        return ModelStatePlan(weights=ShardedState(bytes_per_parameter=2),
                              gradients=ShardedState(bytes_per_parameter=2),
                              optimizer=ShardedState(bytes_per_parameter=12, sharded_over=data_parallel),
                              basis=f"{recipe.value}: DeepSpeed BF16_Optimizer, bf16 weights and gradients, fp32 "
                                    f"master partition + AdamW moments over the data-parallel replicas")

    def usual_mixed_recipe(self):
        """DeepSpeed's bf16 section (its BF16_Optimizer), the recipe its users run."""
        return PrecisionRecipe.DEEPSPEED_BF16, {"precision_recipe": PrecisionRecipe.DEEPSPEED_BF16.value}

    def model_split(self, replicas, tensor_parallel, options) -> ModelSplit:
        """`replicas` pipelines of the `stages` option's stages, each stage holding its cut of the layers."""
        return ModelSplit(data_parallel=replicas, pipeline_stages=options["stages"])

    def across_replicas(self, options):
        return "ddp"            # each stage's gradients all-reduced once a step among its replicas (_exec_reduce_grads)

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return ("a stage's work has no communication-free equivalent: waiting on its neighbours is the "
                "schedule's bubble as much as communication")

    def gradient_reduce_dtypes(self, spec, model):
        """Without ZeRO the engine all-reduces gradients in its `communication_data_type`: bf16 or fp16 where
        the bf16 or fp16 section is on, else the gradients' fp32 (deepspeed/runtime/engine.py, 0.19.8; the
        torch_autocast section's 16-bit communication is ZeRO's alone)."""
        if sixteen_bit_weights(spec, self.resolved(spec)):
            return half_dtype_names(spec)
        return ("float32",)

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        return ExpectedTraffic(not_modelled_because=(
            "most of a pipeline's traffic is the activations and their gradients sent between stages, whose "
            "size depends on where the model is cut and on the micro-batch's shape, not on the parameters: "
            "expected from the layers (`expected_traffic`)"))

    def bubble_factor(self, options, micro_batches: int) -> float:
        """(K + S - 1) / K for K micro-batches through S stages: DeepSpeed's 1F1B schedule (TrainSchedule) runs
        K + S - 1 forward and backward slots on each stage, idle in S - 1 of them, the bubble GPipe has
        (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
        Megatron-LM", sec. 2.2.1: the bubble is (p - 1) / (m + p - 1) of the step)."""
        return (micro_batches + options["stages"] - 1) / micro_batches

    def _stages(self, spec: RunSpec, layers) -> tuple[list[int], list[int], list[int]]:
        """(DeepSpeed's boundaries, each stage's parameters, each layer's stage): a tied layer's copy on another
        stage holds its owner's whole module there (TiedLayerSpec builds it), on the owner's stage it is the
        owner's."""
        from harness.strategies.pipeline_traffic import stage_boundaries

        options, workload = self.resolved(spec), get_workload(spec.workload)
        stages = options["stages"]
        boundaries = stage_boundaries(layers, workload.ties(), stages, options["partition_method"])
        stage_of = [next(s for s in range(stages) if boundaries[s] <= i < boundaries[s + 1]) for i in range(len(layers))]
        owners = {tie.user: tie.owner for tie in workload.ties()}

        def count(i: int) -> int:
            return sum(p.numel() for p in layers[owners.get(i, i)].parameters() if p.requires_grad)

        held = [sum(count(i) for i in range(boundaries[s], boundaries[s + 1])
                    if i not in owners or stage_of[owners[i]] != s) for s in range(stages)]
        return boundaries, held, stage_of

    def planned_parameters_held(self, spec: RunSpec, layers) -> int:
        """The largest stage's parameters, a tied copy included."""
        return max(self._stages(spec, layers)[1])

    def stage_traffic(self, spec: RunSpec, layers) -> list:
        """Every stage's traffic per optimizer step (harness.strategies.pipeline_traffic), from freshly built
        layers (the meta device's do): stages cut as DeepSpeed cuts them, activations' shapes from the workload's
        config (`Workload.layer_output_shapes`), no batch made and no forward run."""
        from harness.strategies.pipeline_traffic import boundary_bytes, stage_traffic

        options, layout, workload = self.resolved(spec), self.layout(spec), get_workload(spec.workload)
        boundaries, held, stage_of = self._stages(spec, layers)
        # DeepSpeed's bf16 or fp16 section keeps the model in 16 bits, so it sends 16 bits; autocast's block
        # outputs (a residual sum, a batch norm) and fp32 send fp32.
        half_model = sixteen_bit_weights(spec, options)
        activations = boundary_bytes(workload.layer_output_shapes(), spec.micro_batch, 2 if half_model else 4)
        tied_stages, tied_bytes = [], 0
        for tie in workload.ties():
            tied_stages = [stage_of[tie.owner], stage_of[tie.user]]
            tied_bytes = 4 * _attribute(layers[tie.owner], tie.weight_attr).numel()   # fp32 (the bf16 recipe's _hp_grad)
        return stage_traffic(boundaries=boundaries, activation_bytes=activations,
                             stage_gradient_bytes=[4 * count for count in held], tied_stages=tied_stages,
                             tied_gradient_bytes=tied_bytes, replicas=layout.data_parallel,
                             micro_batches=layout.micro_batches)

    def expected_traffic(self, spec: RunSpec, layers) -> ExpectedTraffic:
        """The busiest stage's traffic per optimizer step (every stage's: `stage_traffic`), in the groups the
        counter names: point to point on the default group, the tied gradients between the first and the last
        stage ("tied"), the stage's gradients among its replicas ("dp": neighbours, DeepSpeed's topology puts
        the data axis innermost), the loss along the pipeline ("pp", members a replica's width apart)."""
        from harness.derive.comm import Collective, wire_bytes

        stages, layout = self.resolved(spec)["stages"], self.layout(spec)
        replicas = layout.data_parallel
        by_stage = []
        for traffic in self.stage_traffic(spec, layers):
            # A stage's peer is a replica's width away (DeepSpeed's topology: rank = stage x replicas + replica).
            entries = [ExpectedCollective(collective=kind, size_bytes=size, calls=calls, ranks=2, group=WORLD,
                                          stride=replicas)
                       for kind, moves in ((Collective.SEND, traffic.sends), (Collective.RECV, traffic.receives))
                       for calls, size in moves]
            if traffic.tied_all_reduce:
                entries.append(ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=traffic.tied_all_reduce,
                                                  calls=1, ranks=2, group="tied", stride=(stages - 1) * replicas))
            for size in (traffic.gradient_all_reduce, traffic.loss_all_reduce):
                if size:
                    entries.append(ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=size, calls=1,
                                                      ranks=replicas, group="dp"))
            if traffic.loss_broadcast:
                entries.append(ExpectedCollective(collective=Collective.BROADCAST, size_bytes=traffic.loss_broadcast,
                                                  calls=1, ranks=stages, group="pp", stride=replicas))
            by_stage.append(entries)
        busiest = max(by_stage, key=lambda entries: sum(
            e.calls * wire_bytes(e.collective, e.size_bytes, e.ranks) for e in entries if e.collective != "recv"))
        return ExpectedTraffic(collectives=tuple(busiest))

    def wrap(self, spec, context, workload, layers):
        import deepspeed
        from deepspeed.pipe import PipelineModule, TiedLayerSpec

        options = self.resolved(spec)
        pipeline_layers: list[Any] = list(layers)
        for tie in workload.ties():
            owner = layers[tie.owner]
            pipeline_layers[tie.owner] = TiedLayerSpec(tie.key, type(owner), **owner.init_kwargs,
                                                       tied_weight_attr=tie.weight_attr)
            pipeline_layers[tie.user] = TiedLayerSpec(tie.key, type(owner), **owner.init_kwargs,
                                                      forward_fn=tie.user_forward, tied_weight_attr=tie.weight_attr)
        # The pipeline's own checkpointing: its interval of 1 layer, limited to the blocks, through torch's
        # non-reentrant checkpoint as everywhere else (DeepSpeed's default is its reentrant one).
        planted_loss = PlantedLoss(workload.loss)
        module = PipelineModule(layers=pipeline_layers, num_stages=options["stages"], loss_fn=planted_loss,
                                partition_method=options["partition_method"],
                                activation_checkpoint_interval=interval_of(options),
                                checkpointable_layers=list(BLOCK_CLASS_NAMES),
                                activation_checkpoint_func=functools.partial(torch.utils.checkpoint.checkpoint,
                                                                             use_reentrant=False))
        for tie in workload.ties():
            if tie.key in module.tied_modules:  # this stage holds a copy: start it from the reference weights
                module.tied_modules[tie.key].load_state_dict(layers[tie.owner].state_dict())
        module = module.to(context.device)

        precision, recipe = precision_config(spec, self.resolved(spec))
        layout = self.layout(spec)
        config = {**base_config(spec, layout.micro_batches), **precision}
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=make_adamw(module.parameters(), context.device),
                                               config=config)
        if engine.grid.get_data_parallel_id() != self.replica(spec, context):
            raise RuntimeError("DeepSpeed's topology disagrees with the data-parallel index the data was cut by")
        _label_groups(engine, module)
        parts = [int(part) for part in module.parts]     # numpy integers from partition_balanced
        return PipelineTrainer(context=context, engine=engine, precision_recipe=recipe, planted_loss=planted_loss,
                               loss_scaled=spec.precision is Precision.FP16,
                               config={"deepspeed_config": config, **throughput_timer_state(engine),
                                       "stages": options["stages"],
                                       "partition_method": options["partition_method"], "layer_boundaries": parts,
                                       "stage": engine.stage_id, **optimizer_description(context.device)})


WORLD = "world"     # harness.rank.comm_counter's label of the default group, where DeepSpeed's p2p sends


def _attribute(module: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        module = getattr(module, name)
    return module


def _label_groups(engine: Any, module: Any) -> None:
    """Name DeepSpeed's groups in the counts: the stage's replicas ("dp"), the pipeline ("pp"), each tied
    weight's stages ("tied")."""
    from harness.rank.comm_counter import label_group

    label_group(engine.grid.get_data_parallel_group(), "dp")
    label_group(engine.grid.get_pipe_parallel_group(), "pp")
    for comm in module.tied_comms.values():
        label_group(comm["group"], "tied")
