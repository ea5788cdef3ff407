"""DeepSpeed-Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models"), started by DeepSpeed's launcher: each rank of a group of `sp`
ranks holds a contiguous slice of every sample's sequence (harness.strategies.sequence_parallel), and every block's
attention core is wrapped in DeepSpeed's own `deepspeed.sequence.layer.DistributedAttention`, which all-to-alls q, k
and v from (its tokens, every head) to (every token, its heads), runs the core on the whole sequence for the rank's
a / P heads, and all-to-alls the output back. Everything else (embeddings, norms, projections, MLP, head) works on
the rank's tokens alone. The rest runs under DeepSpeed's ZeRO (stage 1, 2 or 3, `zero_stage`) over every rank, its
groups DeepSpeed's own: `deepspeed.runtime.sequence_parallel.parallel_state_sp` handed to `deepspeed.initialize` as
its mpu, as DeepSpeed's Arctic long-sequence training does, so that ZeRO partitions and reduces over the sequence-data-
parallel group (all W ranks) and counts W / P data-parallel replicas in its batch. ZeRO then divides the reduced
gradients by W / P, not W, in stages 1 and 2 (stage_1_and_2.py, `average_tensor`: dp_world_size /
sequence_parallel_size): they sum over the sequence-parallel ranks, each of whose losses is taken to weigh its
tokens' share of the sample, as DeepSpeed's long-sequence training weighs them (its loss: each rank's token losses
summed, over all ranks' tokens). So there each rank's backward starts from its tokens' mean loss times 1 / P
(`token_share`; measured before that weight: every gradient twice the plain loop's at P = 2). Stage 3's default
reduction averages over all W instead (`Ulysses.token_share`), and takes the mean loss as it is.

Grouped-query attention as DeepSpeed splits it: the degree must divide the query heads and the key/value heads
(each rank takes a / P query heads and the a_kv / P key/value heads they read). DeepSpeed also splits an uneven count
(`uneven_heads_all2all`); that path is not built here, and such a cell is refused in one line.

Traffic per optimizer step per rank, K micro-batches of b samples of s tokens, L blocks, a query and a_kv key/value
heads of d values, P ranks a group: per block and micro-batch four all-to-alls forward (q, k, v, the output) and four
backward (their gradients, the reverse exchanges), q's and the output's b s/P a d values each, k's and v's b s/P a_kv d
(`ulysses_all_to_all_sizes`), in the compute dtype (fp32, bf16 under autocast), and the four forward ones again in a
block checkpointed (`activation_checkpointing`: its forward runs again in backward); plus ZeRO's reduction and gather
among all W ranks (harness.strategies.zero). On the wire each all-to-all sends (P - 1) / P of its input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from harness.derive.comm import Collective
from harness.spec import Precision, RunSpec, SpecError
from harness.strategies.base import ExpectedCollective, ExpectedTraffic, Option, make_adamw, optimizer_description
from harness.strategies.checkpointing import (ACTIVATION_CHECKPOINTING, OPTION_NAME, checkpointed_blocks,
                                              count_checkpointed, interval_of)
from harness.strategies.compiling import OPTION_NAME as COMPILE_NAME
from harness.strategies.deepspeed_common import base_config, precision_config, throughput_timer_state
from harness.strategies.sequence_parallel import SequenceGroups, token_indices, ulysses_all_to_all_sizes
from harness.strategies.zero import ZeRO, DeepSpeedTrainer
from workloads import get_workload
from workloads.attention import CausalAttention, set_positions

GROUP_LABEL = "sp"          # the sequence-parallel group's name in the counts


class UlyssesAttention(nn.Module):
    """A block's attention core behind DeepSpeed's DistributedAttention, called as the core is: (batch, seq, heads,
    head_dim) q, k and v of the rank's tokens; its heads' output for them."""

    def __init__(self, core: CausalAttention, group: Any) -> None:
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.core = core
        # (batch, seq, heads, head_dim): scatter the heads (2), gather the sequence (1).
        self.distributed = DistributedAttention(core, group, scatter_idx=2, gather_idx=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.distributed(q, k, v, 0)


@dataclass
class UlyssesTrainer(DeepSpeedTrainer):
    """ZeRO's step over the rank's slice of each micro-batch's sequence (`Ulysses.rank_batch`)."""

    figures: dict[str, Any] = field(default_factory=dict)

    def rank_figures(self) -> dict[str, Any]:
        return {"sequence_parallel": self.figures}


class Ulysses(SequenceGroups, ZeRO):
    """DeepSpeed-Ulysses under ZeRO-1, 2 or 3 (module docstring)."""

    degree_option = "sp"
    checkpoint_method = ""
    cannot_compile_because = ("DeepSpeed's DistributedAttention reshapes by sizes it reads from the process group in "
                              "every block; compiling it is not built here")

    def __init__(self) -> None:
        super().__init__(2)
        self.name = "ulysses"
        self.description = ("DeepSpeed-Ulysses: the sequence split over sp ranks, DistributedAttention's all-to-alls "
                            "around attention, ZeRO-1, 2 or 3 (DeepSpeed's launcher)")
        self.comm_interception = "torch.distributed: DeepSpeed's reductions and DistributedAttention's all_to_all_single"
        kept = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
                "offload_optimizer", "precision_recipe", COMPILE_NAME)
        # Stage 3's own settings beside stages 1-2's: the stage is an option here (ZeRO.zero_config takes each's).
        stage_3 = ZeRO(3).options
        self.options = {"sp": Option(0, "sequence-parallel ranks (DeepSpeed's sequence_parallel_size), each holding "
                                        "1/sp of every sample's tokens (0: every rank)", minimum=0),
                        "zero_stage": Option(2, "ZeRO stage of the rest", choices=(1, 2, 3)),
                        **{name: self.options[name] for name in kept},
                        **{name: stage_3[name] for name in ("prefetch_bucket_size", "param_persistence_threshold",
                                                            "offload_param")},
                        OPTION_NAME: ACTIVATION_CHECKPOINTING}

    def stage_of(self, options) -> int:
        return int(options.get("zero_stage", 2))

    def validate(self, spec: RunSpec) -> None:
        self.check_degree(spec)
        options = self.resolved(spec)
        for name in ("offload_optimizer", "offload_param"):
            if options[name] != "none":
                raise SpecError(f"strategy ulysses: {name} is not built with Ulysses here (allowed: none)")

    def layout_refusal(self, spec: RunSpec) -> str | None:
        why = self.sequence_refusal(spec)
        if why:
            return why
        config, degree = get_workload(spec.workload).config, self.degree(spec)
        kv_heads = getattr(config, "n_kv_head", config.n_head)
        if config.n_head % degree or kv_heads % degree:
            return (f"Ulysses gives each of sp={degree} ranks whole heads: {spec.workload}'s {config.n_head} heads "
                    f"and {kv_heads} key/value heads must both divide by it")
        return None

    def token_share(self, options, degree: int) -> float:
        """What a rank's backward weighs its tokens' mean loss by, so that ZeRO's reduction gives the plain loop's
        gradient (module docstring): DeepSpeed 0.19.8 sums over the sequence-parallel ranks in stages 1-2
        (stage_1_and_2.py divides by W / P on both its paths) and averages over all W in stage 3, whose default path,
        reduce_scatter on, is `__avg_scatter_grads` (reduce_scatter_coalesced, an average over its group; only the
        contiguous path with reduce_scatter off divides by W / P). Measured: gradients 2.0 times the plain loop's in
        ZeRO-2 and 0.5 times in ZeRO-3 with every loss weighed by 1 / 2 at P = 2."""
        return 1.0 if self.stage_of(options) == 3 else 1.0 / degree

    def state_sharding_ranks(self, spec: RunSpec) -> int:
        return spec.world_size          # ZeRO over the sequence-data-parallel group: every rank

    def rank_batch(self, spec: RunSpec, context, batch):
        """The rank's contiguous slice of every sample's tokens and targets."""
        degree = self.degree(spec)
        tokens = token_indices(batch[0].shape[1], degree, context.rank % degree, load_balanced=False)
        return tuple(tensor[:, tokens.to(tensor.device)] for tensor in batch)

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return ("a rank's attention runs on the heads and tokens the all-to-alls bring: without them it has no such "
                "work")

    def all_to_all_sizes(self, spec: RunSpec) -> tuple[int, int]:
        config = get_workload(spec.workload).config
        compute_bytes = 4 if spec.precision is Precision.FP32 else 2
        return ulysses_all_to_all_sizes(micro_batch=spec.micro_batch, seq_len=config.seq_len, heads=config.n_head,
                                        kv_heads=getattr(config, "n_kv_head", config.n_head),
                                        head_dim=config.head_dim, degree=self.degree(spec),
                                        element_bytes=compute_bytes)

    def expected_traffic(self, spec: RunSpec, layers) -> ExpectedTraffic:
        """ZeRO's collectives among all W ranks, and the eight all-to-alls a block and micro-batch in the group: q's
        and the output's (forward and backward: 4 of their size), k's and v's (4 of theirs)."""
        if spec.world_size == 1:
            return ExpectedTraffic()
        options, degree = self.resolved(spec), self.degree(spec)
        micro_batches = self.layout(spec).micro_batches
        zero = self.expected_collectives(data_parallel=spec.world_size, micro_batches=micro_batches, options=options,
                                         traffic=self.traffic_bytes(spec, nn.Sequential(*layers))).collectives
        # Each of the two sizes twice a block (q and the output; k and v), forward and backward, and once more in a
        # checkpointed block's recomputed forward.
        blocks = get_workload(spec.workload).config.n_layer
        calls = (4 * blocks + 2 * count_checkpointed(layers, interval_of(options))) * micro_batches
        query_bytes, kv_bytes = self.all_to_all_sizes(spec)
        exchanges = [ExpectedCollective(collective=Collective.ALL_TO_ALL, size_bytes=size,
                                        calls=calls * (2 if query_bytes == kv_bytes else 1), ranks=degree,
                                        group=GROUP_LABEL)
                     for size in sorted({query_bytes, kv_bytes})]
        return ExpectedTraffic(collectives=(*zero, *exchanges))

    def wrap(self, spec, context, workload, layers):
        import deepspeed
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        from harness.rank.comm_counter import label_group

        options, degree = self.resolved(spec), self.degree(spec)
        parallel_state_sp.initialize_sequence_parallel(degree)
        group = parallel_state_sp.get_sequence_parallel_group()
        label_group(group, GROUP_LABEL)
        for layer in layers:
            for module in layer.modules():
                if isinstance(getattr(module, "attention_core", None), CausalAttention):
                    module.attention_core = UlyssesAttention(module.attention_core, group)
        precision, recipe = precision_config(spec, options)
        config = {**base_config(spec, self.layout(spec).micro_batches), **precision,
                  "zero_optimization": self.zero_config(spec)}
        model = nn.Sequential(*checkpointed_blocks(layers, interval_of(options))).to(context.device)
        model_config = get_workload(spec.workload).config
        seq_len = model_config.seq_len
        coordinate = context.rank % degree
        tokens = token_indices(seq_len, degree, coordinate, load_balanced=False)
        set_positions(model, tokens.to(context.device))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_adamw(model.parameters(), context.device),
                                               config=config, mpu=parallel_state_sp)
        zero = engine._config.zero_config
        resolved = {**config, "zero_optimization": {**config["zero_optimization"], "overlap_comm": zero.overlap_comm}}
        query_bytes, kv_bytes = self.all_to_all_sizes(spec)
        return UlyssesTrainer(
            context=context, engine=engine, workload=workload, precision_recipe=recipe, spec=spec,
            token_share=self.token_share(options, degree),
            # Every rank's core runs the whole sequence for its a / P heads: the causal work is the same on each.
            figures={"tokens_held": [int(tokens[0]), int(tokens[-1]) + 1],
                     "causal_work_by_rank": [model_config.n_head // degree * seq_len * (seq_len + 1) // 2] * degree,
                     "all_to_all_input_bytes": {"query_or_output": query_bytes, "key_or_value": kv_bytes}},
            config={"deepspeed_config": resolved, **throughput_timer_state(engine),
                    **optimizer_description(context.device), "sequence_split": degree, "sequence_attention": "ulysses",
                    "sequence_replicas": context.world_size // degree, "sharding": "contiguous",
                    "sequence_data_parallel_ranks": engine.seq_dp_world_size,
                    "attention": "deepspeed.sequence.layer.DistributedAttention (scatter heads, gather sequence)"})
