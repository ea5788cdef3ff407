"""DeepSpeed AutoTP training: DeepSpeed's own tensor parallelism, beside `tp` (DTensor) on the same model, with
ZeRO 0, 1 or 2 across the replicas (DeepSpeed's launcher).

`deepspeed.initialize` with a `tensor_parallel` section (`autotp_size`, and a `partition_config` whose
`layer_specs` name the workload's layers: DeepSpeed >= 0.16.4) replaces each block's linear layers in place,
Megatron's layout as `tp` lays it out: `c_attn` column-parallel as three sub-parameters (`shape: [3, -1]`, q, k
and v each split by heads, so a rank's slice is its heads' q|k|v, which the block chunks in three), `c_fc`
column-parallel, `attn_proj` and `mlp_proj` row-parallel (LinearAllreduce: partial outputs all-reduced, the bias
whole). A Llama block alike (`llama_layer_specs`): `wqkv` as q, k and v sub-parameters of their own sizes
(grouped-query attention), `w_gate_up` as gate and up, `wo` and `w_down` row-parallel; its untied head stays whole
on every rank, as GPT's tied one does. DeepSpeed lays its ranks out as a (dp, tp) mesh (deepspeed/utils/groups.py
`_init_tp_mesh_device`): a replica's tp ranks are neighbours and see the same samples. Its batch check counts the tp
ranks as data parallel, so `train_batch_size` is left for DeepSpeed to derive (micro-batch x accumulation x its
count).

Everything goes through `torch.distributed` (counted without a dispatch mode): the tensor-parallel all-reduces
in the tp group, ZeRO's reductions among the replicas in the dp group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from harness.derive.comm import Collective
from harness.derive.memory import zero_plan
from harness.spec import Precision, RunSpec
from harness.strategies.base import (ADAMW_STATE_BYTES, ExpectedCollective, ExpectedTraffic, Option, PrecisionRecipe,
                                     Strategy, TrafficBytes, Trainer, half_dtype_names, make_adamw,
                                     optimizer_description)
from harness.strategies.deepspeed_common import (DEEPSPEED_RECIPES, PRECISION_OPTION, base_config, precision_config,
                                                 start_deepspeed, throughput_timer_state)
from harness.strategies.mesh_layout import MeshLayout
from harness.strategies.tensor_parallel import BLOCK_LAYOUTS, activation_all_reduces, split_parameter_count
from harness.strategies.zero import DeepSpeedTrainer, ZeRO, unscaled
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME, checkpointed_blocks, interval_of
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME
from workloads import Family, get_workload

# The GPT block in AutoTP's configurable API (deepspeed/module_inject/autotp_config.py TPLayerSpec), matched against
# parameter names of the nn.Sequential of layers ("3.c_attn.weight").
LAYER_SPECS = [
    {"patterns": [r".*\.c_attn\.weight$", r".*\.c_attn\.bias$"], "partition_type": "column", "shape": [3, -1],
     "partition_dim": 0},
    {"patterns": [r".*\.c_fc\.weight$", r".*\.c_fc\.bias$"], "partition_type": "column"},
    {"patterns": [r".*\.attn_proj\.weight$", r".*\.mlp_proj\.weight$"], "partition_type": "row"},
]


def llama_layer_specs(config) -> list[dict]:
    """The Llama block in the same API: `wqkv` column-parallel as three sub-parameters of unequal sizes (q's n_head
    heads, k's and v's n_kv_head; TPLayerSpec's grouped-query shape), each split by heads so that a rank holds its
    query heads and the key/value heads they read, q|k|v, as the block splits them; `w_gate_up` as two equal ones
    (a rank's gate slice and the matching up slice); `wo` and `w_down` row-parallel. No biases."""
    q_rows, kv_rows = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    return [
        {"patterns": [r".*\.wqkv\.weight$"], "partition_type": "column", "shape": [[q_rows, kv_rows, kv_rows], -1],
         "partition_dim": 0},
        {"patterns": [r".*\.w_gate_up\.weight$"], "partition_type": "column", "shape": [2, -1], "partition_dim": 0},
        {"patterns": [r".*\.wo\.weight$", r".*\.w_down\.weight$"], "partition_type": "row"},
    ]


def layer_specs_of(workload) -> list[dict]:
    """The `layer_specs` of a workload's block: Llama's sizes its sub-parameters from the workload's heads."""
    return llama_layer_specs(workload.config) if workload.family is Family.LLAMA else LAYER_SPECS


# Every family's split layers by submodule name (harness.strategies.tensor_parallel), for `split_by_name`.
COLUMN_PARALLEL = tuple(name for layout in BLOCK_LAYOUTS.values() for name in layout.column)
ROW_PARALLEL = tuple(name for layout in BLOCK_LAYOUTS.values() for name in layout.row)


def split_by_name(name: str) -> bool:
    """Whether AutoTP slices the parameter `name` over the tp ranks: the column-parallel layers' weights and
    biases, the row-parallel layers' weights (their biases are added whole after the all-reduce)."""
    *_, module, kind = name.split(".")
    return module in COLUMN_PARALLEL or (module in ROW_PARALLEL and kind == "weight")


@dataclass
class AutoTPTrainer(DeepSpeedTrainer):
    """DeepSpeed's trainer; parameters and gradients read as parts whose squares add up over every rank: a sliced
    parameter's local slice, a whole one (held alike by a replica's tp ranks) at tp coordinate 0 only; ZeRO's
    gradient fragments on every replica, whole gradients (stage 0) and parameters on replica 0 only."""

    tp_coordinate: int = 0
    replica_index: int = 0
    gradient_norm_after_step = False        # the norm is taken from the parts, not DeepSpeed's own

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name, p in self.engine.module.named_parameters() if p.requires_grad]

    def _keep(self, name: str, replicated_over_dp: bool) -> bool:
        if replicated_over_dp and self.replica_index != 0:
            return False
        return split_by_name(name) or self.tp_coordinate == 0

    def local_parameters(self):
        return [p if self._keep(name, True) else p.new_empty(0) for name, p in self._named()], True

    def local_gradients(self):
        sharded = self.engine.zero_optimization_stage() >= 1
        parts = []
        for name, p in self._named():
            if sharded:     # this rank's fragment of the reduced gradient (DeepSpeedTrainer.local_gradients)
                part = (p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group) if p._hp_mapping is not None
                        else p.new_zeros(0))
            else:
                part = p.grad
            parts.append(part if self._keep(name, not sharded) else p.new_empty(0))
        # As DeepSpeedTrainer's: under the fp16 section they still carry the loss scale its step divides out.
        return unscaled(parts, self.loss_scale_in_gradients()), True

    def gradient_norm(self) -> float:
        return Trainer.gradient_norm(self)

    def parameters_held(self, whole_model: int) -> int:
        return sum(p.numel() for p in self.engine.module.parameters())


class AutoTP(MeshLayout, Strategy):
    name = "autotp"
    launcher = "deepspeed"
    description = "DeepSpeed AutoTP training, Megatron's layout of each block, ZeRO 0/1/2 across (DeepSpeed's launcher)"
    requires = ("deepspeed",)
    precision_recipes = DEEPSPEED_RECIPES
    options = {
        "tp": Option(2, "tensor-parallel ranks (neighbours); world_size / tp replicas", minimum=1),
        "zero_stage": Option(1, "ZeRO stage across the replicas (AutoTP trains with 0, 1 or 2)", choices=(0, 1, 2)),
        OPTION_NAME: ACTIVATION_CHECKPOINTING, ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD, COMPILE_NAME: COMPILE,
        "precision_recipe": PRECISION_OPTION,
    }
    cannot_compile_because = ("DeepSpeed replaces the blocks' layers with its own tensor-parallel ones inside "
                              "initialize, and compiling them is not wired here")

    def start(self, spec):
        return start_deepspeed(spec)

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return ("tensor parallelism's all-reduces sit between a block's matmuls: a rank's slices have no "
                "communication-free run that is the same work")

    def planned_parameters_held(self, spec: RunSpec, layers) -> int:
        return split_parameter_count(layers, self.tp_degree(spec))

    def model_state_plan(self, data_parallel, recipe, options):
        """Stage 0: the client AdamW over this rank's slice, whole; stages 1-2: ZeRO's plan over the replicas
        (its fp32 master partition, K = 12), of the slice."""
        if options["zero_stage"] == 0:
            weights, gradients, optimizer = ADAMW_STATE_BYTES[recipe]
            return zero_plan(0, data_parallel, weights, gradients, optimizer,
                             basis=f"{recipe.value}: torch AdamW over this rank's tensor-parallel slice")
        return ZeRO(stage=options["zero_stage"]).model_state_plan(data_parallel, recipe, options)

    def across_replicas(self, options):
        """ZeRO-1/2 among the replicas; stage 0 all-reduces the gradients once a step, as DDP does."""
        return f"zero{options['zero_stage']}" if options["zero_stage"] else "ddp"

    def usual_mixed_recipe(self):
        """DeepSpeed's bf16 section, as ZeRO's users run it."""
        return PrecisionRecipe.DEEPSPEED_BF16, {"precision_recipe": PrecisionRecipe.DEEPSPEED_BF16.value}

    def working_memory_bytes(self, rank, recipe, options):
        """ZeRO's buckets among the replicas (stages 1-2 at DeepSpeed's default bucket sizes), none at stage 0."""
        if not options["zero_stage"]:
            return {}
        zero = ZeRO(stage=options["zero_stage"])
        return zero.working_memory_bytes(rank, recipe, zero.resolve_options({}))

    def described_traffic_bytes(self, parameters, recipe, options):
        """fp32 among the replicas under torch.autocast too (`expected_traffic`: AutoTP's layers are not exact
        nn.Linear modules, so the torch_autocast section reduces none of their gradients in bf16)."""
        if recipe in (PrecisionRecipe.DEEPSPEED_BF16, PrecisionRecipe.DEEPSPEED_FP16):
            return super().described_traffic_bytes(parameters, recipe, options)
        return TrafficBytes(parameters=parameters, gradients_reduced=4 * parameters, parameters_gathered=4 * parameters)

    def gradient_reduce_dtypes(self, spec: RunSpec, model: nn.Module) -> tuple[str, ...]:
        """As `tp`: under autocast the row-parallel outputs are summed in bf16 (and DeepSpeed's torch_autocast
        section reduces Linear gradients in bf16 under ZeRO)."""
        return (*half_dtype_names(spec), "float32")

    def expected_traffic(self, spec: RunSpec, layers) -> ExpectedTraffic:
        """`tp`'s all-reduces among the tp ranks (LinearAllreduce's forward sums, the column-parallel layers'
        input gradients backward), and ZeRO's collectives among the replicas of this rank's slice, in fp32:
        AutoTP's replacement layers are not exact `nn.Linear`s, so the torch_autocast section reduces none of
        their gradients in bf16 (measured: every dp byte fp32 under bf16 autocast). Stage 0 all-reduces the
        gradients once a step; stages 1-2 as ZeRO-1/2 (harness.strategies.zero)."""
        tp, layout, options = self.tp_degree(spec), self.layout(spec), self.resolved(spec)
        config = get_workload(spec.workload).config
        collectives = activation_all_reduces(
            micro_batch=spec.micro_batch, seq_len=config.seq_len, n_embd=config.n_embd, n_layer=config.n_layer,
            micro_batches=layout.micro_batches, tp=tp, half=spec.precision.is_mixed, group="tp") if tp > 1 else ()
        slice_bytes = 4 * split_parameter_count(layers, tp)
        held = split_parameter_count(layers, tp)
        if options["zero_stage"] == 0:
            replicas = (ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=slice_bytes, calls=1,
                                           ranks=layout.data_parallel),)
        else:
            replicas = ZeRO(stage=options["zero_stage"]).expected_collectives(
                data_parallel=layout.data_parallel, micro_batches=layout.micro_batches, options=options,
                traffic=TrafficBytes(parameters=held, gradients_reduced=slice_bytes,
                                     parameters_gathered=slice_bytes)).collectives
        return ExpectedTraffic(collectives=(*collectives, *(replace(c, group="dp", stride=tp) for c in replicas)))

    def wrap(self, spec, context, workload, layers):
        import deepspeed
        from deepspeed.utils import groups

        from harness.rank.comm_counter import label_group

        options, tp = self.resolved(spec), self.tp_degree(spec)
        precision, recipe = precision_config(spec, self.resolved(spec))
        config = {**base_config(spec, self.layout(spec).micro_batches), **precision,
                  "zero_optimization": {"stage": options["zero_stage"]},
                  "tensor_parallel": {"autotp_size": tp,
                                      "partition_config": {"use_default_specs": False,
                                                           "layer_specs": layer_specs_of(workload)}}}
        if tp == 1:     # nothing to split: DeepSpeed builds no tp group (ZeRO across every rank)
            config.pop("tensor_parallel")
        config.pop("train_batch_size")      # DeepSpeed counts the tp ranks as data parallel: it derives it
        model = nn.Sequential(*checkpointed_blocks(layers, interval_of(options))).to(context.device)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_adamw(model.parameters(), context.device),
                                               config=config)
        if tp > 1:
            label_group(groups.get_tensor_model_parallel_group(), "tp")
            label_group(groups.get_data_parallel_group(), "dp")
        return AutoTPTrainer(context=context, engine=engine, workload=workload, precision_recipe=recipe,
                             loss_scaled=spec.precision is Precision.FP16, spec=spec,
                             tp_coordinate=context.rank % tp, replica_index=context.rank // tp,
                             config={"deepspeed_config": config, "tensor_parallel": tp,
                                     "data_parallel": context.world_size // tp, **throughput_timer_state(engine),
                                     **optimizer_description(context.device)})
