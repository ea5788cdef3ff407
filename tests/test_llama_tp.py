"""Tensor parallelism of the Llama blocks (harness.strategies.tensor_parallel, `tp`, `fsdp2-tp`, `autotp`): the fused
q|k|v and gate|up rows each rank holds, worked out by hand from the unsplit weights; a split block computing what the
whole one does (and a planted misordering that does not); the refusal of a degree that splits a key/value head; the
parameters a rank holds and the traffic a step issues, by hand; and on real ranks, DTensor's split block and model
against the whole, and fsdp2-tp and autotp against the plain loop with their collectives counted."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.spec import RunSpec
from harness.strategies import get_strategy
from harness.strategies.tensor_parallel import (block_layout, gate_up_order, grouped_qkv_order, partial_gradient_sizes,
                                                reorder_fused_rows, split_parameter_count)
from workloads import WORKLOADS
from workloads.llama import LlamaBlock

ROOT = Path(__file__).resolve().parent.parent

# llama-tiny (workloads/llama.py): h = 64, 4 query heads and 2 key/value heads of 16, SwiGLU width 192, 4 blocks,
# vocabulary 512 rows, untied head. wqkv's 128 rows: q 0-63 (head j: 16 j .. 16 j + 15), k 64-95, v 96-127.
H, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCABULARY = 64, 4, 2, 16, 192, 512
CONFIG = WORKLOADS["llama-tiny"].config


def rows_of_rank_by_hand(rank: int, tp: int) -> list[int]:
    """wqkv rows rank `rank` of `tp` must hold, in the order the block splits them: its query heads [r H/tp,
    (r + 1) H/tp), then the key heads [r K/tp, (r + 1) K/tp) those query heads read (query head j reads key/value
    head j // 2), then the same value heads."""
    q = [row for head in range(rank * HEADS // tp, (rank + 1) * HEADS // tp)
         for row in range(head * HEAD_DIM, (head + 1) * HEAD_DIM)]
    k = [HEADS * HEAD_DIM + row for head in range(rank * KV_HEADS // tp, (rank + 1) * KV_HEADS // tp)
         for row in range(head * HEAD_DIM, (head + 1) * HEAD_DIM)]
    v = [(HEADS + KV_HEADS) * HEAD_DIM + row - HEADS * HEAD_DIM for row in k]
    return q + k + v


def test_rows_by_hand_at_a_glance():
    # TP 2: rank 0 the q rows of heads 0 and 1 (0-31), k head 0 (64-79), v head 0 (96-111); rank 1 the rest.
    assert rows_of_rank_by_hand(0, 2) == [*range(0, 32), *range(64, 80), *range(96, 112)]
    assert rows_of_rank_by_hand(1, 2) == [*range(32, 64), *range(80, 96), *range(112, 128)]
    # One head of one row each way, 4 query heads over 2 key/value heads: q 0-3, k 4-5, v 6-7.
    assert grouped_qkv_order(4, 2, 1, 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert gate_up_order(3, 1).tolist() == [0, 1, 2, 3, 4, 5]        # one rank: unchanged


def split_block(tp: int) -> tuple[LlamaBlock, LlamaBlock]:
    """(a llama-tiny block, a copy with its fused rows put in the layout's order for `tp` ranks)."""
    torch.manual_seed(0)
    whole = LlamaBlock(CONFIG).double()
    with torch.no_grad():     # norm weights away from 1, so that a norm applied without its weight shows
        whole.attention_norm.weight.uniform_(0.5, 1.5)
        whole.ffn_norm.weight.uniform_(0.5, 1.5)
    reordered = copy.deepcopy(whole)
    reorder_fused_rows(reordered, block_layout(reordered).fused_orders(reordered, tp))
    return whole, reordered


def test_after_the_split_each_rank_holds_its_query_heads_and_the_key_value_heads_they_read():
    whole, reordered = split_block(2)
    for rank in range(2):
        # What ColwiseParallel hands rank r: the r-th of 2 equal chunks of the rows (Shard(0)).
        held = reordered.wqkv.weight.chunk(2, dim=0)[rank]
        assert torch.equal(held, whole.wqkv.weight[rows_of_rank_by_hand(rank, 2)])
        # gate|up: rank r's 96 gate rows, then the same 96 rows of up (rows 192 onwards).
        gate = list(range(rank * 96, (rank + 1) * 96))
        assert torch.equal(reordered.w_gate_up.weight.chunk(2, dim=0)[rank],
                           whole.w_gate_up.weight[gate + [INTERMEDIATE + row for row in gate]])


def tensor_parallel_forward(block: LlamaBlock, x: torch.Tensor, tp: int) -> torch.Tensor:
    """Megatron's block on `tp` simulated ranks in one process: each rank a copy of `block` holding its row chunk of
    the column-parallel layers and its column chunk of the row-parallel ones, its partial outputs summed as the
    all-reduces sum them. A rank's attention alone is its block with a zero MLP (silu(0) x 0 = 0), its MLP alone its
    block with a zero wqkv (v = 0 attends to 0): each returns its input plus its partial sum."""
    layout = block_layout(block)

    def rank_copy(rank: int, silenced: str) -> LlamaBlock:
        local = copy.deepcopy(block)
        for names, dim in ((layout.column, 0), (layout.row, 1)):
            for name in names:
                weight = getattr(block, name).weight.chunk(tp, dim=dim)[rank]
                linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
                linear.weight = nn.Parameter(weight.clone())
                setattr(local, name, linear)
        nn.init.zeros_(getattr(local, silenced).weight)
        return local

    with torch.no_grad():
        attended = x + sum(rank_copy(rank, "w_gate_up")(x) - x for rank in range(tp))
        return attended + sum(rank_copy(rank, "wqkv")(attended) - attended for rank in range(tp))


def test_a_block_split_over_two_ranks_computes_the_whole_blocks_output():
    whole, reordered = split_block(2)
    x = torch.randn(2, 16, H, dtype=torch.float64)
    with torch.no_grad():
        expected = whole(x)
    assert torch.allclose(tensor_parallel_forward(reordered, x, 2), expected, atol=1e-12)
    # Planted: wqkv's rows split as they come (rank 0 all of q, rank 1 k and v as its "heads"), or gate|up's (rank 0
    # all of gate, rank 1 all of up): other models.
    for fused in ("wqkv", "w_gate_up"):
        planted = copy.deepcopy(reordered)
        getattr(planted, fused).weight = copy.deepcopy(getattr(whole, fused).weight)
        assert not torch.allclose(tensor_parallel_forward(planted, x, 2), expected, atol=1e-3), fused


def spec(strategy: str, world_size: int, workload: str = "llama-tiny", **options) -> RunSpec:
    return RunSpec(workload=workload, strategy=strategy, world_size=world_size, global_batch=8, micro_batch=4,
                   options=options)


def test_a_degree_that_splits_a_key_value_head_is_refused_in_one_line():
    refusal = "tensor parallelism of 4 must divide llama-tiny's 4 heads and 2 key/value heads (allowed: 1, 2)"
    assert get_strategy("tp").layout_refusal(spec("tp", 4)) == refusal
    assert get_strategy("fsdp2-tp").layout_refusal(spec("fsdp2-tp", 4, tp=4)) == refusal
    assert get_strategy("autotp").layout_refusal(spec("autotp", 4, tp=4)) == refusal
    assert get_strategy("tp").skip_reason(spec("tp", 4)) == refusal
    for strategy, world_size, options in (("tp", 2, {}), ("fsdp2-tp", 4, {"tp": 2}), ("autotp", 4, {"tp": 2})):
        assert get_strategy(strategy).layout_refusal(spec(strategy, world_size, **options)) is None
    # GPT's line is as it was; ResNet has no blocks to split.
    assert get_strategy("tp").layout_refusal(spec("tp", 8, "gpt-tiny")) == (
        "tensor parallelism of 8 must divide gpt-tiny's 4 heads")
    assert get_strategy("tp").layout_refusal(spec("tp", 2, "resnet20-cifar")) == (
        "tensor parallelism splits transformer blocks; resnet20-cifar has none")


def test_the_hybrid_matrix_picks_degrees_that_divide_the_key_value_heads():
    from harness.matrix import Machine, hybrid_options
    from harness.spec import DeviceKind

    cpu, node_of_8 = Machine(device=DeviceKind.CPU, devices_per_node=4), Machine(device=DeviceKind.CUDA,
                                                                                  devices_per_node=8)
    # llama-tiny's 2 key/value heads cap it at 2 where its 4 query heads would allow 4; Llama 3 8B's 8 allow 8.
    assert hybrid_options("fsdp2-tp", 4, cpu, "llama-tiny") == {"tp": 2}
    assert hybrid_options("autotp", 4, cpu, "gpt-tiny") == {"tp": 4}
    assert hybrid_options("autotp", 16, node_of_8, "llama3-8b") == {"tp": 8}


def test_a_rank_holds_the_split_layers_share_and_the_rest_whole_worked_by_hand():
    torch.manual_seed(0)
    layers = WORKLOADS["llama-tiny"].build_layers()
    # A block at TP 2: wqkv 64 x 128, wo 64 x 64, w_gate_up 64 x 384 and w_down 192 x 64 halved (no biases); its 2
    # norms (64 each) whole. The root: embedding and head 512 x 64 each, the final norm 64.
    block = (H * 128 + H * H + H * 2 * INTERMEDIATE + INTERMEDIATE * H) // 2 + 2 * H
    root = 2 * VOCABULARY * H + H
    assert (block, root) == (24_704, 65_600)
    assert split_parameter_count(layers, 2) == 4 * block + root == 164_416
    # Loss parallelism splits both vocabulary matrices too (untied: each counted).
    assert split_parameter_count(layers, 2, vocabulary=True) == 4 * block + root - VOCABULARY * H == 131_648
    # Sequence parallelism's partial gradients: every RMSNorm's weight, two a block and the final one.
    assert partial_gradient_sizes(layers) == [H] * 9


def test_tensor_parallel_traffic_on_llama_tiny_by_hand():
    from harness.derive.comm import Collective

    torch.manual_seed(0)
    layers = WORKLOADS["llama-tiny"].build_layers()
    # Global batch 16 in micro-batches of 4: K = 4 on the one replica. Each block and micro-batch all-reduces wo's and
    # w_down's outputs forward and wqkv's and w_gate_up's input gradients backward: b x s x h = 4 x 64 x 64 fp32.
    cell = RunSpec(workload="llama-tiny", strategy="tp", world_size=2, global_batch=16, micro_batch=4)
    collectives = get_strategy("tp").expected_traffic(cell, layers).collectives
    assert {(c.collective, c.size_bytes, c.group) for c in collectives} == {(Collective.ALL_REDUCE, 4 * 64 * 64 * 4,
                                                                             "tp")}
    assert sum(c.calls for c in collectives) == 4 * 4 * 4


def test_autotp_names_llama_blocks_layers_with_grouped_query_sub_parameters():
    from harness.strategies.autotp import layer_specs_of, split_by_name

    qkv, gate_up, rows = layer_specs_of(WORKLOADS["llama-tiny"])
    # q is 4 heads of 16 rows, k and v 2 heads each: three sub-parameters, each split by its heads.
    assert (qkv["shape"], qkv["partition_type"]) == ([[64, 32, 32], -1], "column")
    assert (gate_up["shape"], gate_up["partition_type"]) == ([2, -1], "column")
    assert rows["partition_type"] == "row"
    assert [split_by_name(f"1.{name}.weight") for name in ("wqkv", "w_gate_up", "wo", "w_down", "attention_norm")] \
        == [True, True, True, True, False]
    assert not split_by_name("6.output.weight")          # the untied head stays whole on every rank


SPLIT_ON_TWO_RANKS = r'''
"""llama-tiny's block and two small Llama models, whole and split over 2 ranks by parallelize_blocks (DTensor), with
and without sequence and loss parallelism: outputs and gradients compared on every rank."""
import copy, json, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from harness.rank.teardown import exit_without_teardown
from harness.strategies.tensor_parallel import parallelize_blocks, reduce_partial_gradients
from workloads import WORKLOADS
from workloads.llama import LlamaBlock, LlamaConfig, LlamaWorkload

ROWS = json.loads(sys.argv[2])          # {rank: wqkv rows by hand}
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
found = {}


def whole_of(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def close(a, b):
    return bool(torch.allclose(whole_of(a), whole_of(b), rtol=1e-5, atol=1e-6))


for sequence_parallel in (False, True):
    torch.manual_seed(0)
    whole = LlamaBlock(WORKLOADS["llama-tiny"].config)
    with torch.no_grad():
        whole.attention_norm.weight.uniform_(0.5, 1.5)
        whole.ffn_norm.weight.uniform_(0.5, 1.5)
    split = copy.deepcopy(whole)
    parallelize_blocks([split], mesh, sequence_parallel=sequence_parallel)
    x, weights = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    x_whole, x_split = x.clone().requires_grad_(), x.clone()
    if sequence_parallel:                   # the rank's slice of the sequence in, its slice out
        x_split, weights_split = x_split.chunk(2, dim=1)[rank], weights.chunk(2, dim=1)[rank]
    else:
        weights_split = weights
    x_split.requires_grad_()
    out_whole, out_split = whole(x_whole), split(x_split)
    (out_whole * weights).sum().backward()
    (out_split * weights_split).sum().backward()
    reduce_partial_gradients(list(split.parameters()))
    sliced = (lambda t: t.chunk(2, dim=1)[rank]) if sequence_parallel else (lambda t: t)
    name = "sequence-parallel" if sequence_parallel else "plain"
    found[f"{name}: output"] = close(out_split, sliced(out_whole))
    found[f"{name}: input gradient"] = close(x_split.grad, sliced(x_whole.grad))
    found[f"{name}: wqkv rows by hand"] = torch.equal(split.wqkv.weight.to_local(), whole.wqkv.weight[ROWS[str(rank)]])
    found[f"{name}: wqkv gradient rows by hand"] = close(split.wqkv.weight.grad.to_local(),
                                                         whole.wqkv.weight.grad[ROWS[str(rank)]])
    # The norms' whole (under sequence parallelism once their partial sums are added), the row-parallel weights' by
    # columns, as they come (no reordering).
    for module in ("attention_norm", "ffn_norm", "wo", "w_down"):
        found[f"{name}: {module} gradient"] = close(getattr(split, module).weight.grad,
                                                    getattr(whole, module).weight.grad)

# Whole models, their heads tied (Llama 3.2 1B's shape) and untied (llama-tiny's), their vocabulary split under loss
# parallelism: the loss, the embedding's gradient and the final norm's.
for tie in (True, False):
    config = LlamaConfig(vocab_size=128, seq_len=16, n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                         intermediate_size=64, tie_embeddings=tie)
    for sequence_parallel, loss_split in ((False, True), (True, True), (True, False)):
        torch.manual_seed(0)
        whole = nn.Sequential(*LlamaWorkload("small", config, None).build_layers())
        split = copy.deepcopy(whole)
        if tie:         # deepcopy keeps the tie within the copy
            assert split[-1].weight is split[0].tok_embeddings.weight
        parallelize_blocks(list(split), mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_split)
        tokens, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
        loss_whole = nn.functional.cross_entropy(whole(tokens).flatten(0, 1), targets.flatten())
        loss_whole.backward()
        if loss_split:
            with loss_parallel():
                loss_split_value = nn.functional.cross_entropy(split(tokens).flatten(0, 1), targets.flatten())
                loss_split_value.backward()
        else:
            loss_split_value = nn.functional.cross_entropy(split(tokens).flatten(0, 1), targets.flatten())
            loss_split_value.backward()
        reduce_partial_gradients(list(split.parameters()))
        name = f"{'tied' if tie else 'untied'} sp={sequence_parallel} lp={loss_split}"
        found[f"{name}: loss"] = close(loss_split_value, loss_whole)
        found[f"{name}: embedding gradient"] = close(split[0].tok_embeddings.weight.grad,
                                                     whole[0].tok_embeddings.weight.grad)
        found[f"{name}: final norm gradient"] = close(split[-2].norm.weight.grad, whole[-2].norm.weight.grad)
        found[f"{name}: block 1 wo gradient"] = close(split[1].wo.weight.grad, whole[1].wo.weight.grad)
        if not tie:
            found[f"{name}: head gradient"] = close(split[-1].output.weight.grad, whole[-1].output.weight.grad)

json.dump(found, open(f"{sys.argv[1]}.{rank}", "w"))
dist.destroy_process_group()
exit_without_teardown(0)  # as the harness's ranks end: Gloo's threads can abort the interpreter's tear-down
'''


@pytest.mark.launch
def test_dtensor_splits_llama_blocks_and_models_over_two_ranks_as_computed_whole(tmp_path):
    script, out = tmp_path / "split.py", tmp_path / "found.json"
    script.write_text(SPLIT_ON_TWO_RANKS)
    rows = json.dumps({rank: rows_of_rank_by_hand(rank, 2) for rank in range(2)})
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(out), rows], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        found = json.loads(Path(f"{out}.{rank}").read_text())
        assert len(found) == 2 * 8 + 2 * 3 * 4 + 3, found       # every comparison ran
        assert [name for name, same in found.items() if not same] == [], f"rank {rank}"


@pytest.mark.launch
def test_fsdp2_tp_and_autotp_on_llama_tiny_match_the_plain_loop_and_count_their_schedule(tmp_path):
    from harness.derive.parity import Verdict, judge
    from expected_traffic import expected_by_group

    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, "-m", "harness", "run", "--matrix", "smoke", "--workload", "llama-tiny",
                           "--strategy", "plain,fsdp2-tp,autotp", "--world-sizes", "2", "--warmup-steps", "1",
                           "--timed-steps", "3", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    verdicts = {row["spec"]["strategy"]: judgement.verdict for row, judgement in zip(rows, judge(rows))}
    assert verdicts == {"plain": Verdict.REFERENCE, "fsdp2-tp": Verdict.MATCH, "autotp": Verdict.MATCH}, \
        [row["message"] for row in rows]
    by_strategy = {row["spec"]["strategy"]: row["measurements"] for row in rows}
    # tp 2 over 2 ranks: one replica, K = global batch 16 / micro-batch 4 = 4. Each block (4) and micro-batch
    # all-reduces 2 outputs forward and 2 input gradients backward, b x s x h = 4 x 64 x 64 fp32 = 65,536 B.
    K, activation = 4, 4 * 64 * 64 * 4
    tensor_parallel = {"calls": 4 * 4 * K, "bytes": 4 * 4 * K * activation}
    for counts in by_strategy["fsdp2-tp"]["comm_per_step_by_rank"]:     # FSDP2 issues nothing over a dp group of one
        assert {kind: figures["by_group"] for kind, figures in counts.items()} == {"all_reduce": {
            "tp": tensor_parallel}}
    assert expected_by_group(by_strategy["fsdp2-tp"]) == {"all_reduce": {"tp": tensor_parallel}}
    # AutoTP counts the same, and one 4-byte fp32 all-reduce more in the tp group (the gradient norm's squares
    # summed over the model-parallel group, as on gpt-tiny: tests/test_hybrid.py).
    for counts in by_strategy["autotp"]["comm_per_step_by_rank"]:
        assert counts["all_reduce"]["by_group"]["tp"] == {"calls": 4 * 4 * K + 1,
                                                          "bytes": 4 * 4 * K * activation + 4}
    assert expected_by_group(by_strategy["autotp"])["all_reduce"] == {"tp": tensor_parallel}
    # Each rank holds half of every block's four projections and the rest whole (the unit test's 164,416).
    for strategy in ("fsdp2-tp", "autotp"):
        assert by_strategy[strategy]["parameters_held_by_rank"] == [164_416] * 2
