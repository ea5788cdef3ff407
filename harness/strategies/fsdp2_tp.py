"""2-D parallelism: tensor parallelism inside, FSDP2 across, on one `(dp, tp)` device mesh (torchrun). The
plan and its order are torchtitan's 2-D recipe (`apply_tp`, then `fully_shard` on the dp mesh; torchtitan
v0.2.2, torchtitan/models/llama3/infra/parallelize.py): every GPT or Llama block put in Megatron's layout over the
`tp` ranks (harness.strategies.tensor_parallel), then each block and the root sharded by FSDP2 over the `dp` ranks.

The mesh is (world size / tp, tp), row-major as `init_device_mesh` lays it out: rank = dp index x tp + tp
index, so the `tp` ranks of one replica are neighbours (one node's GPUs) and see the same samples. The
transformer workloads only; ResNet cells are skipped.

Traffic per optimizer step per rank, K micro-batches per replica: tensor parallelism's 4 L K activation
all-reduces among the tp ranks (harness.strategies.tensor_parallel.activation_all_reduces), and FSDP2's
calls among the dp ranks, one per unit (each block, and the root holding the embeddings, the final norm and
the head), each of the parameters this rank's tp slice holds of that unit (the split layers divided by tp, the
rest whole), in fp32: every unit all-gathered twice per micro-batch (forward, and again in backward after being
freed; once with reshard_after_forward off), and every unit's gradient reduce-scattered once, on the last
micro-batch (after every micro-batch with `gradient_sync=every`, as `fsdp2` takes it).
`reshard_after_forward` is passed to every unit, the root included, as `fsdp2` passes it, so that
the two shard alike (fully_shard's own default would keep the root gathered from forward to backward, as
torchtitan leaves it: measured, K x (2 x 4 + 1) all-gathers on gpt-tiny instead of K x (2 x 4 + 2)). At dp 1 FSDP2
issues none (measured: gpt-tiny at tp 2, world size 2, counted only the 64 tensor-parallel all-reduces).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from harness.derive.comm import Collective
from harness.derive.memory import zero_plan
from harness.spec import RunSpec
from harness.strategies.base import (ADAMW_STATE_BYTES, ExpectedCollective, ExpectedTraffic, Option, is_block,
                                     make_adamw, optimizer_description, recipe_of)
from harness.strategies.loss_scaling import scaler_for
from harness.strategies.fsdp2 import (GRADIENT_SYNC, GRADIENT_SYNC_NAME, FSDP2Trainer, fully_shard_working_memory,
                                     reduce_scatters_a_step)
from harness.strategies.mesh_layout import MeshLayout
from harness.strategies.tensor_parallel import (SlicedParameters, activation_all_reduces, parallelize_blocks,
                                                split_parameter_count)
from harness.strategies.tp import TensorParallel
from harness.strategies.state_checkpoint import CHECKPOINT, OPTION_NAME as CHECKPOINT_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME, blocks_as_run
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME
from workloads import get_workload

TP, DP = "tp", "dp"       # the mesh's dimensions, and the groups' names in the counts


@dataclass
class FSDP2TPTrainer(SlicedParameters, FSDP2Trainer):
    """FSDP2's trainer (accumulation with gradient sync off but on the last micro-batch), its parameters and
    gradients read as tensor-parallel slices."""

    tp_coordinate: int = 0

    def parameters_held(self, whole_model: int) -> int:
        """Parameters of this rank's tensor-parallel slice before FSDP2 shards it over the dp ranks: its local
        DTensor pieces times the dp ranks sharing them (no padding on the workloads' shapes)."""
        from torch.distributed.tensor import DTensor

        held = 0
        for p in self._trainable():
            names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
            dp_shards = p.device_mesh.size(names.index(DP)) if DP in names else 1
            held += (p.to_local().numel() if isinstance(p, DTensor) else p.numel()) * dp_shards
        return held


class FSDP2TensorParallel(MeshLayout, TensorParallel):
    """`tp` (its counting, its bf16 tolerances, its want of a compute-only pass) with FSDP2 across the replicas."""

    name = "fsdp2-tp"
    description = "2-D: DTensor tensor parallelism inside, FSDP2 across, on a (dp, tp) mesh (torchrun)"
    options = {OPTION_NAME: ACTIVATION_CHECKPOINTING, CHECKPOINT_NAME: CHECKPOINT,
               ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD, COMPILE_NAME: COMPILE,
               "tp": Option(2, "tensor-parallel ranks (neighbours); world_size / tp replicas are sharded by "
                               "FSDP2", minimum=1),
               # As `fsdp2` passes it, to every unit the root included: the two strategies shard alike.
               "reshard_after_forward": Option(True, "free gathered parameters after forward, the root's too "
                                               "(ZeRO-3 behaviour); False keeps them until backward"),
               GRADIENT_SYNC_NAME: GRADIENT_SYNC}

    def validate(self, spec: RunSpec) -> None:
        MeshLayout.validate(self, spec)
        TensorParallel.validate(self, spec)        # the warm-up step that counts DTensor's collectives

    def model_state_plan(self, data_parallel, recipe, options):
        """FSDP2 shards weights, gradients and AdamW state of this rank's tensor-parallel slice (counted in
        `parameters_held`) over the dp ranks, like ZeRO-3, in the parameters' fp32."""
        weights, gradients, optimizer = ADAMW_STATE_BYTES[recipe]
        return zero_plan(3, data_parallel, weights, gradients, optimizer,
                         basis=f"{recipe.value}: torch AdamW over fully_shard's fp32 shards of this rank's "
                               "tensor-parallel slice, all three sharded over the dp ranks")

    def across_replicas(self, options):
        return "fsdp2"          # fully_shard over the dp ranks, of each rank's tensor-parallel slice

    def working_memory_bytes(self, rank, recipe, options):
        """FSDP2's (harness.strategies.fsdp2.fully_shard_working_memory) over this rank's tensor-parallel slice, in
        the parameters' own fp32 (this strategy runs torch.autocast, not the MixedPrecisionPolicy)."""
        return fully_shard_working_memory(rank, ADAMW_STATE_BYTES[recipe][0], options)

    def expected_traffic(self, spec: RunSpec, layers) -> ExpectedTraffic:
        tp, layout, config = self.tp_degree(spec), self.layout(spec), get_workload(spec.workload).config
        collectives = ()
        if tp > 1:
            collectives = activation_all_reduces(
                micro_batch=spec.micro_batch, seq_len=config.seq_len, n_embd=config.n_embd, n_layer=config.n_layer,
                micro_batches=layout.micro_batches, tp=tp, half=spec.precision.is_mixed, group=TP)
        if layout.data_parallel == 1:       # FSDP2 skips its collectives over a group of one rank
            return ExpectedTraffic(collectives=collectives)
        # One call per FSDP2 unit: each block, then the root holding the rest (embeddings, final norm, head).
        units = Counter(4 * split_parameter_count([layer], tp) for layer in layers if is_block(layer))
        root_bytes = 4 * split_parameter_count([layer for layer in layers if not is_block(layer)], tp)
        units[root_bytes] += 1
        gathered = 2 if self.resolved(spec)["reshard_after_forward"] else 1       # forward, and again backward
        gathers = [ExpectedCollective(collective=Collective.ALL_GATHER, size_bytes=size,
                                      calls=gathered * layout.micro_batches * count, ranks=layout.data_parallel,
                                      group=DP, stride=tp)
                   for size, count in sorted(units.items()) if count]
        reduced = reduce_scatters_a_step(self.resolved(spec), layout.micro_batches)
        reduces = [ExpectedCollective(collective=Collective.REDUCE_SCATTER, size_bytes=size, calls=reduced * count,
                                      ranks=layout.data_parallel, group=DP, stride=tp)
                   for size, count in sorted(units.items()) if count]
        return ExpectedTraffic(collectives=(*collectives, *gathers, *reduces))

    def planned_parameters_held(self, spec: RunSpec, layers) -> int:
        """This rank's tensor-parallel slice, before FSDP2 shards it over the dp ranks."""
        return split_parameter_count(layers, self.tp_degree(spec))

    def wrap(self, spec, context, workload, layers):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from harness.rank.comm_counter import label_group

        tp = self.tp_degree(spec)
        mesh = init_device_mesh(context.device.type, (context.world_size // tp, tp), mesh_dim_names=(DP, TP))
        label_group(mesh.get_group(TP), TP)
        label_group(mesh.get_group(DP), DP)
        model = nn.Sequential(*layers).to(context.device)
        blocks = parallelize_blocks(list(model), mesh[TP])
        # torchtitan's order: tensor parallelism, then checkpointing and compile, then fully_shard.
        model = nn.Sequential(*blocks_as_run(list(model), self.resolved(spec)))
        reshard = self.resolved(spec)["reshard_after_forward"]
        for layer in model:
            if is_block(layer):
                fully_shard(layer, mesh=mesh[DP], reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh[DP], reshard_after_forward=reshard)
        return FSDP2TPTrainer(context=context, model=model, optimizer=make_adamw(model.parameters(), context.device),
                              workload=workload, spec=spec, precision_recipe=recipe_of(spec),
                              sync_every_micro_batch=self.resolved(spec)[GRADIENT_SYNC_NAME] == "every",
                              # FSDP2's scaler shares its overflow verdict over the dp ranks, not the tp ranks: an
                              # inf in one tp rank's shard alone left that rank skipping and the other stepping
                              # (measured), so the verdict is summed over every rank.
                              scaler=scaler_for(spec, context.device, mixed_tensors=True),
                              tp_coordinate=context.rank % tp,
                              config={"tensor_parallel": tp, "data_parallel": context.world_size // tp,
                                      "reshard_after_forward": reshard,
                                      "split_blocks": len(blocks), "sharded_units": len(blocks) + 1,
                                      **optimizer_description(context.device)})
