"""DeepSpeed-MoE (Rajbhandari et al. 2022) under ZeRO-1 or ZeRO-2, started by DeepSpeed's launcher: each block's
experts in DeepSpeed's own MoE layer (`deepspeed.moe.layer.MoE`, `ep_size` ranks a group), its dispatch, all-to-alls,
experts and combine (`MOELayer`), its expert and expert-data-parallel process groups, and its engine's ZeRO optimizer
with the MoE parameter groups it asks for (`split_params_into_different_moe_groups_for_optimizer`).

The router is the workload's, not DeepSpeed's `TopKGate`: `MOELayer` takes any gate module, and the one here hands it
the choices and gate weights workloads.moe.MoEFeedForward made (`WorkloadRoutes`). DeepSpeed's top-2 gate chooses
the same experts by the same softmax, but in fp32 from fp32 logits where the workload's router runs under autocast,
samples its second expert by default (top2_2nd_expert_sampling), and its load-balancing loss counts the first choices
alone (GShard's l_aux); with its gate the model would not be the plain loop's, and parity could not hold it. The
layer runs dropless, as DeepSpeed does with drop_tokens=False: each block's capacity is the most tokens any expert of
its group received (all-reduced with MAX over the group, as `top2gating` does), and every expert's buffer is padded
to it.

Groups (deepspeed.utils.groups, use_data_before_expert_parallel_ off): `ep` consecutive ranks hold every expert once,
E / ep a rank; the ranks `ep` apart hold the same experts (expert data parallel). ZeRO partitions the dense
parameters' states over every rank and the experts' over their expert-data-parallel group, and divides every gradient
by the world size before reducing it there (stage_1_and_2.py `average_tensor`): an expert's gradient is the sum over
every rank's loss, divided by the world size, the plain loop's mean.

Traffic per step per rank: ZeRO's reduction of the dense gradients among all ranks and of the experts' among their
replicas (ZeRO-1 once a step, ZeRO-2 every micro-batch, plus the updated weights' all-gather, as `zero1`/`zero2`);
per block and micro-batch one all-reduce of the capacity (an int64, MAX) in the expert group, and four all-to-alls of
the padded buffers, E x C rows of d values each (C the capacity): dispatch and combine, forward and backward. The
counter sizes each by its input, so a step's all-to-all bytes per rank are the sum over dispatches of 2 E C d (the
dispatched rows' element size + the outputs'), plus E C d (the same) for a forward recomputed in backward
(`expected_padded_all_to_all_bytes`); the capacities each step used are recorded (`CapacityLog`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from harness.derive.comm import Collective
from harness.spec import RunSpec, SpecError
from harness.strategies.base import (ExpectedCollective, ExpectedTraffic, Option, TrafficBytes, make_adamw,
                                     optimizer_description, unwrapped_parameter_names)
from harness.strategies.checkpointing import OPTION_NAME, checkpointed_blocks, interval_of
from harness.strategies.compiling import OPTION_NAME as COMPILE_NAME
from harness.strategies.deepspeed_common import base_config, precision_config, throughput_timer_state
from harness.strategies.ep import ExpertGroups
from harness.strategies.expert_parallel import Dispatcher
from harness.strategies.zero import ZeRO, DeepSpeedTrainer
from workloads import get_workload
from workloads.moe import GroupedExperts, MoEFeedForward

EXPERT_PARTS = ("w_gate_up", "w_down")      # GroupedExperts' stacked tensors, one slice an expert


class SwiGLUExpert(nn.Module):
    """One expert as DeepSpeed's `Experts` holds it (a module it copies once per local expert): one expert's slice of
    GroupedExperts' stacked gate-and-up (d, 2F) and down (F, d) matrices, the same arithmetic."""

    def __init__(self, n_embd: int, width: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(n_embd, 2 * width))
        self.w_down = nn.Parameter(torch.empty(width, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w_gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down


@dataclass
class CapacityLog:
    """The capacity (rows an expert's buffer holds) of every dispatch since the last `take`, those of a forward run
    again inside backward (activation checkpointing's recomputation) apart."""

    capacities: list[int] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)
    dispatch_element_bytes: int = 0
    combine_element_bytes: int = 0

    def add(self, capacity: int) -> None:
        (self.recomputed if torch._C._current_graph_task_id() != -1 else self.capacities).append(capacity)

    def take(self) -> dict[str, Any]:
        taken = {"capacities": self.capacities, "recomputed_capacities": self.recomputed,
                 "dispatch_element_bytes": self.dispatch_element_bytes,
                 "combine_element_bytes": self.combine_element_bytes}
        self.capacities, self.recomputed = [], []
        return taken


def expected_padded_all_to_all_bytes(*, capacities: list[int], recomputed_capacities: list[int], n_experts: int,
                                     n_embd: int, dispatch_element_bytes: int, combine_element_bytes: int) -> int:
    """A rank's all-to-all bytes for these dispatches (module docstring): each buffer E x C rows of d values, sent
    forward and backward by the dispatch (in the rows' dtype) and the combine (in the outputs'), a recomputed forward's
    once more without a backward of its own."""
    row_bytes = n_embd * (dispatch_element_bytes + combine_element_bytes)
    return n_experts * row_bytes * (2 * sum(capacities) + sum(recomputed_capacities))


class WorkloadRoutes(nn.Module):
    """The gate `MOELayer` calls, in DeepSpeed's sparse-route form (l_aux, capacity, E, expert indices (k, S),
    locations (k, S), gate weights (k, S), tokens per expert): the choices the workload's router made (`routes`, set
    by `DeepSpeedDispatch` before each call), dropless. Its load-balancing loss is the workload's, already in the
    gradients (workloads.moe.AuxLossToGradients), so l_aux is 0."""

    def __init__(self, n_experts: int, log: CapacityLog) -> None:
        super().__init__()
        self.n_experts, self.log = n_experts, log
        self.ep_group: Any = None
        self.routes: tuple[torch.Tensor, torch.Tensor] | None = None
        self.planted = ""

    def _set_ep_group(self, ep_group: Any) -> None:         # MOELayer._set_ep_group's call
        self.ep_group = ep_group

    def forward(self, tokens: torch.Tensor, used_token=None, sparse_routes: bool = True, use_tutel: bool = False):
        import torch.distributed as dist

        chosen, weights = self.routes
        top_k, experts = chosen.shape[-1], self.n_experts
        ep = dist.get_world_size(self.ep_group) if self.ep_group is not None else 1
        if self.planted == "misroute":          # each choice sent to the same local expert of the next rank
            chosen = (chosen + experts // ep) % experts
        if self.planted == "ungated-combine":   # each output added whole, without its gate weight
            weights = torch.ones_like(weights)
        counts = torch.bincount(chosen.reshape(-1), minlength=experts)
        capacity = counts.max().reshape(1).clone()
        if ep > 1:
            dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=self.ep_group)
        self.log.add(int(capacity))
        # Each (choice, token) pair's slot in its expert's buffer: the first choices in token order, then the second
        # (top2gating's order; a row's place in the buffer changes no arithmetic).
        routes = chosen.t().reshape(-1)
        slot = (F.one_hot(routes, experts).cumsum(dim=0) - 1).gather(1, routes.unsqueeze(1)).reshape(top_k, -1)
        return (torch.zeros((), device=tokens.device), capacity, experts, chosen.t().to(torch.int32),
                slot.to(torch.int32), weights.t().float(), counts)


class DeepSpeedDispatch(Dispatcher):
    """A block's experts as DeepSpeed-MoE runs them, called as GroupedExperts is (tokens, chosen, weights)."""

    def __init__(self, layer: nn.Module, routes: WorkloadRoutes, degree: int) -> None:
        super().__init__()
        self.layer, self.degree = layer, degree
        self.__dict__["routes"] = routes        # the layer's own gate: not registered a second time

    def forward(self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.routes.routes, self.routes.planted = (chosen, weights), self.planted
        output, _, _ = self.layer(tokens)
        # Each exchange's own dtype: the rows as dispatched (fp32 under autocast: the normed input), the outputs as
        # combined (DeepSpeed casts them to the experts' output dtype).
        self.routes.log.dispatch_element_bytes = tokens.element_size()
        self.routes.log.combine_element_bytes = output.element_size()
        return output


def install_deepspeed_moe(layers: list[nn.Module], degree: int, log: CapacityLog) -> list[DeepSpeedDispatch]:
    """Replace every block's experts (in place) by DeepSpeed's MoE layer over `degree` ranks holding this rank's
    share of them, E / degree experts from its place in its expert group on, copied from the plain model's."""
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    installed = []
    for layer in layers:
        for module in layer.modules():
            if not isinstance(module, MoEFeedForward):
                continue
            whole: GroupedExperts = module.experts
            experts, n_embd, gate_up = whole.w_gate_up.shape
            moe = MoE(n_embd, SwiGLUExpert(n_embd, gate_up // 2), num_experts=experts, ep_size=degree,
                      k=module.top_k, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
            routes = WorkloadRoutes(experts, log)
            moe.deepspeed_moe.gate = routes
            moe.set_deepspeed_parallelism()         # its groups now, to know this rank's experts (the engine's is a no-op)
            first = dist.get_rank(group=groups._get_expert_parallel_group(moe.expert_group_name)) * (experts // degree)
            with torch.no_grad():
                for index, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                    for name in EXPERT_PARTS:
                        getattr(expert, name).copy_(getattr(whole, name)[first + index])
            module.experts = DeepSpeedDispatch(moe, routes, degree)
            installed.append(module.experts)
    return installed


def plain_name(name: str) -> str:
    """A DeepSpeed expert's parameter name as the plain model names the stacked tensor it is a slice of."""
    head, found, tail = name.partition(".experts.layer.deepspeed_moe.experts.deepspeed_experts.")
    return f"{head}.experts.{tail.split('.', 1)[1]}" if found else name


@dataclass
class DeepSpeedMoETrainer(DeepSpeedTrainer):
    """ZeRO's step over DeepSpeed's MoE layers, its parameters named and normed as the plain model's stacked ones."""

    # Each plain parameter name in the plain model's order, with the indices (in this module's trainable parameters)
    # of the tensors it is made of here: one for a dense parameter, one per local expert for an expert tensor.
    parts: list[tuple[str, list[int], bool]] = field(default_factory=list)
    reports_experts: bool = True        # the first expert-data-parallel rank of its experts: the others hold them again
    log: CapacityLog | None = None
    capacities_by_step: list[dict[str, Any]] = field(default_factory=list)
    n_embd: int = 0
    n_experts: int = 0
    # The norm of the gradients is taken from their parts (DeepSpeed's own counts each rank's experts alone).
    gradient_norm_after_step = False

    def train_step(self, micro_batches, gradients_ready=None) -> torch.Tensor:
        loss = super().train_step(micro_batches, gradients_ready)
        self.capacities_by_step.append(self.log.take())
        return loss

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    def _joined(self, tensors: list[torch.Tensor], shown) -> list[torch.Tensor]:
        return [torch.cat([tensors[i].reshape(-1) for i in indices]) if shown(expert) else tensors[0].new_empty(0)
                for _, indices, expert in self.parts]

    def parameter_names(self) -> list[str]:
        return [name for name, _, _ in self.parts]

    def local_parameters(self):
        # Stages 1-2 keep every parameter whole on every rank: a dense one on rank 0 alone, an expert's slice on the
        # first rank holding it.
        return self._joined(self._trainable(), lambda expert: self.reports_experts if expert
                            else self.context.rank == 0), True

    def local_gradients(self):
        fragments, _ = super().local_gradients()          # each rank's fragment of ZeRO's reduced partitions
        return self._joined(fragments, lambda expert: True), True

    def gradient_norm(self) -> float:
        return self.global_norm(*self.local_gradients())

    def parameters_held(self, whole_model: int) -> int:
        return sum(p.numel() for p in self._trainable())

    def expert_parameters_held(self) -> int:
        trainable = self._trainable()
        return sum(trainable[i].numel() for _, indices, expert in self.parts if expert for i in indices)

    def rank_figures(self) -> dict[str, Any]:
        by_step = [expected_padded_all_to_all_bytes(**taken, n_experts=self.n_experts, n_embd=self.n_embd)
                   for taken in self.capacities_by_step]
        timed = by_step[self.spec.warmup_steps:]
        return {"expert_parallel": {
            "capacities_by_step": self.capacities_by_step, "expected_all_to_all_bytes_by_step": by_step,
            "expected_all_to_all_bytes_per_timed_step": sum(timed) / len(timed) if timed else None}}


def plain_parts(module: nn.Module) -> list[tuple[str, list[int], bool]]:
    """`DeepSpeedMoETrainer.parts` of a module holding DeepSpeed's MoE layers."""
    grouped: dict[str, tuple[list[int], bool]] = {}
    for index, name in enumerate(unwrapped_parameter_names(module)):
        found = plain_name(name)
        grouped.setdefault(found, ([], found != name))[0].append(index)
    return [(name, indices, expert) for name, (indices, expert) in grouped.items()]


class DeepSpeedMoE(ExpertGroups, ZeRO):
    """DeepSpeed-MoE under ZeRO-1 or ZeRO-2 (module docstring)."""

    checkpoint_method = ""
    cannot_compile_because = ("DeepSpeed-MoE's layer reads its capacity on the host (int(C)) in every block; compiling "
                              "it is not built here")

    def __init__(self) -> None:
        super().__init__(2)
        self.name = "deepspeed-moe"
        self.description = "DeepSpeed-MoE: experts sharded by DeepSpeed's MoE layer, ZeRO-1 or 2 (DeepSpeed's launcher)"
        self.comm_interception = "torch.distributed: DeepSpeed's reductions and its MoE layer's all_to_all_single"
        kept = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
                "offload_optimizer", "precision_recipe", OPTION_NAME, COMPILE_NAME)
        self.options = {"zero_stage": Option(2, "ZeRO stage (DeepSpeed-MoE runs under 1 and 2; stage 3 refuses MoE)",
                                             choices=(1, 2)),
                        "ep": Option(0, "expert-parallel ranks (DeepSpeed's ep_size), each group holding every expert "
                                        "once (0: every rank)", minimum=0),
                        **{name: self.options[name] for name in kept}}

    def stage_of(self, options) -> int:
        return int(options.get("zero_stage", 2))

    def validate(self, spec: RunSpec) -> None:
        self.check_degree(spec)
        if self.resolved(spec)["offload_optimizer"] != "none":
            raise SpecError("strategy deepspeed-moe: offload_optimizer is not built with DeepSpeed-MoE here (allowed: "
                            "none)")

    def deepspeed_estimate_bytes(self, parameters, largest_module_parameters, gpus_per_node, nodes, options):
        """None: DeepSpeed's estimate_zero2_model_states_mem_needs takes a whole model sharded over every rank, not
        experts sharded over their replicas."""
        return None

    def expected_traffic(self, spec: RunSpec, layers) -> ExpectedTraffic:
        """ZeRO's collectives of the dense part among every rank and of each rank's experts among the ranks holding
        them, and the capacity's all-reduce in each block and micro-batch (module docstring); the all-to-alls follow
        the routing and are expected from it in the row (`DeepSpeedMoETrainer.rank_figures`)."""
        if spec.world_size == 1:
            return ExpectedTraffic()
        options, degree = self.resolved(spec), self.degree(spec)
        model = nn.Sequential(*layers)
        whole = self.traffic_bytes(spec, model)
        expert_count = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}")
        # An expert's tensors are no nn.Linear's: fp32 under fp32 and the torch_autocast section, 2 bytes under the
        # bf16 section, reduced and gathered so (harness.strategies.zero's docstring).
        width = 2 if self._half_weights(spec) else 4
        micro_batches = self.layout(spec).micro_batches
        dense = TrafficBytes(parameters=whole.parameters - expert_count,
                             gradients_reduced=whole.gradients_reduced - width * expert_count,
                             parameters_gathered=whole.parameters_gathered - width * expert_count)
        collectives = list(self.expected_collectives(data_parallel=spec.world_size, micro_batches=micro_batches,
                                                     options=options, traffic=dense).collectives)
        replicas = spec.world_size // degree
        if replicas > 1:
            held = TrafficBytes(parameters=expert_count // degree, gradients_reduced=width * expert_count // degree,
                                parameters_gathered=width * expert_count // degree)
            collectives += [dataclasses.replace(c, ranks=replicas, group="edp", stride=degree)
                            for c in self.expected_collectives(data_parallel=replicas, micro_batches=micro_batches,
                                                               options=options, traffic=held).collectives]
        if degree > 1:
            blocks = sum(isinstance(m, MoEFeedForward) for layer in layers for m in layer.modules())
            forwards = 2 if interval_of(options) else 1
            collectives.append(ExpectedCollective(collective=Collective.ALL_REDUCE, size_bytes=8,
                                                  calls=blocks * micro_batches * forwards, ranks=degree, group="ep"))
        return ExpectedTraffic(collectives=tuple(collectives))

    def wrap(self, spec, context, workload, layers):
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        options, degree = self.resolved(spec), self.degree(spec)
        precision, recipe = precision_config(spec, options)
        config = {**base_config(spec, self.layout(spec).micro_batches), **precision,
                  "zero_optimization": self.zero_config(spec)}
        log = CapacityLog()
        install_deepspeed_moe(layers, degree, log)
        model = nn.Sequential(*checkpointed_blocks(layers, interval_of(options))).to(context.device)
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"})
        optimizer = make_adamw(groups, context.device)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        zero = engine._config.zero_config
        resolved = {**config, "zero_optimization": {**config["zero_optimization"], "overlap_comm": zero.overlap_comm}}
        model_config = get_workload(spec.workload).config
        return DeepSpeedMoETrainer(
            context=context, engine=engine, workload=workload, precision_recipe=recipe, spec=spec,
            parts=plain_parts(engine.module), reports_experts=context.rank < degree, log=log,
            n_embd=model_config.n_embd, n_experts=model_config.n_experts,
            config={"deepspeed_config": resolved, **throughput_timer_state(engine), **optimizer_description(context.device),
                    "expert_parallel": degree, "expert_replicas": context.world_size // degree,
                    "experts_per_rank": model_config.n_experts // degree,
                    "gate": "the workload's router (WorkloadRoutes), dropless: capacity = the most tokens an expert "
                            "of the group received"})

