"""Expert parallelism's dispatch and combine (harness.strategies.expert_parallel) without a process group: D ranks
simulated by threads in this process, exchanging through a board in place of an all-to-all, each rank's experts
the slice of one GroupedExperts (workloads.moe) that the plain model holds whole. Each rank's outputs, its tokens'
gradients and its experts' gradients must be the plain model's; the planted bugs must change them; and the bytes the
exchanges carried must be those the routing log makes the counter expect, activation checkpointing's recomputation
included.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from harness.strategies.expert_parallel import (ExpertParallelExperts, Group, RoutingLog, expected_all_to_all_bytes,
                                                plant_dispatch_fault)
from workloads.moe import GroupedExperts

HIDDEN, WIDTH = 8, 6


class Board:
    """Where D simulated ranks leave what each sends every other and take what they receive: an all-to-all. Every
    exchange's input bytes are noted per rank, as the counter sizes an all_to_all."""

    def __init__(self, degree: int) -> None:
        self.degree = degree
        self.slots: list = [None] * degree
        self.barrier = threading.Barrier(degree)
        self.bytes = [0] * degree

    def exchange(self, rank: int, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        self.slots[rank] = chunks
        self.bytes[rank] += sum(c.numel() * c.element_size() for c in chunks)
        self.barrier.wait()
        received = [self.slots[source][rank] for source in range(self.degree)]
        self.barrier.wait()
        return received


class BoardAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send, receive, board, rank):
        ctx.receive, ctx.board, ctx.rank = receive, board, rank
        return torch.cat(board.exchange(rank, list(rows.split(send))))

    @staticmethod
    def backward(ctx, gradient):
        sent_back = torch.cat(ctx.board.exchange(ctx.rank, list(gradient.contiguous().split(ctx.receive))))
        return sent_back, None, None, None, None


class BoardExchange:
    """TorchExchange's two calls, through the board."""

    def __init__(self, board: Board, rank: int) -> None:
        self.board, self.rank = board, rank

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.board.exchange(self.rank, list(counts.chunk(self.board.degree))))

    def rows(self, rows, send_splits, receive_splits):
        return BoardAllToAll.apply(rows, send_splits, receive_splits, self.board, self.rank)


def routed_tokens(degree: int, experts: int, top_k: int, tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    inputs, chosen, weights = [], [], []
    for rank in range(degree):
        inputs.append(torch.randn(tokens, HIDDEN, generator=generator))
        # Rank 0 routes every token to experts 0..k-1 alone: the other experts get none of its rows.
        choice = (torch.arange(top_k).expand(tokens, top_k) if rank == 0 else
                  torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]))
        chosen.append(choice)
        w = torch.rand(tokens, top_k, generator=generator)
        weights.append(w / w.sum(-1, keepdim=True))
    return inputs, chosen, weights


def run(degree: int, experts: int, top_k: int, tokens: int = 5, planted: str = "", recompute: bool = False):
    """(per rank: output, its tokens' gradient, its experts' two gradients, its log's take()), the board, and the
    plain model's (outputs, tokens' gradients, w_gate_up and w_down gradients)."""
    torch.manual_seed(0)
    whole = GroupedExperts(experts, HIDDEN, WIDTH)
    for parameter in whole.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    inputs, chosen, weights = routed_tokens(degree, experts, top_k, tokens, seed=degree * 100 + experts)
    probes = [torch.randn(tokens, HIDDEN) for _ in range(degree)]
    plain_outputs, plain_gradients = [], []
    for x, c, w, probe in zip(inputs, chosen, weights, probes):
        x = x.clone().requires_grad_()
        out = whole(x, c, w)
        (out * probe).sum().backward()
        plain_outputs.append(out.detach())
        plain_gradients.append(x.grad)
    board = Board(degree)
    results: list = [None] * degree
    failures: list = []

    def rank_runs(rank: int) -> None:
        try:
            log = RoutingLog()
            module = ExpertParallelExperts(whole, Group(BoardExchange(board, rank), degree, rank), log)
            if planted:
                plant_dispatch_fault([module], planted)
            x = inputs[rank].clone().requires_grad_()
            if recompute:
                out = checkpoint(lambda t: module(t, chosen[rank], weights[rank]), x, use_reentrant=False)
            else:
                out = module(x, chosen[rank], weights[rank])
            (out * probes[rank]).sum().backward()
            results[rank] = (out.detach(), x.grad, module.w_gate_up.grad, module.w_down.grad, log.take())
        except Exception as error:      # noqa: BLE001 - the other threads must not wait for this one forever
            failures.append(error)
            board.barrier.abort()

    threads = [threading.Thread(target=rank_runs, args=(rank,)) for rank in range(degree)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    return results, board, (plain_outputs, plain_gradients, whole.w_gate_up.grad, whole.w_down.grad)


@pytest.mark.parametrize("degree, experts, top_k", [(2, 2, 1), (2, 4, 2), (4, 4, 2), (4, 8, 3), (2, 8, 4)])
def test_each_rank_computes_the_plain_models_outputs_and_gradients(degree, experts, top_k):
    results, _, (outputs, gradients, gate_up, down) = run(degree, experts, top_k)
    local = experts // degree
    for rank, (out, x_grad, gate_up_grad, down_grad, _) in enumerate(results):
        assert torch.allclose(out, outputs[rank], atol=1e-6), rank
        assert torch.allclose(x_grad, gradients[rank], atol=1e-6), rank
        # Its experts' gradients hold every rank's tokens routed to them, as the whole model's do.
        assert torch.allclose(gate_up_grad, gate_up[rank * local:(rank + 1) * local], atol=1e-5), rank
        assert torch.allclose(down_grad, down[rank * local:(rank + 1) * local], atol=1e-5), rank


@pytest.mark.parametrize("planted", ["misroute", "ungated-combine"])
def test_a_planted_dispatch_bug_changes_the_outputs(planted):
    results, _, (outputs, _, _, _) = run(2, 4, 2, planted=planted)
    assert max((out - expected).abs().max().item() for (out, *_), expected in zip(results, outputs)) > 1e-2


def test_a_planted_bug_that_would_change_nothing_is_refused():
    module = ExpertParallelExperts(GroupedExperts(2, HIDDEN, WIDTH), Group(None, 1, 0), RoutingLog())
    with pytest.raises(ValueError, match="needs 2 or more expert-parallel ranks"):
        plant_dispatch_fault([module], "misroute")
    with pytest.raises(ValueError, match="this cell has none"):
        plant_dispatch_fault([], "ungated-combine")


@pytest.mark.parametrize("recompute", [False, True])
def test_the_bytes_exchanged_are_those_the_routing_log_expects(recompute):
    results, board, _ = run(4, 8, 2, tokens=7, recompute=recompute)
    for rank, (*_, taken) in enumerate(results):
        # 7 tokens x 2 choices sent by each rank; what it received is its experts' share of everyone's.
        assert taken["rows_sent"] == 14 and taken["dispatches"] == 1
        assert taken["recomputed_dispatches"] == (1 if recompute else 0)
        expected = expected_all_to_all_bytes(**taken, n_embd=HIDDEN, n_experts=8)
        assert board.bytes[rank] == expected, (rank, taken)
    # By hand for rank 0 without recomputation: counts 8 x 8 bytes, rows out and back 14 + R each way, 8 fp32 values.
    if not recompute:
        taken = results[0][-1]
        assert board.bytes[0] == 64 + 2 * (14 + taken["rows_received"]) * HIDDEN * 4
