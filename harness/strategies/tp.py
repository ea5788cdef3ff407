"""Tensor parallelism with DTensor (`torch.distributed.tensor.parallel`), started by torchrun: every rank
holds a slice of each block's four linear layers and runs the whole batch, Megatron's layout
(harness.strategies.tensor_parallel), of GPT's blocks and Llama's (grouped-query attention: the degree divides the
key/value heads too). The transformer workloads only; a ResNet cell is skipped.

Every rank sees the same samples (one data-parallel replica of world-size ranks), so the global batch, the
micro-batches and the losses are the plain loop's. Embeddings, norms and the head stay whole on every rank and
compute the same values from the same inputs, so their gradients need no reduction.

Traffic per optimizer step per rank, K micro-batches of b samples of s tokens, hidden size h, L blocks:
forward all-reduces each block's two row-parallel outputs, and backward the input gradient of each block's two
column-parallel layers (q, k and v are one fused layer here; Megatron-LM counts the same 2 + 2, sec. 3 of
Shoeybi et al. 2019): 4 L K all-reduces of b s h values among the tensor-parallel ranks. They are DTensor's
functional collectives, counted in the last warm-up step (harness.rank.comm_counter). The 2-D mesh with FSDP2
is `fsdp2-tp` (harness.strategies.fsdp2_tp).

Option `sequence_parallel=true` splits the residual stream along the sequence between the linear layers
(harness.strategies.tensor_parallel; Korthikanti et al. 2022): each of those all-reduces becomes a
reduce-scatter and an all-gather, the head's input and the embedding's gradient are gathered, and the norms'
partial gradients are summed once a step (`sequence_parallel_collectives`). Option `loss_parallel=true`
splits the vocabulary matrices by rows (the tied one; Llama's embedding and untied head alike) and computes the
cross-entropy on the split logits (`vocabulary_parallel_collectives`); the vocabulary must divide by the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from harness.derive.memory import ModelSplit, zero_plan
from harness.spec import DeviceKind, Layout, RunSpec, SpecError
from harness.strategies.base import (ADAMW_STATE_BYTES, ExpectedTraffic, Option, Strategy,
                                     half_dtype_names, make_adamw, optimizer_description, recipe_of,
                                     torchrun_context)
from harness.strategies.loss_scaling import scaler_for
from harness.strategies.plain import PlainTrainer
from harness.strategies.tensor_parallel import (SlicedParameters, activation_all_reduces, merge_collectives,
                                                parallelize_blocks, partial_gradient_sizes, reduce_partial_gradients,
                                                sequence_parallel_collectives, split_parameter_count,
                                                vocabulary_parallel_collectives)
from harness.strategies.state_checkpoint import CHECKPOINT, OPTION_NAME as CHECKPOINT_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME, blocks_as_run
from harness.strategies.mesh_layout import blocks_refusal, heads_refusal
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME
from workloads import get_workload

MESH_DIMENSION = "tp"     # the mesh's one dimension, and the group's name in the counts


@dataclass
class TPTrainer(SlicedParameters, PlainTrainer):
    """The plain loop's step (nothing to reduce: every gradient is whole or a rank's own slice, but for the
    partial sums sequence parallelism leaves), its parameters and gradients read as tensor-parallel slices."""

    tp_coordinate: int = 0
    loss_parallel: bool = False

    def train_step(self, micro_batches, gradients_ready=None):
        if not self.loss_parallel:
            return super().train_step(micro_batches, gradients_ready)
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():       # the cross-entropy of logits split over the vocabulary, and its backward
            return super().train_step(micro_batches, gradients_ready)

    def finish_gradients(self) -> None:
        reduce_partial_gradients(self._trainable())

    def parameters_held(self, whole_model: int) -> int:
        from torch.distributed.tensor import DTensor

        return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in self._trainable())


class TensorParallel(Strategy):
    name = "tp"
    launcher = "torchrun"
    checkpoint_method = "dcp"
    description = "DTensor tensor parallelism, Megatron's layout of each block (torchrun)"
    comm_interception = ("torch.distributed collectives, and DTensor's functional collectives in the last "
                         "warm-up step (a dispatch mode)")
    options = {OPTION_NAME: ACTIVATION_CHECKPOINTING, CHECKPOINT_NAME: CHECKPOINT,
               ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD, COMPILE_NAME: COMPILE,
               "sequence_parallel": Option(False, "split the residual stream along the sequence between the "
                                                  "linear layers (Korthikanti et al. 2022): reduce-scatters and "
                                                  "all-gathers in place of the all-reduces"),
               "loss_parallel": Option(False, "split the vocabulary matrices by rows, the embedding's lookups "
                                              "and the head's logits with it, and compute the cross-entropy on "
                                              "the split logits (torch's loss_parallel)")}

    def validate(self, spec: RunSpec) -> None:
        if spec.warmup_steps < 1:
            raise SpecError(f"strategy {self.name} needs --warmup-steps >= 1: its collectives are counted in the "
                            "last warm-up step")

    def layout_refusal(self, spec: RunSpec) -> str | None:
        workload = get_workload(spec.workload)
        why = blocks_refusal(spec.workload) or heads_refusal(spec.workload, spec.world_size)
        if why:
            return why
        tokens = workload.config.seq_len
        if self.resolved(spec).get("sequence_parallel") and tokens % spec.world_size:
            return (f"sequence parallelism of {spec.world_size} must divide {spec.workload}'s sequence of "
                    f"{tokens} tokens")
        # The vocabulary matrices are split by rows, and they have the padded count (GPT-2's 50,257 tokens in
        # 50,304 rows, workloads/gpt.py): it is the rows that must divide.
        rows = workload.config.padded_vocab_size
        if self.resolved(spec).get("loss_parallel") and rows % spec.world_size:
            return (f"loss parallelism of {spec.world_size} must divide {spec.workload}'s vocabulary of "
                    f"{rows} rows ({workload.config.vocab_size} tokens, padded)")
        if spec.device is DeviceKind.CUDA and spec.nnodes > 1:
            return "tensor parallelism's all-reduces sit inside every layer: it runs within one node"
        return None

    def layout(self, spec: RunSpec) -> Layout:
        return Layout(data_parallel=1, pipeline_stages=1, per_replica_batch=spec.global_batch,
                      micro_batches=max(1, spec.global_batch // spec.micro_batch))

    def replica(self, spec, context) -> int:
        return 0            # every rank is part of the one replica: the same samples

    def instrument(self, counter) -> None:
        counter.install_torch()
        counter.install_functional()

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return ("tensor parallelism's all-reduces sit between a block's matmuls: a rank's slices have no "
                "communication-free run that is the same work")

    def model_split(self, replicas, tensor_parallel, options) -> ModelSplit:
        """One replica of `tensor_parallel` ranks, whatever `replicas` asks: every rank sees the same samples."""
        return ModelSplit(data_parallel=1, tensor_parallel=tensor_parallel)

    def model_state_plan(self, data_parallel, recipe, options):
        """Nothing sharded beyond what each rank holds: its slices of the split layers and the rest whole, all
        counted in the parameters it holds (`parameters_held`), with torch AdamW's 4 + 4 + 8 bytes each."""
        weights, gradients, optimizer = ADAMW_STATE_BYTES[recipe]
        return zero_plan(0, 1, weights, gradients, optimizer,
                         basis=f"{recipe.value}: torch AdamW over this rank's slices of the split layers and the "
                               "whole of the rest")

    def expected_traffic(self, spec: RunSpec, layers) -> ExpectedTraffic:
        if spec.world_size == 1:
            return ExpectedTraffic()
        config = get_workload(spec.workload).config
        shape = dict(micro_batch=spec.micro_batch, seq_len=config.seq_len, n_embd=config.n_embd,
                     n_layer=config.n_layer, micro_batches=self.layout(spec).micro_batches, tp=spec.world_size,
                     half=spec.precision.is_mixed, group=MESH_DIMENSION)
        options = self.resolved(spec)
        if options.get("sequence_parallel"):
            collectives = sequence_parallel_collectives(**shape, partial_gradients=partial_gradient_sizes(layers))
        else:
            collectives = activation_all_reduces(**shape)
        if options.get("loss_parallel"):
            collectives = merge_collectives([*collectives, *vocabulary_parallel_collectives(
                micro_batch=spec.micro_batch, seq_len=config.seq_len, n_embd=config.n_embd,
                micro_batches=shape["micro_batches"], tp=spec.world_size, group=MESH_DIMENSION,
                sequence_parallel=bool(options.get("sequence_parallel")))])
        return ExpectedTraffic(collectives=tuple(collectives))

    def planned_parameters_held(self, spec: RunSpec, layers) -> int:
        return split_parameter_count(layers, spec.world_size,
                                     vocabulary=bool(self.resolved(spec).get("loss_parallel")))

    def gradient_reduce_dtypes(self, spec: RunSpec, model: nn.Module) -> tuple[str, ...]:
        """No gradient is reduced, but under autocast the row-parallel outputs are summed over the ranks in
        bf16 (their input gradients in fp32; measured: 32 all-reduces of each on gpt-tiny at TP 2): rounding
        that reaches the gradients as a bf16 gradient reduction's does, so parity holds such rows to its
        `bf16-comm` tolerances (gpt-tiny TP 2: gradient norm 1.1e-5 and a tensor's up to 1.2e-3 off the plain
        loop, against 1.3e-7 and 1.2e-6 for a reduction in fp32)."""
        return (*half_dtype_names(spec), "float32")

    def start(self, spec):
        return torchrun_context(spec.device)

    def wrap(self, spec, context, workload, layers):
        from torch.distributed.device_mesh import init_device_mesh

        from harness.rank.comm_counter import label_group

        model = nn.Sequential(*layers).to(context.device)
        mesh = init_device_mesh(context.device.type, (context.world_size,), mesh_dim_names=(MESH_DIMENSION,))
        label_group(mesh.get_group(MESH_DIMENSION), MESH_DIMENSION)
        sequence_parallel = bool(self.resolved(spec).get("sequence_parallel"))
        loss_parallel = bool(self.resolved(spec).get("loss_parallel"))
        blocks = parallelize_blocks(list(model), mesh, sequence_parallel=sequence_parallel,
                                    loss_parallel=loss_parallel)
        # Checkpointing, then compile, wraps the blocks tensor parallelism has split (torchtitan's order).
        model = nn.Sequential(*blocks_as_run(list(model), self.resolved(spec)))
        return TPTrainer(context=context, model=model, optimizer=make_adamw(model.parameters(), context.device),
                         workload=workload, spec=spec, precision_recipe=recipe_of(spec),
                         scaler=scaler_for(spec, context.device, mixed_tensors=True), tp_coordinate=context.rank,
                         loss_parallel=loss_parallel,
                         config={"tensor_parallel": context.world_size, "split_blocks": len(blocks),
                                 "sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel,
                                 **optimizer_description(context.device)})
