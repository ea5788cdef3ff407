"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`), the native rival to ZeRO-3, started by torchrun.

Each repeated block (residual or transformer block) is sharded as its own unit and then the root, as
PyTorch's FSDP2 examples do, so a block's parameters are gathered just before it runs and freed after.
Gradient accumulation keeps gradient sync off on all but the last micro-batch (FSDP2's equivalent of
DDP's `no_sync`; `gradient_sync=last`, the default): one reduce-scatter a step, but torch then keeps every
parameter's *unsharded* gradient, in the reduce dtype, from the first micro-batch to the last
(`FSDPParam.to_accumulated_grad_if_needed`, torch/distributed/fsdp/_fully_shard/_fsdp_param.py): 4 bytes a
parameter the rank holds, whole. `gradient_sync=every` reduce-scatters after every micro-batch (K a step), as
Composer's FSDP trainer does under accumulation, and keeps sharded gradients alone. In bf16 the default recipe
is torch.autocast around fp32 sharded weights, like every other strategy; FSDP2's own MixedPrecisionPolicy
(bf16 parameters for compute, fp32 gradient reduction) is the `mixed_precision=policy` option, the recipe its
users run (`usual_mixed_recipe`).

Traffic per optimizer step per rank, with K micro-batches: every forward all-gathers each unit's
parameters and every backward gathers them again (2K; K when reshard_after_forward is off, which keeps
them from forward to backward), and the gradients are reduce-scattered once, on the last micro-batch
(gradient sync is off on the others), or after every micro-batch with `gradient_sync=every`. The policy
gathers its bf16 `param_dtype` (2 bytes per parameter) and reduces in its fp32 `reduce_dtype` (4 bytes);
autocast and fp32 move fp32 both ways.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from harness.derive.comm import Collective
from harness.derive.memory import RankParameters, offloaded_to_host, zero_plan
from harness.rank.memory_model import torch_model_state_tensors
from harness.spec import Precision, RunSpec
from harness.strategies.base import (ADAMW_STATE_BYTES, AUTOCAST_DTYPES, ComputeOnlyPlan, ExpectedCollective,
                                     ExpectedTraffic, MicroBatch, Option, PrecisionRecipe, Sharding, Strategy,
                                     TrafficBytes, Trainer, accumulate, apply_update, is_block, make_adamw,
                                     optimizer_description, recipe_of, torchrun_context, unwrapped_parameter_names)
from harness.strategies.loss_scaling import scaler_for
from harness.strategies.state_checkpoint import CHECKPOINT, OPTION_NAME as CHECKPOINT_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME, blocks_as_run
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME
from workloads import Workload


@dataclass
class FSDP2Trainer(Trainer):
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    workload: Workload | None = None
    spec: RunSpec | None = None
    scaler: torch.amp.GradScaler | None = None      # fp16's (harness.strategies.loss_scaling)
    sync_every_micro_batch: bool = False            # `gradient_sync=every`: reduce-scatter each micro-batch

    def around(self, batch: MicroBatch):
        """What a micro-batch's forward and backward run inside, and on (`accumulate`'s `around`): nothing, and the
        batch as it is; context parallelism's ring (harness.strategies.cp) shards it."""
        return contextlib.nullcontext(), batch

    def train_step(self, micro_batches: list[MicroBatch], gradients_ready=None) -> torch.Tensor:
        loss = accumulate(self.model, self.workload.loss, micro_batches, self.spec, self.context.device,
                          no_sync=None if self.sync_every_micro_batch else self._no_sync,
                          multipliers=self.loss_multipliers, scaler=self.scaler, around=self.around)
        if self.scaler is not None:
            # Each rank unscales its shards; the scaler all-reduces the inf/NaN verdict over the DTensors' mesh,
            # so that every rank steps or skips together.
            self.scaler.unscale_(self.optimizer)
        if gradients_ready is not None:     # FSDP2's root post-backward has waited for the reduce-scatters
            gradients_ready()
        self.step_outcome = apply_update(self.optimizer, self.scaler)
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def model_state_tensors(self):
        # Parameters, gradients and optimizer state are DTensors; the census counts their local shards,
        # padded to equal sizes on every rank as FSDP2 allocates them.
        return torch_model_state_tensors(self.model, self.optimizer)

    def local_parameters(self):
        # fully_shard turns each parameter into a DTensor sharded on dim 0; to_local() is this rank's
        # rows, without the padding FSDP2 adds to even out the shards.
        return [p.to_local() for p in self.model.parameters() if p.requires_grad], True

    def local_gradients(self):
        return [p.grad.to_local() for p in self.model.parameters() if p.requires_grad], True

    def parameter_names(self):
        return unwrapped_parameter_names(self.model)

    @contextlib.contextmanager
    def _no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)


GRADIENT_SYNC_NAME = "gradient_sync"
GRADIENT_SYNC = Option("last", "under gradient accumulation: reduce-scatter on the last micro-batch only (unsharded "
                       "fp32 gradients kept meanwhile) or after every micro-batch", choices=("last", "every"))


def reduce_scatters_a_step(options, micro_batches: int) -> int:
    """Reduce-scatters of each unit a step: once, or once a micro-batch under `gradient_sync=every`."""
    return micro_batches if options.get(GRADIENT_SYNC_NAME, "last") == "every" else 1


def fully_shard_working_memory(rank: RankParameters, gathered_bytes: int, options) -> dict[str, float]:
    """What fully_shard keeps beyond the sharded states at a rank's peak (module docstring; `fsdp2`, `fsdp2-tp`):

    - gathered: the root unit (embeddings, final norm, head), which fully_shard keeps gathered from forward to
      backward, and two blocks (the one running and the next, prefetched), in the gather dtype; every unit with
      `reshard_after_forward` off, which keeps them all from forward to backward;
    - accumulated gradients, under `gradient_sync=last` with more than one micro-batch: every parameter's unsharded
      gradient in fp32 (the reduce dtype, or the parameters' own fp32 under autocast); otherwise one unit's
      unsharded gradient awaiting its reduce-scatter, in the parameters' dtype and again in fp32 where they differ."""
    if options.get("reshard_after_forward", True):
        gathered = (rank.outside_blocks + 2 * rank.unit) * gathered_bytes
    else:
        gathered = rank.held * gathered_bytes
    if rank.micro_batches > 1 and options.get(GRADIENT_SYNC_NAME, "last") == "last":
        return {"gathered": gathered, "accumulated gradients": 4.0 * rank.held}
    unsharded = rank.largest_module * (gathered_bytes + (4 if gathered_bytes != 4 else 0))
    return {"gathered": gathered, "gradients awaiting reduce-scatter": unsharded}


class FSDP2(Strategy):
    name = "fsdp2"
    launcher = "torchrun"
    checkpoint_method = "dcp"
    description = "PyTorch FSDP2 fully_shard per block, then the root (torchrun)"
    precision_recipes = (PrecisionRecipe.FP32, PrecisionRecipe.AUTOCAST, PrecisionRecipe.FSDP_MP_POLICY)
    options = {
        "reshard_after_forward": Option(True, "free gathered block parameters after forward (ZeRO-3 "
                                        "behaviour); False keeps them until backward (ZeRO-2-like)"),
        "offload_policy": Option("none", "FSDP2's CPUOffloadPolicy: sharded parameters, gradients and the optimizer "
                                 "step on the host (GPU only)", choices=("none", "cpu")),
        "mixed_precision": Option("autocast", "bf16/fp16 recipe: torch.autocast over fp32 shards, or FSDP2's "
                                  "MixedPrecisionPolicy (16-bit params, fp32 reduce)", choices=("autocast", "policy")),
        GRADIENT_SYNC_NAME: GRADIENT_SYNC,
        OPTION_NAME: ACTIVATION_CHECKPOINTING, CHECKPOINT_NAME: CHECKPOINT, ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD,
        COMPILE_NAME: COMPILE,
    }

    def start(self, spec):
        return torchrun_context(spec.device)

    def _policy(self, spec: RunSpec) -> bool:
        return spec.precision.is_mixed and self.resolved(spec)["mixed_precision"] == "policy"

    def traffic_bytes(self, spec: RunSpec, model: nn.Module) -> TrafficBytes:
        count = sum(p.numel() for p in model.parameters())
        gathered = 2 * count if self._policy(spec) else 4 * count     # MixedPrecisionPolicy(param_dtype=bf16)
        return TrafficBytes(parameters=count, gradients_reduced=4 * count, parameters_gathered=gathered)

    def described_traffic_bytes(self, parameters, recipe, options):
        """As `traffic_bytes`: fp32 gradients reduced; parameters gathered in 16 bits under the MixedPrecisionPolicy."""
        gathered = 2 if recipe is PrecisionRecipe.FSDP_MP_POLICY else 4
        return TrafficBytes(parameters=parameters, gradients_reduced=4 * parameters,
                            parameters_gathered=gathered * parameters)

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        gathers = (2 if options["reshard_after_forward"] else 1) * micro_batches
        return ExpectedTraffic(collectives=(
            ExpectedCollective(collective=Collective.ALL_GATHER, size_bytes=traffic.parameters_gathered,
                               calls=gathers, ranks=data_parallel),
            ExpectedCollective(collective=Collective.REDUCE_SCATTER, size_bytes=traffic.gradients_reduced,
                               calls=reduce_scatters_a_step(options, micro_batches), ranks=data_parallel)))

    def usual_mixed_recipe(self):
        """FSDP2's MixedPrecisionPolicy (bf16 gathers, fp32 reduce), as torchtitan runs it."""
        return PrecisionRecipe.FSDP_MP_POLICY, {"mixed_precision": "policy"}

    def working_memory_bytes(self, rank, recipe, options):
        gathered = 2 if recipe is PrecisionRecipe.FSDP_MP_POLICY else ADAMW_STATE_BYTES[recipe][0]
        if options.get("offload_policy", "none") != "none":
            return {"gathered": (rank.outside_blocks + 2 * rank.unit) * gathered}
        return fully_shard_working_memory(rank, gathered, options)

    def compute_only_plan(self, spec: RunSpec) -> ComputeOnlyPlan:
        """The unwrapped model and AdamW over this rank's chunk of each parameter's rows (FSDP2 shards dim 0
        with torch.chunk), one tensor per parameter as FSDP2's optimizer sees them. With the policy the
        forward and backward run on bf16 weights, each whole gradient is cast to fp32 (the reduce dtype)
        before its chunk is taken, and the fp32 chunk is stepped and cast back into the bf16 weights."""
        policy = self._policy(spec)
        return ComputeOnlyPlan(sharding=Sharding.DIM0_ROWS,
                               weights_dtype=AUTOCAST_DTYPES[spec.precision] if policy else torch.float32,
                               autocast=spec.precision.is_mixed and not policy,
                               whole_gradients_in_fp32=policy)

    def model_state_plan(self, data_parallel, recipe, options):
        """Weights, gradients and optimizer state all sharded over the ranks, like ZeRO-3, each kept in the
        parameters' own fp32 (see base.ADAMW_STATE_BYTES for the MixedPrecisionPolicy)."""
        weights, gradients, optimizer = ADAMW_STATE_BYTES[recipe]
        plan = zero_plan(3, data_parallel, weights, gradients, optimizer,
                         basis=f"{recipe.value}: torch AdamW over fully_shard's fp32 shards, all three sharded")
        if options.get("offload_policy", "none") != "none":     # CPUOffloadPolicy: every sharded state on the host
            return offloaded_to_host(plan, "weights", "gradients", "optimizer")
        return plan

    def wrap(self, spec, context, workload, layers):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        options = self.resolved(spec)
        mesh = init_device_mesh(context.device.type, (context.world_size,))
        recipe = recipe_of(spec)
        shard_kwargs = {"mesh": mesh, "reshard_after_forward": options["reshard_after_forward"]}
        # The shards, and so the optimizer step, live on the host under the offload policy.
        step_device = context.device
        if options["offload_policy"] == "cpu":
            shard_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
            step_device = torch.device("cpu")
        run_spec = spec
        if self._policy(spec):
            shard_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPES[spec.precision],
                                                             reduce_dtype=torch.float32)
            recipe = PrecisionRecipe.FSDP_MP_POLICY
            run_spec = spec.replace(precision=Precision.FP32)   # the policy casts; no autocast on top
        # fp16's scaler, with the policy too (its fp16 gradients are reduced in fp32 and still need unscaling).
        scaler = scaler_for(spec, context.device)
        # Checkpointing, then compile, wraps each block before fully_shard does (torchtitan's order).
        model = nn.Sequential(*blocks_as_run(layers, options)).to(context.device)
        blocks = [layer for layer in model if is_block(layer)]
        for block in blocks:
            fully_shard(block, **shard_kwargs)
        fully_shard(model, **shard_kwargs)
        return FSDP2Trainer(context=context, model=model, optimizer=make_adamw(model.parameters(), step_device),
                            workload=workload, spec=run_spec, precision_recipe=recipe, scaler=scaler,
                            sync_every_micro_batch=options[GRADIENT_SYNC_NAME] == "every",
                            config={**options, "sharded_units": len(blocks) + 1,
                                    **optimizer_description(step_device)})
