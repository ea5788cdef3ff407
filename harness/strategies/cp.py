"""PyTorch context parallelism (`torch.distributed.tensor.experimental.context_parallel`: ring attention, Liu et al.
2023) under FSDP2, as torchtitan runs long sequences, started by torchrun. Each rank of a group of `cp` ranks holds
2 of 2 cp chunks of every sample's sequence, load-balanced for the causal mask (torch's head-tail balancer:
harness.strategies.sequence_parallel); inside `context_parallel` each rank keeps its queries and the ring passes the
key/value blocks round the group, so that every query meets every earlier key. The model's parameters are sharded by
FSDP2 over all W ranks (torchtitan's dp_shard x cp mesh, flattened), whose reduce-scatter averages the gradients over
them: each rank's loss being its tokens' mean, that is the plain loop's gradient.

The ring's rotation is an option (`rotate_method`, torch's `set_rotate_method`): "allgather" gathers every rank's
keys and values once a block (each rank then holds all of them), "alltoall" passes them on one neighbour at a time
(cp - 1 exchanges, each of one rank's key/value block).

Where it runs: torch 2.13's context parallelism handles the CUDA attention kernels alone (flash, memory-efficient and
cuDNN: `_sdpa_handler` in torch/distributed/tensor/experimental/_context_parallel/_attention.py); the CPU's kernel
(`_scaled_dot_product_flash_attention_for_cpu`) has no sharding strategy, so a CPU cell is skipped with that reason
(measured: both rotation methods fail there so).

Traffic per optimizer step per rank, K micro-batches of b samples of s tokens, L blocks, a_kv key/value heads of d
values, P ranks a group: FSDP2's gathers and reduce-scatters among all W ranks (harness.strategies.fsdp2); in each
block and micro-batch the keys and values of the rank's s / P tokens (one block, 2 b s/P a_kv d values,
`ring_exchange_bytes`) go round the ring forward and again backward (torch 2.13, `_templated_ring_attention` and its
backward): under "allgather" one all-gather of the P blocks each time, under "alltoall" P - 1 passes of one block
(`permute_tensor`, an all_to_all_single); backward also passes the key/value gradients on at each of the ring's P
steps, as all-to-alls under either method, accumulated in fp32 (`_cp_options.convert_to_f32`); a checkpointed
block's recomputed forward passes the keys and values once more. Read from torch's
source, not measured: no CPU runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from harness.derive.comm import Collective
from harness.spec import DeviceKind, Precision, RunSpec
from harness.strategies.base import (ExpectedCollective, ExpectedTraffic, Option, make_adamw, optimizer_description,
                                     recipe_of)
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME, count_checkpointed, interval_of
from harness.strategies.compiling import OPTION_NAME as COMPILE_NAME, blocks_as_run
from harness.strategies.fsdp2 import FSDP2, FSDP2Trainer
from harness.strategies.loss_scaling import scaler_for
from harness.strategies.sequence_parallel import SequenceGroups, causal_work_by_rank
from workloads import get_workload
from workloads.attention import set_positions

GROUP_LABEL = "cp"
ROTATE_METHODS = ("allgather", "alltoall")
CPU_REFUSAL = ("torch's context parallelism handles the CUDA attention kernels alone (flash, memory-efficient, cuDNN: "
               "_sdpa_handler, torch/distributed/tensor/experimental/_context_parallel/_attention.py); the CPU's "
               "_scaled_dot_product_flash_attention_for_cpu has no sharding strategy")


def ring_exchange_bytes(*, micro_batch: int, seq_len: int, kv_heads: int, head_dim: int, degree: int,
                        element_bytes: int) -> int:
    """The bytes of one rank's key/value block (its s / P tokens' keys and values), what the ring passes on."""
    return 2 * micro_batch * (seq_len // degree) * kv_heads * head_dim * element_bytes


@dataclass
class ContextParallelTrainer(FSDP2Trainer):
    """FSDP2's step with each micro-batch's forward and backward inside torch's context_parallel."""

    cp_mesh: Any = None
    figures: dict[str, Any] = field(default_factory=dict)

    def around(self, batch):
        """The micro-batch's forward and backward inside torch's context_parallel, which shards its tokens, targets and
        positions along the sequence, in place, as the ring's load balancer cuts them."""
        from torch.distributed.tensor.experimental import context_parallel

        # context_parallel resizes its buffers in place: fresh tensors, none requiring grad.
        inputs, targets = (tensor.clone() for tensor in batch)
        positions = torch.arange(inputs.shape[1], device=inputs.device)
        set_positions(self.model, positions)
        return context_parallel(self.cp_mesh, buffers=[inputs, targets, positions], buffer_seq_dims=[1, 1, 0],
                                no_restore_buffers={inputs, targets, positions}), (inputs, targets)

    def rank_figures(self) -> dict[str, Any]:
        return {"sequence_parallel": self.figures}


class ContextParallel(SequenceGroups, FSDP2):
    """Ring attention over `cp` ranks, FSDP2 over all of them (module docstring)."""

    name = "cp"
    launcher = "torchrun"
    checkpoint_method = ""
    degree_option = "cp"
    load_balanced = True
    description = "torch context parallelism: ring attention over cp ranks, FSDP2 over all (torchrun)"
    comm_interception = "torch.distributed: FSDP2's collectives and the ring's key/value exchanges"
    cannot_compile_because = "torch's context_parallel swaps attention's kernel at run time; compiling it is not built here"

    def __init__(self) -> None:
        kept = ("reshard_after_forward", "mixed_precision", "gradient_sync", COMPILE_NAME)
        self.options = {"cp": Option(0, "context-parallel ranks, each holding 2 of 2 cp chunks of every sample's "
                                        "tokens (0: every rank)", minimum=0),
                        "rotate_method": Option("allgather", "how the ring passes keys and values (torch's "
                                                "set_rotate_method)", choices=ROTATE_METHODS),
                        **{name: FSDP2.options[name] for name in kept}, OPTION_NAME: ACTIVATION_CHECKPOINTING}

    def validate(self, spec: RunSpec) -> None:
        self.check_degree(spec)

    def layout_refusal(self, spec: RunSpec) -> str | None:
        return self.sequence_refusal(spec)

    def skip_reason(self, spec: RunSpec, machine=None) -> str | None:
        why = super().skip_reason(spec, machine)
        if why is None and spec.device is DeviceKind.CPU:
            return CPU_REFUSAL
        return why

    def state_sharding_ranks(self, spec: RunSpec) -> int:
        return spec.world_size          # FSDP2 over every rank

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return "a rank's attention runs on the keys and values the ring brings: without it, it has no such work"

    def expected_traffic(self, spec: RunSpec, layers) -> ExpectedTraffic:
        """FSDP2's collectives among all W ranks, and the ring's key/value exchanges in the group, forward and
        backward (module docstring)."""
        if spec.world_size == 1:
            return ExpectedTraffic()
        options, degree = self.resolved(spec), self.degree(spec)
        micro_batches = self.layout(spec).micro_batches
        fsdp = self.expected_collectives(data_parallel=spec.world_size, micro_batches=micro_batches, options=options,
                                         traffic=self.traffic_bytes(spec, nn.Sequential(*layers))).collectives
        config = get_workload(spec.workload).config
        shape = dict(micro_batch=spec.micro_batch, seq_len=config.seq_len,
                     kv_heads=getattr(config, "n_kv_head", config.n_head), head_dim=config.head_dim, degree=degree)
        block = ring_exchange_bytes(**shape, element_bytes=4 if spec.precision is Precision.FP32 else 2)
        gradient_block = ring_exchange_bytes(**shape, element_bytes=4)      # accumulated in fp32 (convert_to_f32)
        blocks = config.n_layer * micro_batches
        recomputed = count_checkpointed(layers, interval_of(options)) * micro_batches     # a forward's gather again

        def exchange(kind: Collective, size: int, calls: int) -> ExpectedCollective:
            return ExpectedCollective(collective=kind, size_bytes=size, calls=calls, ranks=degree, group=GROUP_LABEL)

        # The key/value gradients go round as all-to-alls under either method: one each of the ring's P steps.
        ring = [exchange(Collective.ALL_TO_ALL, gradient_block, degree * blocks)]
        if options["rotate_method"] == "allgather":         # forward's gather and backward's again
            ring.append(exchange(Collective.ALL_GATHER, block * degree, 2 * blocks + recomputed))
        else:                                               # P - 1 passes forward and again backward
            ring.append(exchange(Collective.ALL_TO_ALL, block, (degree - 1) * (2 * blocks + recomputed)))
        return ExpectedTraffic(collectives=(*fsdp, *ring))

    def wrap(self, spec, context, workload, layers):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        from harness.rank.comm_counter import label_group
        from harness.strategies.base import AUTOCAST_DTYPES, PrecisionRecipe, is_block

        options, degree = self.resolved(spec), self.degree(spec)
        mesh = init_device_mesh(context.device.type, (context.world_size // degree, degree),
                                mesh_dim_names=("dp", "cp"))
        label_group(mesh.get_group("cp"), GROUP_LABEL)
        set_rotate_method(options["rotate_method"])
        world = init_device_mesh(context.device.type, (context.world_size,))
        shard_kwargs: dict[str, Any] = {"mesh": world, "reshard_after_forward": options["reshard_after_forward"]}
        recipe, run_spec = recipe_of(spec), spec
        if self._policy(spec):
            shard_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPES[spec.precision],
                                                             reduce_dtype=torch.float32)
            recipe, run_spec = PrecisionRecipe.FSDP_MP_POLICY, spec.replace(precision=Precision.FP32)
        model = nn.Sequential(*blocks_as_run(layers, options)).to(context.device)
        for block in (layer for layer in model if is_block(layer)):
            fully_shard(block, **shard_kwargs)
        fully_shard(model, **shard_kwargs)
        seq_len = get_workload(spec.workload).config.seq_len
        return ContextParallelTrainer(
            context=context, model=model, optimizer=make_adamw(model.parameters(), context.device), workload=workload,
            spec=run_spec, precision_recipe=recipe, scaler=scaler_for(spec, context.device),
            sync_every_micro_batch=options["gradient_sync"] == "every", cp_mesh=mesh["cp"],
            # Query-key pairs of a head each rank's queries attend to: the head-tail chunks even them out.
            figures={"causal_work_by_rank": causal_work_by_rank(seq_len, degree, load_balanced=True)},
            config={**options, "sequence_split": degree, "sequence_attention": "ring", "sequence_replicas": context.world_size // degree,
                    "sharding": "head-tail load-balanced (2 chunks a rank)", **optimizer_description(context.device)})
