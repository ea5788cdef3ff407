"""What the strategies that split one sample's sequence over ranks share (`ulysses`, DeepSpeed's; `cp`, torch's ring
attention): the groups, the batch's layout, a rank's tokens and their positions, and the refusals.

Ranks form groups of `degree` consecutive ranks (the option, 0: every rank). The ranks of a group see the same samples
(one data-parallel replica: `rank // degree`), each its own slice of every sample's sequence, so the world's W ranks
are W / degree replicas, and the global batch, its micro-batches and the plain loop's losses are those of W / degree
data-parallel replicas. A rank's loss is the mean over its slice's tokens; every slice has as many tokens, so the mean
of the ranks' losses is the whole batch's, and the mean of their gradients (over all W ranks: ZeRO's sequence-data-
parallel group, FSDP2's mesh) is the plain loop's.

Which tokens a rank holds:
- contiguous (Ulysses): rank r of the group the r-th of `degree` equal slices; its attention gathers the whole
  sequence (for its heads), so no slice has more causal work than another;
- load-balanced (the causal ring: torch's `_HeadTailLoadBalancer`, torchtitan's default): the sequence cut into
  2 x degree chunks, rank r holding chunks r and 2 degree - 1 - r, so that each rank's queries see as many earlier
  keys (`causal_work_by_rank`, recorded: the ring without it leaves the last rank degree x the first's work).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.spec import Layout, RunSpec, SpecError
from workloads import Family, get_workload

SEQUENCE_FAMILIES = (Family.GPT, Family.LLAMA)


class SequenceGroups:
    """A strategy's sequence-parallel groups: `degree_option` names the option holding their size."""

    degree_option: str = "sp"
    # Whether the sequence is cut into 2 x degree chunks for the causal ring's balance (`cp`), not degree slices.
    load_balanced: bool = False

    def degree(self, spec: RunSpec) -> int:
        return self.sequence_split_degree(spec.world_size, self.resolved(spec))

    def sequence_split_degree(self, world_size: int, options) -> int:
        return int(options.get(self.degree_option, 0)) or world_size

    def check_degree(self, spec: RunSpec) -> None:
        degree = self.degree(spec)
        if spec.world_size % degree:
            raise SpecError(f"strategy {self.name}: {self.degree_option}={degree} must divide the world size "
                            f"{spec.world_size}")

    def layout(self, spec: RunSpec) -> Layout:
        replicas = spec.world_size // self.degree(spec)
        per_replica = spec.global_batch // replicas
        return Layout(data_parallel=replicas, pipeline_stages=1, per_replica_batch=per_replica,
                      micro_batches=max(1, per_replica // spec.micro_batch))

    def replica(self, spec: RunSpec, context) -> int:
        return context.rank // self.degree(spec)

    def sequence_refusal(self, spec: RunSpec) -> str | None:
        """Why `spec`'s model cannot have its sequence split over the degree, or None."""
        workload = get_workload(spec.workload)
        if workload.family not in SEQUENCE_FAMILIES:
            return (f"sequence parallelism splits a decoder's sequence: {spec.workload} is a "
                    f"{workload.family.value} model (allowed: the gpt and llama families)")
        degree, tokens = self.degree(spec), workload.config.seq_len
        if degree < 2:
            return f"{self.name} splits a sequence over {self.degree_option} >= 2 ranks: this cell has {degree}"
        pieces = 2 * degree if self.load_balanced else degree
        if tokens % pieces:
            what = f"2 x {self.degree_option}={degree} chunks" if self.load_balanced else \
                f"{self.degree_option}={degree} slices"
            return f"{spec.workload}'s sequence of {tokens} tokens does not split into {what}"
        return None


def token_indices(seq_len: int, degree: int, coordinate: int, load_balanced: bool) -> torch.Tensor:
    """The places in a `seq_len`-token sequence of the tokens rank `coordinate` of a group of `degree` holds (module
    docstring), in the order it holds them."""
    if not load_balanced:
        share = seq_len // degree
        return torch.arange(coordinate * share, (coordinate + 1) * share)
    chunk = seq_len // (2 * degree)
    first, second = coordinate, 2 * degree - 1 - coordinate
    return torch.cat((torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)))


def causal_work_by_rank(seq_len: int, degree: int, load_balanced: bool) -> list[int]:
    """Query-key pairs each rank's queries attend to under the causal mask (query at place p sees p + 1 keys): the
    load balance of the causal split, recorded in a row."""
    return [int((token_indices(seq_len, degree, r, load_balanced) + 1).sum()) for r in range(degree)]


def shard_boundaries(seq_len: int, degree: int, load_balanced: bool) -> tuple[int, ...]:
    """The places in the whole sequence where one rank's tokens end and another's begin: where a causal mask's
    error between shards sits (workloads.attention's planted leak)."""
    pieces = 2 * degree if load_balanced else degree
    return tuple(seq_len // pieces * index for index in range(1, pieces))


def sequence_groups(rank: int, world_size: int, degree: int, label: str) -> Any:
    """This rank's group of `degree` consecutive ranks, a process group of its own labelled `label` in the counts
    (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    from harness.rank.comm_counter import label_group

    mine = None
    for first in range(0, world_size, degree):
        group = dist.new_group(list(range(first, first + degree)))
        if first <= rank < first + degree:
            mine = group
    label_group(mine, label)
    return mine


def ulysses_all_to_all_sizes(*, micro_batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                             degree: int, element_bytes: int) -> tuple[int, int]:
    """The bytes of one all-to-all's input on a rank (the counter's size, nccl-tests' send buffer) around Ulysses'
    attention core: (q's and the output's, k's and v's). A rank's q is b x s/P x a x d values (its tokens, every
    head), as is the output sent back (b x s x a/P x d: every token, its heads); k and v b x s/P x a_kv x d."""
    tokens = micro_batch * seq_len // degree
    return tokens * heads * head_dim * element_bytes, tokens * kv_heads * head_dim * element_bytes


def plant_causal_leak(layers, spec: RunSpec, strategy: Any) -> None:
    """Make every attention core's causal mask leak one future key at each shard boundary (harness.rank.faults,
    `causal-leak`); ValueError where it would plant nothing a run could show (a planted bug that plants none would
    pass parity and prove nothing): a cell that does not split the sequence, or whose attention does not see the
    whole sequence in order (the ring's, which keeps its own mask)."""
    from workloads.attention import attention_cores

    if not isinstance(strategy, SequenceGroups) or strategy.load_balanced:
        raise ValueError("the planted causal-leak bug needs a sequence split over ranks whose attention core sees the "
                         "whole sequence in order (ulysses)")
    degree = strategy.degree(spec)
    if degree < 2:
        raise ValueError("the planted causal-leak bug needs 2 or more ranks a sequence: one rank has no shard boundary")
    boundaries = shard_boundaries(get_workload(spec.workload).config.seq_len, degree, load_balanced=False)
    for core in attention_cores(torch.nn.Sequential(*layers)):
        core.leak_at = boundaries
