"""Expert parallelism in torch, started by torchrun: an MoE model's experts sharded over an expert-parallel group,
tokens dispatched to them and combined back with `all_to_all_single` (harness.strategies.expert_parallel), as
torchtitan builds it; the dense part (attention, router, norms, embeddings, head) under DDP.

Every rank is a data-parallel replica with its own samples, as under DDP. The ranks form groups of `ep` (option,
default every rank) consecutive ranks, each group holding every expert once: `E / ep` a rank. With fewer
expert-parallel ranks than ranks (`ep=2` at 4 ranks), the groups are replicas of one another, and the ranks holding
the same experts (`edp`, one a group) sum those experts' gradients.

Gradients: DDP averages the dense ones over every rank (its parameters to ignore leave the experts to us). An
expert's gradient after backward holds what every token routed to it from its group's ranks contributed, each rank's
loss already divided by its micro-batches; the plain loop's is the mean over all data-parallel ranks, so the experts'
are summed over `edp` (where it has more than one rank) and divided by the world size
(harness.strategies.expert_parallel.ExpertGradients).

Traffic per step per rank: DDP's one all-reduce of the dense gradients; the all-to-alls of the dispatch, each
as the routing made it (expert_parallel's docstring: counted against `expected_all_to_all_bytes` of the rows the
rank really sent and received, recorded in `strategy_figures_by_rank`); with `edp` of more than one rank, one
all-reduce of each expert tensor among it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from harness.derive.comm import Collective
from harness.spec import RunSpec, SpecError
from harness.strategies.base import (ExpectedCollective, ExpectedTraffic, Option, Strategy, accumulate,
                                     half_dtype_names, make_adamw, optimizer_description, recipe_of, torchrun_context,
                                     unwrapped_parameter_names)
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME, blocks_as_run
from harness.strategies.ddp import DDPTrainer
from harness.strategies.expert_parallel import (ExpertGradients, ExpertParallelParts, Group, RoutingLog,
                                                TorchExchange, shard_experts)
from harness.strategies.loss_scaling import scaler_for
from workloads import Family, get_workload

EXPERT_GROUP = "ep"             # the group a block's experts are sharded over, and its label in the counts
EXPERT_REPLICAS = "edp"         # the group of the ranks holding the same experts


@dataclass
class EPTrainer(ExpertParallelParts, DDPTrainer):
    """DDP's step, with the experts' gradients reduced before the update and the rows each step routed recorded."""

    experts: ExpertGradients | None = None
    routing: RoutingLog | None = None
    expert_names: frozenset[str] = frozenset()
    # Only the first group's ranks report the experts' norms: the other groups hold the same experts again.
    reports_experts: bool = True
    routed_by_step: list[dict[str, int]] = field(default_factory=list)
    n_embd: int = 0
    n_experts: int = 0

    def train_step(self, micro_batches, gradients_ready=None) -> torch.Tensor:
        loss = accumulate(self.model, self.workload.loss, micro_batches, self.spec, self.context.device,
                          no_sync=self.model.no_sync, multipliers=self.loss_multipliers, scaler=self.scaler)
        self.reduce_experts_and_update(gradients_ready)
        return loss


class ExpertGroups:
    """What a strategy whose `ep` option shards an MoE model's experts over groups of `ep` ranks (0: every rank) owns
    of it, written once for `ep` and `deepspeed-moe`: the degree, its rule, the refusal of a model without experts,
    what a rank holds, and why no compute-only pass exists."""

    def degree(self, spec: RunSpec) -> int:
        return self.expert_parallel_degree(spec.world_size, self.resolved(spec))

    def expert_parallel_degree(self, world_size: int, options) -> int:
        return int(options.get("ep", 0)) or world_size

    def check_degree(self, spec: RunSpec) -> None:
        degree = self.degree(spec)
        if spec.world_size % degree:
            raise SpecError(f"strategy {self.name}: ep={degree} must divide the world size {spec.world_size}")

    def layout_refusal(self, spec: RunSpec) -> str | None:
        return moe_refusal(spec, self.degree(spec))

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return "a rank's experts compute on tokens the all-to-all brings: without it, the rank has no such work"

    def planned_parameters_held(self, spec: RunSpec, layers) -> int:
        return held_with_experts_over(layers, self.degree(spec))


class ExpertParallel(ExpertGroups, Strategy):
    name = "ep"
    launcher = "torchrun"
    description = "torch expert parallelism: experts sharded, tokens exchanged by all_to_all_single, DDP (torchrun)"
    comm_interception = "torch.distributed: DDP's allreduce_hook, the dispatch's all_to_all_single"
    options = {"ep": Option(0, "expert-parallel ranks, each group holding every expert once (0: every rank)",
                            minimum=0),
               OPTION_NAME: ACTIVATION_CHECKPOINTING, COMPILE_NAME: COMPILE}
    cannot_compile_because = ("the dispatch reads its split sizes on the host (.tolist()), which breaks the compiled "
                              "graph at every block; torchtitan compiles expert parallelism's blocks with its own "
                              "token-group alignment, not built here")

    def validate(self, spec: RunSpec) -> None:
        self.check_degree(spec)

    def expected_traffic(self, spec: RunSpec, layers) -> ExpectedTraffic:
        """DDP's all-reduce of the dense gradients and, where groups replicate the experts, the experts' all-reduce
        among them; the all-to-alls follow the routing and are expected from it in the row
        (`EPTrainer.rank_figures`)."""
        if spec.world_size == 1:
            return ExpectedTraffic()
        dense_bytes, expert_bytes = split_bytes(layers)
        degree = self.degree(spec)
        collectives = [ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=dense_bytes, calls=1,
                                          ranks=spec.world_size)]
        replicas = spec.world_size // degree
        if replicas > 1:
            collectives.append(ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=expert_bytes // degree,
                                                  calls=1, ranks=replicas, group=EXPERT_REPLICAS, stride=degree))
        return ExpectedTraffic(collectives=tuple(collectives))

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        """DDP's one all-reduce of the gradients `traffic` gives a step, among the data-parallel ranks: what the
        projection carries a row's counted dense all-reduce by (the same at every world size). The experts'
        all-reduce among their replicas runs in a group of its own, and the all-to-alls follow the routing: a row's
        counted ones are carried as they are (harness.project.projection.schedule_at)."""
        if data_parallel == 1:
            return ExpectedTraffic()
        return ExpectedTraffic(collectives=(ExpectedCollective(collective=Collective.ALL_REDUCE,
                                                               size_bytes=traffic.gradients_reduced, calls=1,
                                                               ranks=data_parallel),))

    def gradient_reduce_dtypes(self, spec: RunSpec, model: nn.Module) -> tuple[str, ...]:
        """DDP reduces the dense gradients in fp32, but under autocast an expert's weight gradient is one bf16 matrix
        multiply over the rows of every rank of its group (x^T dy, summed over the rows in bf16 and rounded once),
        where the plain loop rounds each micro-batch's and adds them in fp32: rounding that reaches the gradients as a
        bf16 gradient reduction's does, so parity holds such rows to its `bf16-comm` tolerances (moe-tiny at 2 and 4
        ranks, 2026-11-29: an expert tensor's gradient 1.8e-5 to 3.1e-5 off the plain loop's, its update 9.5e-5 to
        3.2e-4, against 2e-5 and 2e-5 for bf16 with an fp32 reduction; in fp32 every tensor within 1e-5)."""
        return (*half_dtype_names(spec), "float32")

    def start(self, spec):
        return torchrun_context(spec.device)

    def wrap(self, spec, context, workload, layers):
        degree = self.degree(spec)
        replicas = context.world_size // degree
        expert_group, replica_group = expert_groups(context.rank, context.world_size, degree)
        coordinate = context.rank % degree
        sharded, log = shard_experts(layers, Group(TorchExchange(expert_group), degree, coordinate))
        model = nn.Sequential(*blocks_as_run(layers, self.resolved(spec))).to(context.device)
        expert_parameters = [p for module in sharded for p in module.parameters()]
        expert_ids = {id(p) for p in expert_parameters}
        # DDP ignores them by their names in the model it wraps (a checkpoint wrapper's part in them); the norms name
        # them as the unwrapped model does (`expert_names_of`).
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [name for name, p in model.named_parameters() if id(p) in expert_ids])
        ddp = DistributedDataParallel(model, device_ids=[context.device.index] if context.device.type == "cuda"
                                      else None, static_graph=self.layout(spec).micro_batches == 1)
        ddp.register_comm_hook(state=None, hook=allreduce_hook)
        experts = ExpertGradients(expert_parameters, data_parallel=context.world_size,
                                  replicas=replica_group if replicas > 1 else None)
        config = workload.config
        return EPTrainer(context=context, model=ddp, optimizer=make_adamw(ddp.parameters(), context.device),
                         workload=workload, spec=spec, precision_recipe=recipe_of(spec),
                         scaler=scaler_for(spec, context.device), experts=experts, routing=log,
                         expert_names=expert_names_of(model, expert_ids),
                         reports_experts=context.rank < degree, n_embd=config.n_embd, n_experts=config.n_experts,
                         config={"expert_parallel": degree, "expert_replicas": replicas,
                                 "experts_per_rank": config.n_experts // degree, "dense": "DDP, allreduce_hook",
                                 **optimizer_description(context.device)})


def expert_groups(rank: int, world_size: int, degree: int) -> tuple[object, object]:
    """This rank's expert-parallel group (`degree` consecutive ranks) and its experts' replicas (the ranks `degree`
    apart), each a process group of its own, labelled in the counts, even where one spans every rank: torch's device
    mesh would reuse the default group there, and DDP's all-reduce would be counted under the experts' label."""
    import torch.distributed as dist

    from harness.rank.comm_counter import label_group

    mine = {}
    for first in range(0, world_size, degree):          # every rank creates every group, in the same order
        group = dist.new_group(list(range(first, first + degree)))
        if rank in range(first, first + degree):
            mine[EXPERT_GROUP] = group
    for coordinate in range(degree):
        group = dist.new_group(list(range(coordinate, world_size, degree)))
        if rank % degree == coordinate:
            mine[EXPERT_REPLICAS] = group
    for label, group in mine.items():
        label_group(group, label)
    return mine[EXPERT_GROUP], mine[EXPERT_REPLICAS]


def moe_refusal(spec: RunSpec, degree: int) -> str | None:
    """Why `spec`'s experts cannot be sharded over `degree` ranks, or None."""
    workload = get_workload(spec.workload)
    if workload.family is not Family.MOE:
        return f"expert parallelism shards an MoE model's experts: {spec.workload} has none"
    experts = workload.config.n_experts
    if experts % degree:
        return f"{spec.workload}'s {experts} experts do not divide over {degree} expert-parallel ranks"
    return None


def _is_expert(name: str) -> bool:
    return ".experts." in f".{name}"


def split_bytes(layers) -> tuple[int, int]:
    """(the dense parameters' bytes, the routed experts' bytes) of freshly built layers."""
    sizes = [(_is_expert(name), p.numel() * p.element_size())
             for layer in layers for name, p in layer.named_parameters()]
    return sum(size for expert, size in sizes if not expert), sum(size for expert, size in sizes if expert)


def held_with_experts_over(layers, degree: int) -> int:
    """Parameters a rank holds with the routed experts split over `degree` ranks and the rest whole."""
    counts = [(_is_expert(name), p.numel()) for layer in layers for name, p in layer.named_parameters()]
    return sum(n for expert, n in counts if not expert) + sum(n for expert, n in counts if expert) // degree


def expert_names_of(model: nn.Module, expert_ids: set[int]) -> frozenset[str]:
    """The names, as the unwrapped model has them (`unwrapped_parameter_names`: no checkpoint wrapper's part), of the
    parameters in `expert_ids`: what a trainer's parameter names are matched against."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return frozenset(name for name, p in zip(unwrapped_parameter_names(model), trainable) if id(p) in expert_ids)
