"""Expert parallelism's machinery, shared by the strategies that shard an MoE model's experts over ranks: each rank
of an expert-parallel group of `degree` ranks holds `E / degree` of every block's experts, and the tokens routed to an
expert are sent to the rank that holds it and their outputs sent back (GShard's dispatch and combine, Lepikhin et al.
2020; torchtitan's expert parallelism, which this follows).

A block's experts (workloads.moe.GroupedExperts, stacked (E, d, 2F) and (E, F, d)) are replaced by
`ExpertParallelExperts`, which keeps this rank's slice of dimension 0 (experts `coordinate x E/degree` onwards, the
rank's place in its group) and computes what GroupedExperts computes, every token kept:

1. the (token, choice) pairs are sorted by expert (stable: the plain model's order), and each rank tells every other
   how many rows it will send for each of that rank's experts: an all-to-all of E int64 counts;
2. dispatch: an all-to-all of the sorted rows (variable splits), each destination's rows being those for its experts;
3. the received rows, ordered by source and then expert, are regrouped by expert, and each local expert runs on its
   rows (one matrix multiply each, as the dropless plain model does);
4. combine: the reverse all-to-all brings each row's output back to its source, which weighs it by its gate weight and
   adds it to its token, as GroupedExperts does.

Dispatch and combine are differentiable (`AllToAll`): backward sends the gradients along the reverse path, so one step
issues, per block and micro-batch, the counts' exchange and four exchanges of rows: dispatch and combine forward, and
their backward. The counter (harness.rank.comm_counter) sizes an all_to_all by its input, as nccl-tests' alltoall does:
a rank's dispatch and combine-backward inputs hold its T x k rows (T its tokens, k the experts per token), its combine
and dispatch-backward inputs the R rows routed to its experts, so a step's bytes per rank are, per block and
micro-batch, (T k + R) x d x (the dispatched rows' element size + the outputs'), plus 8 E for the counts
(`expected_all_to_all_bytes`): (2 T k + 2 R) x d x 4 in fp32, and under bf16 autocast, whose experts' outputs are
bf16 while the rows they take are fp32, (T k + R) x d x 6. On a wire, a (n - 1) / n share of each leaves the rank
(harness.derive.comm's busbw factor of all_to_all).

What a step routed is recorded (`RoutingLog`): the rows each rank sent and received per step, from the counts it
exchanged, so the expected bytes come from the routing the step really made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from workloads.moe import GroupedExperts, MoEFeedForward

COUNT_BYTES = 8             # one int64 count a (rank, expert)


class AllToAll(torch.autograd.Function):
    """`torch.distributed.all_to_all_single` of rows with variable splits, whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_splits: list[int], receive_splits: list[int], group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.send_splits, ctx.receive_splits, ctx.group = send_splits, receive_splits, group
        received = rows.new_empty((sum(receive_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), receive_splits, send_splits, group=group)
        return received

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):
        import torch.distributed as dist

        sent_back = gradient.new_empty((sum(ctx.send_splits), *gradient.shape[1:]))
        dist.all_to_all_single(sent_back, gradient.contiguous(), ctx.send_splits, ctx.receive_splits, group=ctx.group)
        return sent_back, None, None, None


@dataclass
class RoutingLog:
    """Rows this rank sent and received in all-to-alls since the last `take` (every block and micro-batch), those of
    a forward run again inside backward (activation checkpointing's recomputation, whose exchanges have no backward of
    their own) apart."""

    sent: int = 0
    received: int = 0
    exchanges: int = 0          # dispatches (one per block and micro-batch)
    recomputed_sent: int = 0
    recomputed_received: int = 0
    recomputed_exchanges: int = 0
    dispatch_element_bytes: int = 0     # of the rows dispatched (the block's normed input: fp32 under autocast too)
    combine_element_bytes: int = 0      # of the experts' outputs sent back (bf16 under autocast)

    def add(self, sent: int, received: int) -> None:
        if torch._C._current_graph_task_id() != -1:         # inside backward: a recomputation
            self.recomputed_sent += sent
            self.recomputed_received += received
            self.recomputed_exchanges += 1
        else:
            self.sent += sent
            self.received += received
            self.exchanges += 1

    def take(self) -> dict[str, int]:
        taken = {"rows_sent": self.sent, "rows_received": self.received, "dispatches": self.exchanges,
                 "recomputed_rows_sent": self.recomputed_sent, "recomputed_rows_received": self.recomputed_received,
                 "recomputed_dispatches": self.recomputed_exchanges,
                 "dispatch_element_bytes": self.dispatch_element_bytes,
                 "combine_element_bytes": self.combine_element_bytes}
        self.sent = self.received = self.exchanges = 0
        self.recomputed_sent = self.recomputed_received = self.recomputed_exchanges = 0
        return taken


class TorchExchange:
    """The group's all-to-alls through torch.distributed (`ep`): `all_to_all_single` on its process group."""

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.process_group)
        return received

    def rows(self, rows: torch.Tensor, send_splits: list[int], receive_splits: list[int]) -> torch.Tensor:
        return AllToAll.apply(rows, send_splits, receive_splits, self.process_group)


class ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous: Horovod's alltoall backward sends the gradient
    it gets as it lies in memory, and an indexing's gradient need not be contiguous."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> torch.Tensor:
        return gradient.contiguous()


class HorovodExchange:
    """The group's all-to-alls through Horovod (`horovod-ep`): `hvd.alltoall` over every rank (its global process set),
    with variable splits; Horovod's own autograd function sends the gradients back."""

    def __init__(self, degree: int) -> None:
        self.degree = degree

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        import horovod.torch as hvd

        each = torch.full((self.degree,), counts.numel() // self.degree, dtype=torch.int32)
        received, _ = hvd.alltoall(counts, splits=each, name=None)
        return received

    def rows(self, rows: torch.Tensor, send_splits: list[int], receive_splits: list[int]) -> torch.Tensor:
        import horovod.torch as hvd

        received, _ = hvd.alltoall(rows.contiguous(), splits=torch.tensor(send_splits, dtype=torch.int32))
        return ContiguousGradient.apply(received)


@dataclass(frozen=True)
class Group:
    """An expert-parallel group as the experts see it: how its ranks exchange tensors, its size and this rank's place
    in it."""

    exchange: Any                   # TorchExchange or HorovodExchange
    degree: int
    coordinate: int


class Dispatcher(nn.Module):
    """A block's experts behind a dispatch to the ranks holding them, called as workloads.moe.GroupedExperts is
    (tokens, chosen experts, gate weights): `degree` ranks in its expert-parallel group, and `planted`, a dispatch bug
    planted in it (harness.rank.faults.DISPATCH_KINDS), "" in an honest run."""

    degree: int = 1
    planted: str = ""


class ExpertParallelExperts(Dispatcher):
    """This rank's `E / degree` experts of a block, with the dispatch and combine around them (module docstring)."""

    def __init__(self, whole: GroupedExperts, group: Group, log: RoutingLog) -> None:
        super().__init__()
        self.degree = group.degree
        experts = whole.w_gate_up.shape[0]
        self.n_experts, self.local_experts = experts, experts // group.degree
        first = group.coordinate * self.local_experts
        self.w_gate_up = nn.Parameter(whole.w_gate_up.detach()[first:first + self.local_experts].clone())
        self.w_down = nn.Parameter(whole.w_down.detach()[first:first + self.local_experts].clone())
        self.group, self.log = group, log
        self.planted = ""       # a planted dispatch bug (harness.rank.faults.DISPATCH_KINDS), "" in an honest run

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w_gate_up[index]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down[index]

    def forward(self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        degree, local = self.group.degree, self.local_experts
        top_k = chosen.shape[-1]
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)           # the (token, choice) pairs grouped by expert, as GroupedExperts
        token_of = order // top_k
        counts = torch.bincount(flat, minlength=self.n_experts)
        # received[s, j]: rows source s sends for this rank's local expert j.
        sending = counts
        rows = tokens[token_of]
        if self.planted == "misroute":      # each destination's rows and counts go to the next rank
            sending = counts.view(degree, local).roll(1, dims=0).reshape(-1)
            rows = torch.cat(_rolled_blocks(rows, counts.view(degree, local).sum(dim=1).tolist()))
        received = self.group.exchange.counts(sending).view(degree, local)
        send_splits = sending.view(degree, local).sum(dim=1).tolist()
        receive_splits = received.sum(dim=1).tolist()
        self.log.add(sum(send_splits), sum(receive_splits))
        self.log.dispatch_element_bytes = tokens.element_size()

        rows = self.group.exchange.rows(rows, send_splits, receive_splits)
        # Rows arrive by source s, then expert j: regrouped by expert, then source, by a stable sort on j x degree + s.
        device = rows.device
        key = torch.arange(local, device=device).view(1, local) * degree + torch.arange(degree, device=device).view(
            degree, 1)
        by_expert = torch.repeat_interleave(key.reshape(-1), received.reshape(-1)).argsort(stable=True)
        grouped = rows[by_expert]
        outputs, start = [], 0
        for index, count in enumerate(received.sum(dim=0).tolist()):
            outputs.append(self.expert(index, grouped[start:start + count]))
            start += count
        back = torch.cat(outputs)[by_expert.argsort()]      # source, then expert again
        self.log.combine_element_bytes = back.element_size()
        returned = self.group.exchange.rows(back, receive_splits, send_splits)
        if self.planted == "misroute":      # back into the order the rows were taken in
            returned = torch.cat(_rolled_blocks(returned, send_splits, back=True))
        if self.planted == "ungated-combine":
            return torch.zeros_like(tokens).index_add_(0, token_of, returned)
        weighted = returned * weights.reshape(-1)[order].unsqueeze(-1).to(tokens.dtype)
        return torch.zeros_like(tokens).index_add_(0, token_of, weighted)


def _rolled_blocks(rows: torch.Tensor, sizes: list[int], back: bool = False) -> list[torch.Tensor]:
    """`rows` cut into blocks of `sizes`, the blocks turned one place on (block d to place d + 1), or back."""
    blocks = list(rows.split(sizes))
    return blocks[1:] + blocks[:1] if back else blocks[-1:] + blocks[:-1]


def plant_dispatch_fault(modules: list[Dispatcher], kind: str) -> None:
    """Make every dispatch wrong in the way `kind` names (harness.rank.faults.DISPATCH_KINDS); ValueError where it
    would change nothing (a planted bug that plants none would pass parity and prove nothing): no dispatch (experts
    replicated), or one rank's group, where `misroute` sends each rank's rows back to it."""
    if not modules:
        raise ValueError(f"the planted dispatch bug {kind!r} needs an expert-parallel dispatch, and this cell has none")
    if kind == "misroute" and modules[0].degree < 2:
        raise ValueError("the planted dispatch bug 'misroute' needs 2 or more expert-parallel ranks to send rows to")
    for module in modules:
        module.planted = kind


def shard_experts(layers: list[nn.Module], group: Group) -> tuple[list[ExpertParallelExperts], RoutingLog]:
    """Replace every block's experts by this rank's share of them (in place); the sharded modules and the log they
    write to."""
    log = RoutingLog()
    sharded = []
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, MoEFeedForward):
                experts = module.experts.w_gate_up.shape[0]
                if experts % group.degree:
                    raise ValueError(f"{experts} experts do not divide over {group.degree} expert-parallel ranks")
                module.experts = ExpertParallelExperts(module.experts, group, log)
                sharded.append(module.experts)
    return sharded, log


def expected_all_to_all_bytes(*, rows_sent: int, rows_received: int, dispatches: int, n_embd: int,
                              dispatch_element_bytes: int, combine_element_bytes: int, n_experts: int,
                              recomputed_rows_sent: int = 0, recomputed_rows_received: int = 0,
                              recomputed_dispatches: int = 0) -> int:
    """The all-to-all bytes a rank's counter sees for this routing (module docstring): the dispatch's input its sent
    rows and its backward's its received ones, in the dispatched rows' dtype (a gradient has its tensor's); the
    combine's input its received rows and its backward's its sent ones, in the outputs' dtype; each dispatch's count
    exchange E int64 values. A forward recomputed inside backward exchanges its counts, rows and outputs again, and
    nothing more: the backward exchanges are the first forward's."""
    db, cb = dispatch_element_bytes, combine_element_bytes
    first = (rows_sent + rows_received) * n_embd * (db + cb) + dispatches * n_experts * COUNT_BYTES
    again = ((recomputed_rows_sent * db + recomputed_rows_received * cb) * n_embd
             + recomputed_dispatches * n_experts * COUNT_BYTES)
    return first + again


def expected_all_to_all_figures(routed_by_step: list[dict[str, int]], warmup_steps: int, n_embd: int,
                                n_experts: int) -> dict[str, Any]:
    """A rank's expected all-to-all bytes in each step from what it routed, and their mean over the timed steps (those
    the counter counts): its row's `strategy_figures_by_rank` (harness.derive.experts)."""
    by_step = [expected_all_to_all_bytes(**routed, n_embd=n_embd, n_experts=n_experts) for routed in routed_by_step]
    timed = by_step[warmup_steps:]
    return {"expected_all_to_all_bytes_by_step": by_step,
            "expected_all_to_all_bytes_per_timed_step": sum(timed) / len(timed) if timed else None}


@dataclass
class ExpertGradients:
    """What a rank does to its experts' gradients once a step, after backward: they hold the sum over every token its
    expert-parallel group routed to them of each source's loss gradient, each source's loss already divided by its
    micro-batches; the plain loop's gradient is the mean over every data-parallel rank's, so they are summed over the
    ranks holding the same experts (the other expert-parallel groups, `replicas`) and divided by the data-parallel
    ranks."""

    parameters: list[nn.Parameter]
    data_parallel: int
    replicas: Any = None            # the process group of the ranks holding these experts; None where they are alone
    scale: float = field(init=False)

    def __post_init__(self) -> None:
        self.scale = 1.0 / self.data_parallel

    def reduce(self) -> None:
        import torch.distributed as dist

        for parameter in self.parameters:
            if parameter.grad is None:
                continue
            if self.replicas is not None:
                dist.all_reduce(parameter.grad, group=self.replicas)
            parameter.grad.mul_(self.scale)


class ExpertParallelParts:
    """The trainer methods `ep` and `horovod-ep` share, for a trainer with `model`, `context`, `spec`, `expert_names`
    (its experts' parameter names as the unwrapped model has them), `reports_experts`, `routed_by_step`, `n_embd` and
    `n_experts`: each parameter as a part whose squares add up over the ranks, and the routing's figures."""

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def reduce_experts_and_update(self, gradients_ready) -> None:
        """A step's end once backward and the dense part's reduction are done: the experts' gradients reduced
        (`ExpertGradients`), the step's routing recorded, the gradients unscaled where a loss scale is kept, the
        probe given them (`gradients_ready`), and the update."""
        from harness.strategies.base import apply_update

        self.experts.reduce()
        self.routed_by_step.append(self.routing.take())
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if gradients_ready is not None:
            gradients_ready()
        self.step_outcome = apply_update(self.optimizer, self.scaler)
        self.optimizer.zero_grad(set_to_none=True)

    def _parts(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A dense (replicated) tensor on rank 0 alone, an expert slice on the ranks that report experts (the first
        group's: the other groups hold the same experts again), an empty part elsewhere."""
        return [tensor if (self.reports_experts if name in self.expert_names else self.context.rank == 0)
                else tensor.new_empty(0) for name, tensor in zip(self.parameter_names(), tensors)]

    def local_parameters(self):
        return self._parts(self._trainable()), True

    def local_gradients(self):
        return self._parts([p.grad for p in self._trainable()]), True

    def parameters_held(self, whole_model: int) -> int:
        return sum(p.numel() for p in self._trainable())

    def expert_parameters_held(self) -> int:
        return sum(p.numel() for name, p in zip(self.parameter_names(), self._trainable()) if name in self.expert_names)

    def rank_figures(self):
        """The rows this rank sent to and received from its group per step, and the all-to-all bytes they make its
        counter expect (`expected_all_to_all_figures`)."""
        return {"expert_parallel": {
            "routed_by_step": self.routed_by_step,
            **expected_all_to_all_figures(self.routed_by_step, self.spec.warmup_steps, self.n_embd, self.n_experts)}}
