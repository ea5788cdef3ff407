"""Expert parallelism through Horovod, started by `horovodrun` (gloo on CPU): `ep`'s dispatch and combine
(harness.strategies.expert_parallel) with Horovod's `alltoall` in place of torch's `all_to_all_single`, and the dense
gradients averaged by Horovod's all-reduce, as a Horovod user builds it: Horovod has no expert-parallel layer of its
own, and its alltoall (variable splits, differentiable) is the collective such a user reaches for.

Every rank holds `E / world size` of each block's experts (one group over every rank, Horovod's global process set)
and its own samples, as under `horovod`. After backward the dense gradients are averaged in one grouped all-reduce
(`hvd.grouped_allreduce_`, Average); an expert's gradient holds every rank's tokens routed to it and is divided by the
world size, as under `ep` (expert_parallel.ExpertGradients). The optimizer is the common AdamW, not
`hvd.DistributedOptimizer`, whose all-reduce would take the experts too; rank 0's parameters are broadcast first, as
Horovod's examples do.

Traffic per step per rank: the all-to-alls as under `ep` (Horovod's alltoall sized by its input, counted by the
counter's Horovod entry point; expected from the rows the rank routed), and one all-reduce of the dense gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from harness.derive.comm import Collective
from harness.environment import horovod_build_flags
from harness.spec import Precision, RunSpec
from harness.strategies.base import (ExpectedCollective, ExpectedTraffic, accumulate,
                                     half_dtype_names, make_adamw, optimizer_description, recipe_of)
from harness.strategies.base import PrecisionRecipe, squared_norm
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME, blocks_as_run
from harness.strategies.expert_parallel import (ExpertGradients, ExpertParallelParts, Group, HorovodExchange,
                                                RoutingLog, shard_experts)
from harness.strategies.ep import ExpertGroups, expert_names_of, split_bytes
from harness.strategies.horovod import Horovod, HorovodTrainer
from harness.strategies.loss_scaling import scaler_for


@dataclass
class HorovodEPTrainer(ExpertParallelParts, HorovodTrainer):
    """The plain loop's accumulation, then the dense gradients averaged by Horovod and the experts' divided."""

    experts: ExpertGradients | None = None
    dense: list[nn.Parameter] = field(default_factory=list)
    routing: RoutingLog | None = None
    expert_names: frozenset[str] = frozenset()
    reports_experts: bool = True        # one group over every rank: each rank's experts are its own
    routed_by_step: list[dict[str, int]] = field(default_factory=list)
    n_embd: int = 0
    n_experts: int = 0

    def train_step(self, micro_batches, gradients_ready=None) -> torch.Tensor:
        loss = accumulate(self.model, self.workload.loss, micro_batches, self.spec, self.context.device,
                          multipliers=self.loss_multipliers, scaler=self.scaler)
        gradients = [p.grad for p in self.dense if p.grad is not None]
        if gradients and self.context.world_size > 1:
            self.hvd.grouped_allreduce_(gradients, op=self.hvd.Average, name="parbench.dense")
        self.reduce_experts_and_update(gradients_ready)
        return loss

    def global_norm(self, tensors, sharded: bool) -> float:
        return float(sum(n * n for n in self.tensor_norms(list(tensors), sharded))) ** 0.5

    def tensor_norms(self, tensors, sharded: bool) -> list[float]:
        """As the base's, the ranks' squares added by Horovod's all-reduce: torch.distributed is not started."""
        squares = torch.stack([squared_norm(tensor).to(self.context.device) for tensor in tensors])
        if sharded and self.context.world_size > 1:
            squares = self.hvd.allreduce(squares, op=self.hvd.Sum, name="parbench.norms")
        return squares.sqrt().tolist()


class HorovodExpertParallel(ExpertGroups, Horovod):
    name = "horovod-ep"
    # fp32 alone: its combine sends the experts' bf16 outputs under autocast, which Horovod 0.28.1's alltoall refuses
    # (`layout_refusal`), and fp16 is refused for every MoE cell (workloads.moe.MoEWorkload.precision_refusal).
    precision_recipes = (PrecisionRecipe.FP32,)
    launcher = "horovodrun"
    checkpoint_method = ""
    description = "expert parallelism through Horovod: experts sharded, tokens exchanged by hvd.alltoall (horovodrun)"
    comm_interception = "Horovod's all-reduce and alltoall entry points"
    options = {OPTION_NAME: ACTIVATION_CHECKPOINTING, COMPILE_NAME: COMPILE}
    cannot_compile_because = ("the dispatch reads its split sizes on the host (.tolist()), which breaks the compiled "
                              "graph at every block")

    def validate(self, spec: RunSpec) -> None:
        return None

    def layout_refusal(self, spec: RunSpec) -> str | None:
        if spec.precision is Precision.BF16:
            # Measured: hvd.alltoall raised "Tensor type torch.BFloat16Tensor is not supported" on every rank (Horovod
            # 0.28.1, CPU, 2026-11-29); the dispatched rows are fp32 under autocast (the RMSNorm's output), the
            # experts' outputs the combine sends back bf16.
            return ("Horovod 0.28.1's alltoall takes no bfloat16 tensor (its torch operations have none for it), and "
                    "the experts' outputs the combine sends back are bf16 under autocast")
        return super().layout_refusal(spec)     # no `ep` option: every rank holds experts / world size

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        """Not from a whole-model size: the dense part's all-reduce needs the split of the layers
        (`expected_traffic`), and the all-to-alls follow the routing."""
        return ExpectedTraffic(not_modelled_because="horovod-ep's all-reduce takes the dense part alone and its "
                                                    "all-to-alls follow the routing: expected from its layers and rows")

    def expected_traffic(self, spec: RunSpec, layers) -> ExpectedTraffic:
        """One all-reduce of the dense gradients; the all-to-alls follow the routing and are expected from it in the
        row (`HorovodEPTrainer.rank_figures`)."""
        if spec.world_size == 1:
            return ExpectedTraffic()
        dense_bytes, _ = split_bytes(layers)
        return ExpectedTraffic(collectives=(ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=dense_bytes,
                                                               calls=1, ranks=spec.world_size),))

    def working_memory_bytes(self, rank, recipe, options):
        return {}

    def wire_calls(self, *, collective, counted_calls, bytes_per_step, backward_s, options):
        return counted_calls

    def gradient_reduce_dtypes(self, spec: RunSpec, model: nn.Module) -> tuple[str, ...]:
        """As `ep`'s (ExpertParallel.gradient_reduce_dtypes): an expert's gradient sums its group's rows in bf16."""
        return (*half_dtype_names(spec), "float32")


    def wrap(self, spec, context, workload, layers):
        import horovod.torch as hvd

        degree = context.world_size
        sharded, log = shard_experts(layers, Group(HorovodExchange(degree), degree, context.rank))
        model = nn.Sequential(*blocks_as_run(layers, self.resolved(spec))).to(context.device)
        expert_ids = {id(p) for module in sharded for p in module.parameters()}
        # The dense part starts from rank 0's values on every rank; each rank's experts are its own slice already.
        dense_state = {name: tensor for name, tensor in model.state_dict().items() if ".experts." not in f".{name}"}
        hvd.broadcast_parameters(dense_state, root_rank=0)
        config = workload.config
        return HorovodEPTrainer(
            context=context, model=model, optimizer=make_adamw(model.parameters(), context.device), workload=workload,
            spec=spec, hvd=hvd, precision_recipe=recipe_of(spec), scaler=scaler_for(spec, context.device),
            experts=ExpertGradients([p for p in model.parameters() if id(p) in expert_ids],
                                    data_parallel=context.world_size),
            dense=[p for p in model.parameters() if id(p) not in expert_ids], routing=log,
            expert_names=expert_names_of(model, expert_ids),
            n_embd=config.n_embd, n_experts=config.n_experts,
            config={"expert_parallel": degree, "experts_per_rank": config.n_experts // degree,
                    "dense": "hvd.grouped_allreduce_, Average", "horovod_build": horovod_build_flags(hvd),
                    **optimizer_description(context.device)})
