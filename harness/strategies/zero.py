"""DeepSpeed ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020) as three strategies.

Stage 1 shards optimizer states, stage 2 also gradients, stage 3 also parameters. The options default to
DeepSpeed's own defaults (DeepSpeedZeroConfig in deepspeed/runtime/zero/config.py, 0.19): overlap_comm
on for stage 3 and off for stages 1-2, contiguous gradients on, 5e8-element reduce and all-gather buckets,
5e7-element stage-3 prefetch bucket, 1e5-element persistence threshold, no offload. The resolved config is
recorded in every row.

Traffic per optimizer step per rank (Rajbhandari et al. 2020, sec. 7: ZeRO-1/2 move as much as DDP, ZeRO-3
1.5x), with G the bytes of all gradients as reduced, W of all parameters as gathered, K micro-batches: stage
1 reduce-scatters G once, at the step boundary, and all-gathers the updated W; stage 2 reduce-scatters G
after every micro-batch (K times) and all-gathers W; stage 3 all-gathers W for every forward and again for
every backward (2K) and reduce-scatters G every micro-batch (K), except the parameters it keeps whole (under
param_persistence_threshold), gathered once a step, after it (below): where a row measured how many,
`TrafficBytes.parameters_kept_whole` says so and the all-gathers are split. These are the algorithm's
collectives; the counted ones show where DeepSpeed departs from them (on gloo, 0.19: stages 1-2 reduce
buckets with all-reduces, twice a reduce-scatter's wire bytes; stage 3 re-uses gathered parameters within
stage3_max_reuse_distance and keeps those under param_persistence_threshold whole, so it gathers less).

The bytes follow the precision recipe (DeepSpeed 0.19.8's source):
- `bf16` section: bf16 weights and gradients; gradients are reduced in `communication_data_type`, which
  defaults to bf16 when bf16 is enabled (runtime/engine.py `communication_data_type`), and the bf16
  weights are gathered: G = W = 2 bytes per parameter.
- `torch_autocast` section: fp32 weights and gradients, but `init_autocast_params` (runtime/torch_autocast.py)
  marks every parameter of a module whose class is exactly one of `LOWER_PRECISION_SAFE_MODULES`
  (nn.Linear, nn.Conv1d/2d/3d) with `comm_dtype = bf16`; stages 1-2 (runtime/zero/stage_1_and_2.py,
  `reduce_independent_p_g_buckets_and_remove_grads` -> one bucket per comm dtype, `gradient_reduction_w_predivide`
  casts to it) and stage 3 (runtime/zero/stage3.py, per-dtype `ipg_buckets`) reduce those gradients in bf16
  and every other one (embeddings, norms) in fp32. Stage 3 also fetches those parameters for forward
  and backward in bf16 (runtime/zero/partition_parameters.py `_all_gather_coalesced` ->
  `get_allgather_dtype`); stages 1-2 gather the fp32 weights. Not in the bytes: stage 3 re-gathers its
  persistent parameters (under param_persistence_threshold) after every step through the synchronous
  `_all_gather` path, in their fp32 partition's dtype; on gpt-tiny, where every parameter is persistent,
  that is all of its all-gather traffic (measured: 947,712 fp32 bytes, once per step, at any K). Their
  count is known only once DeepSpeed has partitioned the model, so the traffic a row records before the
  run splits nothing; the projection passes the row's measured count (`parameters_kept_whole`).
- fp32: 4 bytes everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.derive.checkpoint import CheckpointContents, held_once
from harness.derive.comm import Collective
from harness.derive.exposed import BOUND_PREFIX, SAME_WORK
from harness.derive.memory import ModelStatePlan, offloaded_to_host, zero_plan
from harness.rank.memory_model import ModelStateTensors, deepspeed_estimate, optimizer_state_tensors
from harness.spec import Precision, RunSpec
from harness.strategies.base import (ADAMW_HYPERPARAMETERS, AUTOCAST_DTYPES, ComputeOnlyPlan, ExpectedCollective, ExpectedTraffic, MicroBatch,
                                     Option, PrecisionRecipe, Sharding, Strategy, TrafficBytes, Trainer, make_adamw,
                                     half_dtype_names, optimizer_description, unwrapped_parameter_names)
from harness.strategies.deepspeed_common import (DEEPSPEED_RECIPES, PRECISION_OPTION, base_config, precision_config,
                                                 sixteen_bit_weights, start_deepspeed, throughput_timer_state)
from harness.strategies.loss_scaling import (deepspeed_autocast_scaler, deepspeed_loss_scale,
                                             deepspeed_step_outcome)
from harness.strategies.state_checkpoint import CHECKPOINT, OPTION_NAME as CHECKPOINT_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME, checkpointed_blocks, interval_of
from harness.strategies.compiling import OPTION_NAME as COMPILE_NAME, compiles
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME, saved_on_host
from workloads import Workload


@dataclass
class DeepSpeedTrainer(Trainer):
    engine: Any = None
    workload: Workload | None = None
    loss_scaled: bool = False       # fp16: read what each step did under loss scaling (harness.strategies.loss_scaling)
    backward_scale: float = 1.0     # fp16: the loss scale of the last step's backward
    spec: RunSpec | None = None
    # The share of a sample's tokens this rank's loss is the mean over, which its backward is weighted by: 1, but
    # under Ulysses (harness.strategies.ulysses), where ZeRO sums the gradients over the sequence-parallel ranks.
    token_share: float = 1.0

    # DeepSpeed's own norm of the reduced gradients, which it computes in the optimizer step (below).
    gradient_norm_after_step = True

    def train_step(self, micro_batches: list[MicroBatch], gradients_ready=None) -> torch.Tensor:
        # The engine divides each loss by gradient_accumulation_steps in backward and steps the
        # optimizer at the accumulation boundary (the last micro-batch). Its backward at the boundary
        # finishes the gradient reduction (reduce_gradients / the stage-3 reduce-scatter epilogue).
        total = torch.zeros((), device=self.context.device)
        multipliers = self.loss_multipliers
        if self.loss_scaled:
            skipped, scale = self.engine.skipped_steps, deepspeed_loss_scale(self.engine)
            self.backward_scale = scale         # what this step's gradients carry until its update unscales them
        for index, (inputs, targets) in enumerate(micro_batches):
            with saved_on_host(self.spec):
                loss = self.workload.loss(self.engine(inputs), targets)
                weighted = loss if self.token_share == 1.0 else loss * self.token_share
                self.engine.backward(weighted if multipliers is None else weighted * multipliers[index])
            if gradients_ready is not None and index == len(micro_batches) - 1:
                gradients_ready()
            self.engine.step()
            total += loss.detach().float()
        if self.loss_scaled:
            self.step_outcome = deepspeed_step_outcome(self.engine, skipped, scale)
        return total / len(micro_batches)

    def model_state_tensors(self) -> ModelStateTensors:
        return deepspeed_model_state_tensors(self.engine)

    def torch_optimizer(self) -> torch.optim.Optimizer:
        # The client AdamW the ZeRO optimizer steps over this rank's fp32 master partition.
        return self.engine.optimizer.optimizer

    def parameters_kept_whole(self) -> int:
        # Stage 3 keeps parameters below stage3_param_persistence_threshold gathered on every rank, beside
        # their shard (ds_persist, deepspeed/runtime/zero/parameter_offload.py).
        return sum(p.ds_numel for p in self.engine.module.parameters() if getattr(p, "ds_persist", False))


    def gradient_norm(self) -> float:
        # The engine's norm of the step just taken (DeepSpeed 0.19.8, engine._take_model_step copies the
        # optimizer's `_global_grad_norm` after optimizer.step()). Both ZeRO optimizers compute it inside
        # step() before any weight changes: stage 1/2 (stage_1_and_2.py, step -> scaled_global_norm ->
        # get_grad_norm_direct) over this rank's slices of `averaged_gradients`, padding skipped, squares
        # all-reduced over the data-parallel group; stage 3 (stage3.py, step -> _get_norm_groups) over the
        # reduce-scattered partitions, likewise. The gradients are those of losses divided by
        # gradient_accumulation_steps and averaged over the data-parallel ranks, as everywhere else here;
        # the norm is divided by ZeRO's own loss scale and taken before unscale_and_clip_grads, which would clip
        # only where gradient_clipping > 0 (it is 0). That scale is 1 in fp32, bf16 and under torch_autocast
        # float16, whose GradScaler's scale stays in the gradients: there the norm is that scale times the
        # true one, so it is divided here by the scale this step's backward used; the fp16 section's norm on a GPU
        # is already divided by its own scale.
        norm = float(self.engine.get_global_grad_norm())
        return norm / self.backward_scale if deepspeed_autocast_scaler(self.engine) is not None else norm

    def local_parameters(self):
        module = self.engine.module
        if self.engine.zero_optimization_stage() < 3:      # stages 1-2 keep every parameter whole on every rank
            return [p for p in module.parameters() if p.requires_grad], False
        # Stage 3 leaves an empty placeholder in the module; each rank's partition is `ds_tensor`
        # (zero-padded at the end of the last partition, which adds nothing to a norm).
        return [p.ds_tensor for p in module.parameters() if p.requires_grad], True

    def local_gradients(self):
        # Inside `gradients_ready`: the boundary micro-batch's backward has reduced them, and `engine.step()`
        # has not yet consumed them. This rank's part of each parameter's reduced gradient, as DeepSpeed's
        # own accessors read it (deepspeed/utils/tensor_fragment.py, 0.19.8: `safe_get_full_grad` less its
        # all-reduce of a whole-parameter buffer): stages 1-2 map each parameter to its fragment of this
        # rank's flat partition of `averaged_gradients` (`_hp_mapping`, None where the partition holds none
        # of it); stage 3 keeps each parameter's reduce-scattered partition (zero-padded at the end).
        # Under the fp16 section those gradients still carry ZeRO's loss scale, which its step divides out after
        # its norm (`gradient_norm`, already unscaled): divided here too, so both read the same gradient.
        parameters = [p for p in self.engine.module.parameters() if p.requires_grad]
        if self.engine.zero_optimization_stage() >= 3:
            fragments = [p._z3_optimizer.get_local_fp32_grad_for_param(p) for p in parameters]
        else:
            fragments = [p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group) if p._hp_mapping is not None
                         else p.new_zeros(0) for p in parameters]
        return unscaled(fragments, self.loss_scale_in_gradients()), True

    def loss_scale_in_gradients(self) -> float:
        """The scale the reduced gradients carry between reduction and update: ZeRO's loss scale under the fp16
        section (its `cur_scale`, the one this step's backward used), the GradScaler's under torch_autocast float16
        (the CPU's fp16: it unscales only inside the optimizer's step), 1 otherwise."""
        autocast_scaled = deepspeed_autocast_scaler(self.engine) is not None
        if self.precision_recipe is not PrecisionRecipe.DEEPSPEED_FP16 and not autocast_scaled:
            return 1.0
        return deepspeed_loss_scale(self.engine)

    def parameter_names(self):
        return unwrapped_parameter_names(self.engine.module)

DEEPSPEED_CPU_ADAM = "deepspeed.ops.adam.DeepSpeedCPUAdam"


def zero_offload_adam(parameters) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """ZeRO-Offload's optimizer as DeepSpeed's users run it, and its description for the row: DeepSpeedCPUAdam in
    AdamW mode at the common hyperparameters, its C++ op built by DeepSpeed's own op builder (CPUAdamBuilder, a JIT
    compile with this machine's compiler, cached after the first). DeepSpeed 0.19.8 refuses a client torch optimizer
    with offload_optimizer ("use deepspeed.ops.adam.DeepSpeedCPUAdam ... or set zero_force_ds_cpu_optimizer: false",
    seen on an H200), and its CPU Adam is what ZeRO-Offload's paper and DeepSpeed's examples step with. Its update is
    torch AdamW's (bias-corrected moments, decoupled weight decay before the step), vectorised on the host, so
    parity holds it to the same tolerances; the hyperparameters are read back from it (`check_adamw_hyperparameters`)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    optimizer = DeepSpeedCPUAdam(parameters, **ADAMW_HYPERPARAMETERS, adamw_mode=True)
    check_adamw_hyperparameters(optimizer)
    return optimizer, {**optimizer_description(torch.device("cpu")), "optimizer": DEEPSPEED_CPU_ADAM,
                       "optimizer_impl": "DeepSpeed's cpu_adam op (AdamW mode), built by its CPUAdamBuilder"}


def check_adamw_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, in one line, an optimizer whose update is not the common AdamW's: other hyperparameters than
    ADAMW_HYPERPARAMETERS in any group, Adam's coupled weight decay (DeepSpeedCPUAdam's `adam_w_mode` False), no bias
    correction, or AMSGrad."""
    expected = {name: tuple(value) if isinstance(value, (tuple, list)) else value
                for name, value in ADAMW_HYPERPARAMETERS.items()}
    for group in optimizer.param_groups:
        found = {name: tuple(group[name]) if isinstance(group[name], (tuple, list)) else group[name]
                 for name in expected}
        departures = [f"{name} {found[name]!r} (expected {expected[name]!r})" for name in expected
                      if found[name] != expected[name]]
        if not getattr(optimizer, "adam_w_mode", True):
            departures.append("Adam's coupled weight decay (adamw_mode False)")
        if not group.get("bias_correction", True):
            departures.append("no bias correction")
        if group.get("amsgrad", False):
            departures.append("AMSGrad")
        if departures:
            raise RuntimeError(f"{type(optimizer).__name__} departs from the common AdamW: {'; '.join(departures)}")


def unscaled(gradients: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """`gradients` divided by the loss `scale` they carry (as they are where it is 1), each in fp32: an fp16
    gradient divided in fp16 would lose the small values that the scale was there to keep out of underflow."""
    if scale == 1.0:
        return gradients
    return [gradient.float() / scale for gradient in gradients]


# deepspeed.runtime.torch_autocast.LOWER_PRECISION_SAFE_MODULES (0.19.8), written out so that a plan pricing ZeRO's
# cells does not import DeepSpeed (seconds of a dry run); tests/test_dry_run_builds_nothing.py holds it to DeepSpeed's.
LOWER_PRECISION_SAFE_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _communicated_in_bf16(model: nn.Module) -> set[int]:
    """ids of the parameters DeepSpeed's torch_autocast section reduces in bf16 (the module docstring):
    init_autocast_params matches module classes exactly, not by isinstance."""
    return {id(p) for module in model.modules() if module.__class__ in LOWER_PRECISION_SAFE_MODULES
            for p in module.parameters(recurse=False)}


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
    # ZeRO-Offload keeps the fp32 gradient partition the CPU Adam steps on as the master partition's .grad, for the
    # whole run (stage_1_and_2.py `initialize_optimizer_states`; stage3.py, a host buffer per sub-group); stage 3
    # reduces into `grad_partitions_flat_buffer` first (on the host under offload; on the device the storage behind
    # `averaged_gradients`, counted once). Without offload a master's .grad exists only inside the step.
    gradients.extend(master.grad for master in masters if getattr(master, "grad", None) is not None)
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if torch.is_tensor(flat):
        gradients.append(flat)
    return ModelStateTensors(
        weights=weights, gradients=gradients,
        optimizer=list(masters) + optimizer_state_tensors(optimizer.optimizer),
        note="DeepSpeed's reduction buckets (ipg buffers) are communication buffers, not model states, and are "
             "not counted")

# DeepSpeed's default stage3_max_live_parameters (runtime/zero/config.py): parameters gathered at once, at most.
STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000


class ZeRO(Strategy):
    launcher = "deepspeed"
    checkpoint_method = "deepspeed"
    requires = ("deepspeed",)
    precision_recipes = DEEPSPEED_RECIPES

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"zero{stage}"
        self.description = f"DeepSpeed ZeRO stage {stage} (DeepSpeed's launcher)"
        options = {
            "overlap_comm": Option(None, "overlap gradient reduction with backward; default: DeepSpeed's "
                                   "(on for stage 3 only)", choices=(None, True, False)),
            "contiguous_gradients": Option(True, "copy gradients into one contiguous buffer as produced"),
            "reduce_bucket_size": Option(500_000_000, "elements reduced at a time", minimum=1),
            "offload_optimizer": Option("none", "keep optimizer states (and step) on the CPU",
                                        choices=("none", "cpu")),
            "precision_recipe": PRECISION_OPTION,
            # torch's non-reentrant checkpoint: DeepSpeed's own non_reentrant_checkpoint crashes under ZeRO-3
            # (deepspeedai/DeepSpeed#4595), and its `activation_checkpointing` config section is read only by
            # deepspeed.checkpointing.configure, never by the engine.
            OPTION_NAME: ACTIVATION_CHECKPOINTING, CHECKPOINT_NAME: CHECKPOINT,
            ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD,
            # DeepSpeed's own `engine.compile()`: the whole module, its ZeRO hooks included, with the accelerator's
            # backend (inductor on CPU and CUDA), not the per-block compile the torch strategies share.
            COMPILE_NAME: Option(False, "compile the module with DeepSpeed's engine.compile()", choices=(False, True)),
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

    def stage_of(self, options) -> int:
        """The ZeRO stage a cell runs: this strategy's own (deepspeed-moe's is an option)."""
        return self.stage

    def _half_weights(self, spec: RunSpec) -> bool:
        return sixteen_bit_weights(spec, self.resolved(spec))

    def traffic_bytes(self, spec: RunSpec, model: nn.Module) -> TrafficBytes:
        parameters = list(model.parameters())
        count = sum(p.numel() for p in parameters)
        if spec.precision is Precision.FP32:
            return TrafficBytes(parameters=count, gradients_reduced=4 * count, parameters_gathered=4 * count)
        if self._half_weights(spec):
            return TrafficBytes(parameters=count, gradients_reduced=2 * count, parameters_gathered=2 * count)
        low = _communicated_in_bf16(model)      # in autocast's 16-bit dtype, bf16 or fp16: 2 bytes either way
        reduced = sum(p.numel() * (2 if id(p) in low else 4) for p in parameters)
        return TrafficBytes(parameters=count, gradients_reduced=reduced,
                            parameters_gathered=reduced if self.stage_of(self.resolved(spec)) == 3 else 4 * count)

    def described_traffic_bytes(self, parameters, recipe, options):
        """As `traffic_bytes`, every parameter a linear layer's: fp32 in fp32; 16 bits in DeepSpeed's bf16 or fp16
        section; under torch.autocast the torch_autocast section reduces a Linear's gradients in 16 bits, and stage
        3 gathers them so, where stages 1-2 gather fp32 weights."""
        if recipe is PrecisionRecipe.FP32:
            gradients = gathered = 4
        elif recipe in (PrecisionRecipe.DEEPSPEED_BF16, PrecisionRecipe.DEEPSPEED_FP16):
            gradients = gathered = 2
        else:
            gradients, gathered = 2, 2 if self.stage_of(options) == 3 else 4
        return TrafficBytes(parameters=parameters, gradients_reduced=gradients * parameters,
                            parameters_gathered=gathered * parameters)

    def usual_mixed_recipe(self):
        """DeepSpeed's bf16 section (bf16 weights, fp32 master copies), the recipe its users run."""
        return PrecisionRecipe.DEEPSPEED_BF16, {"precision_recipe": PrecisionRecipe.DEEPSPEED_BF16.value}

    def working_memory_bytes(self, rank, recipe, options):
        """DeepSpeed's buffers beyond the model states (its 0.19.8 source; harness.derive.memory's census leaves
        them out): the reduction buckets, `reduce_bucket_size` elements for each dtype gradients are reduced in
        (`ipg_buckets`: one a dtype, bf16 and fp32 both under the torch_autocast section), allocated whole with
        contiguous_gradients on whatever the model's size, twice under overlap_comm in stages 1-2
        (stage_1_and_2.py `setup_buckets`; stage3.py allocates one a dtype); and in stage 3 the parameters
        gathered from their shards: the largest module the rank gathers and the prefetch bucket ahead of it, at
        most stage3_max_live_parameters (1e9, DeepSpeed's default, not an option here), in the gather dtype."""
        terms: dict[str, float] = {}
        if options.get("contiguous_gradients", True) and options.get("offload_optimizer", "none") == "none":
            reduced_in = {PrecisionRecipe.FP32: 4, PrecisionRecipe.AUTOCAST: 2 + 4}.get(recipe, 2)
            overlap = options.get("overlap_comm")
            overlap = self.stage_of(options) == 3 if overlap is None else overlap
            copies = 2 if overlap and self.stage_of(options) < 3 else 1
            terms["buckets"] = float(options["reduce_bucket_size"]) * reduced_in * copies
        if self.stage_of(options) == 3:
            gathered_in = 4 if recipe is PrecisionRecipe.FP32 else 2
            live = min(STAGE3_MAX_LIVE_PARAMETERS, rank.largest_module + options["prefetch_bucket_size"])
            terms["gathered"] = live * gathered_in
        return terms

    def gradient_reduce_dtypes(self, spec, model):
        """As `traffic_bytes`: fp32; all bf16 in the bf16 section; under torch_autocast bf16 for the
        parameters of Linear and Conv modules and fp32 for the rest."""
        if spec.precision is Precision.FP32:
            return ("float32",)
        (half,) = half_dtype_names(spec)
        if self._half_weights(spec):
            return (half,)
        low = _communicated_in_bf16(model)
        return tuple(sorted({half if id(p) in low else "float32" for p in model.parameters()}))

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        def collective(kind: Collective, size: int, calls: int) -> ExpectedCollective:
            return ExpectedCollective(collective=kind, size_bytes=size, calls=calls, ranks=data_parallel)

        gradients, weights, k = traffic.gradients_reduced, traffic.parameters_gathered, micro_batches
        stage = self.stage_of(options)
        if stage == 1:
            return ExpectedTraffic(collectives=(collective(Collective.REDUCE_SCATTER, gradients, 1),
                                                collective(Collective.ALL_GATHER, weights, 1)))
        if stage == 2:
            return ExpectedTraffic(collectives=(collective(Collective.REDUCE_SCATTER, gradients, k),
                                                collective(Collective.ALL_GATHER, weights, 1)))
        whole = min(traffic.parameters_kept_whole, traffic.parameters)
        kept = weights * whole // traffic.parameters if traffic.parameters else 0
        gathers = ((collective(Collective.ALL_GATHER, weights - kept, 2 * k),) if kept < weights else ()) + (
            (collective(Collective.ALL_GATHER, kept, 1),) if kept else ())
        return ExpectedTraffic(collectives=(*gathers, collective(Collective.REDUCE_SCATTER, gradients, k)))

    def compute_only_plan(self, spec: RunSpec) -> ComputeOnlyPlan:
        """The unwrapped model in the recipe's weights (bf16 for the bf16 section, fp32 under autocast and
        fp32) and AdamW over the elements DeepSpeed gives this rank: its contiguous 1/N of all parameters
        flattened (stages 1-2) or of each parameter (stage 3), stepped as one flat fp32 tensor whose update
        is copied back into the weights, as DeepSpeed's fp32 partition is."""
        options = self.resolved(spec)
        half_weights = self._half_weights(spec)
        kind = SAME_WORK
        if options["offload_optimizer"] != "none":
            kind = (f"{BOUND_PREFIX}the real step runs the optimizer on the host (offload_optimizer="
                    f"{options['offload_optimizer']}) and copies gradients and weights across; the baseline "
                    "steps on the device, so exposed time includes that work (an upper bound)")
        elif self.stage_of(options) == 3 and options["offload_param"] != "none":
            kind = (f"{BOUND_PREFIX}the real step keeps parameters on the host (offload_param="
                    f"{options['offload_param']}) and copies them in for every gather; the baseline does not, "
                    "so exposed time includes those copies (an upper bound)")
        return ComputeOnlyPlan(kind=kind, sharding=Sharding.FLAT if self.stage_of(options) < 3 else Sharding.PER_PARAMETER,
                               weights_dtype=AUTOCAST_DTYPES[spec.precision] if half_weights else torch.float32,
                               autocast=spec.precision.is_mixed and not half_weights)

    def checkpoint_holds(self, options):
        # ZeRO-3's module holds empty placeholders of its partitioned parameters when saved; its fp32 partitions in the
        # optimizer's state are the weights (deepspeed/runtime/engine.py, `_save_zero_checkpoint`; zero_to_fp32.py
        # rebuilds the model from them alone).
        return ("optimizer",) if self.stage_of(options) == 3 else ("weights", "optimizer")

    def model_state_plan(self, data_parallel, recipe, options) -> ModelStatePlan:
        """The ZeRO paper's partitioning for this stage (sec. 5.1). In every recipe DeepSpeed's ZeRO
        optimizer keeps an fp32 master copy of its partition beside the model's weights, even when those
        are fp32 already (deepspeed/runtime/zero/stage_1_and_2.py, `single_partition_of_fp32_groups`, a
        clone; stage3.py, `fp32_partitioned_groups_flat`), so the optimizer state is the paper's K = 12
        (master weights, momentum, variance) and weights and gradients keep the model's 4 bytes, or 2 in
        DeepSpeed's bf16 recipe. (Stage 3 means to skip the copy for fp32 partitions on `self.device`, but
        compares a torch.device with a device-name string, which never match in 0.19.8; the census of a
        CPU run finds the copy.)"""
        weights = 2 if recipe in (PrecisionRecipe.DEEPSPEED_BF16, PrecisionRecipe.DEEPSPEED_FP16) else 4
        stage = self.stage_of(options)
        plan = zero_plan(stage, data_parallel, weights, weights, 12,
                         basis=f"{recipe.value}: DeepSpeed ZeRO-{stage}, {weights}-byte weights and gradients, "
                               f"fp32 master partition + AdamW moments (K = 12)")
        if options.get("offload_optimizer", "none") == "none":
            return plan
        # ZeRO-Offload (Ren et al. 2021, sec. 4): the host holds the fp32 master partition, the moments and the
        # fp32 gradient partition they step on, 16 bytes a parameter over the ranks (DeepSpeed's
        # estimate_zero3_model_states_mem_needs counts 16 on the host with offload_optimizer, 18 with
        # offload_param). From stage 2 on the device keeps no gradient beyond its buckets (estimate_zero2 with
        # cpu_offload: 2 bytes a parameter on the device, the weights); stage 1 keeps its whole 16-bit or fp32
        # gradients there until the boundary's reduction, so its host copy joins the optimizer's bytes.
        if stage == 1:
            optimizer = dataclasses.replace(plan.optimizer, bytes_per_parameter=16)
            return offloaded_to_host(dataclasses.replace(plan, optimizer=optimizer), "optimizer")
        plan = dataclasses.replace(plan, gradients=dataclasses.replace(plan.gradients, bytes_per_parameter=4))
        # ZeRO-Infinity's CPU tier keeps the parameter shards there too, in the weights' own bytes.
        moved = ("weights",) if options.get("offload_param", "none") != "none" else ()
        return offloaded_to_host(plan, "gradients", "optimizer", *moved)

    def checkpoint_contents(self, recipe, options) -> CheckpointContents:
        """The components `checkpoint_holds` names as the plan keeps them without offload: offload moves where the
        states live, not what the files hold (stage 1's offloaded plan counts its host copy of the gradients among
        the optimizer's bytes). DeepSpeed 0.19.8's `save_checkpoint` after one step of two nn.Linear(1000, 1000)
        (2,002,000 parameters, CPU, world size 1, and 2 for stages 1 and 3) wrote 16.00 bytes a parameter in stages
        1-2 under fp32 (the module's 4-byte weights, from data-parallel rank 0, beside the fp32 master partition and
        moments, 12), 14.00 under the bf16 section (2 + 12) and 12.00 in stage 3 under both."""
        return held_once(self.model_state_plan(1, recipe, {}), self.checkpoint_holds(options))

    def deepspeed_estimate_bytes(self, parameters, largest_module_parameters, gpus_per_node, nodes, options):
        estimate = deepspeed_estimate(self.stage_of(options), parameters, largest_module_parameters, gpus_per_node, nodes=nodes,
                                      offload_optimizer=options.get("offload_optimizer") == "cpu",
                                      offload_param=options.get("offload_param") == "cpu")
        return estimate["gpu_bytes"] if estimate else None

    def zero_config(self, spec: RunSpec) -> dict[str, Any]:
        o = self.resolved(spec)
        config: dict[str, Any] = {"stage": self.stage_of(o), "contiguous_gradients": o["contiguous_gradients"],
                                  "reduce_bucket_size": o["reduce_bucket_size"]}
        if o["overlap_comm"] is not None:
            config["overlap_comm"] = o["overlap_comm"]
        if o["offload_optimizer"] != "none":
            config["offload_optimizer"] = {"device": o["offload_optimizer"]}
        if self.stage_of(o) < 3:
            config["allgather_bucket_size"] = o["allgather_bucket_size"]
        else:
            config["stage3_prefetch_bucket_size"] = o["prefetch_bucket_size"]
            config["stage3_param_persistence_threshold"] = o["param_persistence_threshold"]
            if o["offload_param"] != "none":
                config["offload_param"] = {"device": o["offload_param"]}
        return config

    def wrap(self, spec, context, workload, layers):
        import deepspeed

        precision, recipe = precision_config(spec, self.resolved(spec))
        config = {**base_config(spec, self.layout(spec).micro_batches), **precision,
                  "zero_optimization": self.zero_config(spec)}
        model = nn.Sequential(*checkpointed_blocks(layers, interval_of(self.resolved(spec)))).to(context.device)
        offloaded = self.resolved(spec)["offload_optimizer"] != "none"
        if offloaded:
            optimizer, described = zero_offload_adam(model.parameters())
        else:
            optimizer, described = make_adamw(model.parameters(), context.device), optimizer_description(context.device)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        if compiles(self.resolved(spec)):
            engine.compile()
        zero = engine._config.zero_config
        resolved = {**config, "zero_optimization": {**config["zero_optimization"],
                                                    "overlap_comm": zero.overlap_comm}}
        return DeepSpeedTrainer(context=context, engine=engine, workload=workload, precision_recipe=recipe,
                                loss_scaled=spec.precision is Precision.FP16, spec=spec,
                                config={"deepspeed_config": resolved, **throughput_timer_state(engine), **described})
