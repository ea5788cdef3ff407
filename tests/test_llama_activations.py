"""Activation memory of a Llama block (harness.derive.activations.llama_block_activations) worked out by hand for
llama-tiny, and against the bytes a real LlamaBlock saves for backward (torch.autograd.graph.saved_tensors_hooks,
as tests/test_activations.py measures GPT's block): whole in fp32 and under bf16 autocast on the CPU, checkpointed,
and at TP 2 (a launch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

from harness.derive.activations import llama_block_activations, predicted_activation_bytes, recomputed_block_activations
from workloads import get_workload
from workloads.llama import LlamaBlock, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent

# llama-tiny's block, and one whose s, b, h, a, a_kv and i all differ, so that no two can be swapped unseen (s 32,
# b 3, h 48, a 6 heads of 8, a_kv 2, i 80).
TINY = dict(seq_len=64, micro_batch=4, hidden=64, heads=4, kv_heads=2, intermediate=192)
ODD = dict(seq_len=32, micro_batch=3, hidden=48, heads=6, kv_heads=2, intermediate=80)
ODD_CONFIG = LlamaConfig(vocab_size=64, seq_len=32, n_layer=1, n_embd=48, n_head=6, n_kv_head=2, intermediate_size=80)


def test_the_llama_block_by_hand():
    # llama-tiny: s 64, b 4, h 64, a 4 heads of 16, a_kv 2 key/value heads (h_kv = 32), i 192: s b = 256 tokens,
    # s b h = 16,384 values.
    fp32 = llama_block_activations(**TINY)
    # Whole, 24 B a value: the 2 norms' inputs and their normalised inputs x / rms(x), fp32, and wqkv's and
    # gate|up's inputs, 4 B each. Split, 1,056 values a token of 4 B: wqkv's output 64 + 2 x 32 (v views it), the
    # rotated q 64 and k 32, the attention output 64; gate|up's output 2 x 192, silu(gate) 192, the product 192.
    # Statistics: 2 norms x 4 B a token, and the log-sum-exp, 4 heads x 4 B a token. Rotary: cos and sin, s x
    # head_dim = 64 x 16 each, 4 B.
    assert (fp32.whole, fp32.split, fp32.statistics, fp32.rotary, fp32.weight_copies) == (
        16_384 * 24, 256 * 1_056 * 4, 256 * 8 + 256 * 4 * 4, 2 * 64 * 16 * 4, 0)
    assert fp32.total == 393_216 + 1_081_344 + 6_144 + 8_192 == 1_488_896
    # bf16 autocast: norm inputs and their normalised copies stay fp32 (16 B a value), the two linear inputs bf16
    # (4 B); 1,056 bf16 values a token; the statistics fp32 as before; the tables bf16; and bf16 copies of the four
    # weights: wqkv 64 x 128, wo 64 x 64, gate|up 64 x 384, w_down 192 x 64 = 49,152 values, 2 B each.
    bf16 = llama_block_activations(**TINY, compute_bytes=2)
    assert (bf16.whole, bf16.split, bf16.statistics, bf16.rotary, bf16.weight_copies) == (
        16_384 * 20, 256 * 1_056 * 2, 6_144, 2 * 64 * 16 * 2, 49_152 * 2)
    assert bf16.total == 327_680 + 540_672 + 6_144 + 4_096 + 98_304 == 976_896
    # TP 2: each rank 2 query heads and 1 key/value head, 96 of the MLP's width: the split values, the log-sum-exp
    # and the weight copies halve; norms, linear inputs and the rotary tables stay whole.
    tp2 = llama_block_activations(**TINY, tp=2)
    assert tp2.total == 393_216 + 1_081_344 / 2 + 256 * 8 + 256 * 2 * 4 + 8_192 == 946_176
    assert llama_block_activations(**TINY, tp=2, compute_bytes=2).total == (
        327_680 + 540_672 / 2 + 2_048 + 2_048 + 4_096 + 98_304 / 2) == 655_360
    # CUDA's fused RMSNorm keeps no x / rms(x): 2 x 4 B a value fewer, 131,072 B.
    assert llama_block_activations(**TINY, compute_bytes=2, fused_norm=True).total == 976_896 - 131_072
    with pytest.raises(ValueError, match="key/value heads"):
        llama_block_activations(**TINY, tp=4)       # 4 query heads, but 2 key/value heads
    # Checkpointed, its fp32 input alone: 4 x 16,384 B.
    assert recomputed_block_activations(seq_len=64, micro_batch=4, hidden=64) == 65_536


LLAMA_TINY = {"family": "llama", "seq_len": 64, "n_layer": 4, "n_embd": 64, "n_head": 4, "n_kv_head": 2,
              "intermediate_size": 192}


def test_a_llama_rows_predicted_activations_follow_its_shape_device_and_recipe():
    spec = {"workload": "llama-tiny", "strategy": "tp", "micro_batch": 4, "precision": "fp32", "device": "cpu"}
    row = {"workload_description": LLAMA_TINY, "strategy_config": {"tensor_parallel": 2}, "precision_recipe": "fp32"}
    # 4 blocks at TP 2 in fp32 (946,176 B each, above); 2 of them checkpointed keep 65,536 B each.
    assert predicted_activation_bytes(spec, row) == 4 * 946_176
    assert predicted_activation_bytes(spec, {**row, "activation_checkpointed_blocks": 2}) == 2 * 946_176 + 2 * 65_536
    # On CUDA under autocast, one rank: the fused RMSNorm's 845,824 B a block.
    gpu = {**spec, "strategy": "ddp", "precision": "bf16", "device": "cuda"}
    assert predicted_activation_bytes(gpu, {**row, "strategy_config": {}, "precision_recipe": "autocast"}) == (
        4 * 845_824)
    # Not described: fp32 on CUDA (the math attention kernel), the pipeline, sequence parallelism, bf16 weights.
    assert predicted_activation_bytes({**spec, "device": "cuda"}, row) is None
    assert predicted_activation_bytes({**spec, "strategy": "pipeline"}, row) is None
    assert predicted_activation_bytes(spec, {**row, "strategy_config": {"tensor_parallel": 2,
                                                                        "sequence_parallel": True}}) is None
    bf16_weights = {**row, "precision_recipe": "fsdp-mp-policy"}
    assert predicted_activation_bytes({**spec, "precision": "bf16"}, bf16_weights) is None


def test_the_llama_description_holds_what_the_formula_reads():
    described = get_workload("llama-tiny").describe()
    assert {key: described[key] for key in LLAMA_TINY} == LLAMA_TINY


def saved_bytes(block: torch.nn.Module, x: torch.Tensor, bf16: bool, recompute: bool = False) -> Counter:
    """The storages a block's forward saves for backward, parameters left out, each once: {bytes: how many}."""
    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if recompute:
                torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                block(x)
    return Counter(storages.values())


def _measured(config: LlamaConfig, batch: int) -> dict[str, Counter]:
    torch.manual_seed(0)
    block = LlamaBlock(config)
    x = torch.randn(batch, config.seq_len, config.n_embd, requires_grad=True)
    return {f"{p}{'-recompute' * recompute}": saved_bytes(block, x, p == "bf16", recompute)
            for p in ("fp32", "bf16") for recompute in (False, True)}


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, Counter]]:
    return {"tiny": _measured(get_workload("llama-tiny").config, 4), "odd": _measured(ODD_CONFIG, 3)}


def test_each_tensor_a_real_llama_block_saves_is_a_term_of_the_formula(measured):
    # llama-tiny in fp32, storage by storage (bytes: how many): 65,536 B = s b h x 4 for the two norms' inputs,
    # their normalised inputs, wqkv's and gate|up's inputs, the rotated q and the attention's output (8); 1,024 B =
    # s b x 4 for the two reciprocal RMSs; 4,096 B for cos and sin (s x head_dim x 4) and the log-sum-exp (a s b
    # x 4); 32,768 B the rotated k (s b h_kv x 4); 131,072 B wqkv's whole output, s b (h + 2 h_kv) x 4, which v
    # views; 393,216 B gate|up's output, s b 2i x 4; 196,608 B silu(gate) and the product, s b i x 4 each.
    assert measured["tiny"]["fp32"] == Counter({65_536: 8, 1_024: 2, 4_096: 3, 32_768: 1, 131_072: 1,
                                                393_216: 1, 196_608: 2})


@pytest.mark.parametrize("name, shape", [("tiny", TINY), ("odd", ODD)])
def test_a_real_llama_block_saves_what_the_formula_says(measured, name, shape):
    total = {key: sum(size * count for size, count in found.items()) for key, found in measured[name].items()}
    predicted = {p: llama_block_activations(**shape, compute_bytes=4 if p == "fp32" else 2).total
                 for p in ("fp32", "bf16")}
    inputs = recomputed_block_activations(seq_len=shape["seq_len"], micro_batch=shape["micro_batch"],
                                          hidden=shape["hidden"])
    assert total == {**predicted, "fp32-recompute": inputs, "bf16-recompute": inputs}
    if name == "tiny":
        assert total == {"fp32": 1_488_896, "bf16": 976_896, "fp32-recompute": 65_536, "bf16-recompute": 65_536}
    # Planted mistakes the measurement refuses: k and v at n_head (no grouped-query saving), the MLP at GPT's 4h
    # instead of intermediate_size, and the fused RMSNorm's terms (CUDA's) on the CPU.
    for p, compute_bytes in (("fp32", 4), ("bf16", 2)):
        for wrong in ({**shape, "kv_heads": shape["heads"]}, {**shape, "intermediate": 4 * shape["hidden"]}):
            assert llama_block_activations(**wrong, compute_bytes=compute_bytes).total != total[p]
        assert llama_block_activations(**shape, compute_bytes=compute_bytes, fused_norm=True).total != total[p]


MEASURE_TP = r'''
"""Bytes a Llama block's forward saves for backward at TP 2 (storages, parameters left out)."""
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from harness.rank.teardown import exit_without_teardown
from harness.strategies.tensor_parallel import parallelize_blocks
from workloads import get_workload
from workloads.llama import LlamaBlock, LlamaConfig


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def saved_bytes(block, x, bf16):
    parameters = {local(p).untyped_storage().data_ptr() for p in block.parameters()}
    storages = {}

    def pack(tensor):
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            block(x)
    return sum(storages.values())


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
found = {}
odd = LlamaConfig(vocab_size=64, seq_len=32, n_layer=1, n_embd=48, n_head=6, n_kv_head=2, intermediate_size=80)
for name, config, batch in (("tiny", get_workload("llama-tiny").config, 4), ("odd", odd, 3)):
    torch.manual_seed(0)
    block = LlamaBlock(config)
    x = torch.randn(batch, config.seq_len, config.n_embd, requires_grad=True)
    parallelize_blocks([block], mesh)
    found.update({f"{name}-tp2-{p}-rank{dist.get_rank()}": saved_bytes(block, x, p == "bf16")
                  for p in ("fp32", "bf16")})
gathered = [None, None]
dist.all_gather_object(gathered, found)
if dist.get_rank() == 0:
    json.dump({k: v for part in gathered for k, v in part.items()}, open(sys.argv[1], "w"))
dist.destroy_process_group()
exit_without_teardown(0)  # as the harness's ranks end: Gloo's threads can abort the interpreter's tear-down
'''


@pytest.mark.launch
def test_a_real_llama_block_at_tp_2_saves_what_the_formula_says(tmp_path):
    script, out = tmp_path / "measure.py", tmp_path / "saved.json"
    script.write_text(MEASURE_TP)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(out.read_text())
    predicted = {f"{name}-tp2-{p}-rank{rank}": llama_block_activations(**shape, tp=2,
                                                                        compute_bytes=4 if p == "fp32" else 2).total
                 for name, shape in (("tiny", TINY), ("odd", ODD)) for p in ("fp32", "bf16") for rank in (0, 1)}
    assert measured == predicted
    # llama-tiny, each rank: 946,176 B in fp32, 655,360 B under bf16 autocast (test_the_llama_block_by_hand).
    assert {measured[f"tiny-tp2-{p}-rank{rank}"] for p in ("fp32", "bf16") for rank in (0, 1)} == {946_176, 655_360}


def test_a_projected_llama_cell_holds_its_blocks_tensor_parallel_share_at_every_size():
    from harness.project.facts import REGISTRY_FACTS
    from harness.project.projection import Scaling, bases_from_rows, project, transformer_shape
    from test_project_hybrid import RING, _fsdp2_tp_row, _plain_row

    # The shape a row's description gives the projection: the Llama block's key/value heads and MLP width beside
    # GPT's four sizes, and the device the row ran on (RMSNorm's kernel).
    described = get_workload("llama-tiny").describe()
    assert transformer_shape(described, "cpu") == {"family": "llama", "device": "cpu", **{
        key: value for key, value in LLAMA_TINY.items() if key != "family"}}
    assert transformer_shape({"family": "resnet"}) is None
    # An fsdp2-tp cell of llama-tiny at tp 2, micro-batch 4 (its traffic figures are gpt-tiny's, which the
    # activations do not read): every rank holds 4 blocks of 946,176 B at any size (test_the_llama_block_by_hand),
    # checkpointed 4 inputs of 65,536 B.
    row, plain = _fsdp2_tp_row(), _plain_row()
    for each in (row, plain):
        each["spec"]["workload"] = "llama-tiny"
    row["measurements"]["workload_description"] = described
    [basis], _ = bases_from_rows([row, plain], REGISTRY_FACTS)
    points, _ = project(basis, (8, 16), RING, REGISTRY_FACTS, (Scaling.WEAK,))
    assert [(p.world_size, p.activation_bytes_per_rank, p.activation_bytes_checkpointed_per_rank) for p in points] == [
        (8, 4 * 946_176, 4 * 65_536), (16, 4 * 946_176, 4 * 65_536)]
    # The same cell measured on CUDA in fp32: the math attention kernel, which the formula does not describe.
    for each in (row, plain):
        each["spec"]["device"] = "cuda"
    [basis], _ = bases_from_rows([row, plain], REGISTRY_FACTS)
    [point] = project(basis, (8,), RING, REGISTRY_FACTS, (Scaling.WEAK,))[0]
    assert (point.activation_bytes_per_rank, point.activation_bytes_checkpointed_per_rank) == (None, None)


def test_the_llama_block_with_bf16_weights_by_hand():
    from harness.derive.activations import rank_activation_bytes

    # llama-tiny under bf16 weights (no autocast), on the CPU: the composite RMSNorm still keeps an fp32 copy of its
    # input and the fp32 x / rms(x) (16 B a value for the two norms), the two linear inputs are bf16 (4 B); 1,056
    # bf16 values a token split; the fp32 statistics (2 norms x 4 B and 4 heads x 4 B a token); the bf16 rotary
    # tables; no weight copies: autocast's 976,896 B less its 98,304 B of copies.
    cpu = llama_block_activations(**TINY, compute_bytes=2, bf16_weights=True)
    assert (cpu.whole, cpu.split, cpu.statistics, cpu.rotary, cpu.weight_copies) == (
        16_384 * 20, 256 * 1_056 * 2, 256 * 8 + 256 * 4 * 4, 2 * 64 * 16 * 2, 0)
    assert cpu.total == 327_680 + 540_672 + 6_144 + 4_096 == 878_592 == 976_896 - 98_304
    # CUDA's fused RMSNorm keeps its bf16 input alone: 2 + 2 B a value for the norms instead of 16.
    cuda = llama_block_activations(**TINY, compute_bytes=2, bf16_weights=True, fused_norm=True)
    assert cuda.whole == 16_384 * (2 * 2 + 2 * 2)
    assert cuda.total == 878_592 - 16_384 * 12
    # TP 2: the split values and the log-sum-exp halve, the rest stays whole.
    assert llama_block_activations(**TINY, tp=2, compute_bytes=2, bf16_weights=True).total == (
        327_680 + 540_672 / 2 + 2_048 + 2_048 + 4_096)
    # Checkpointed, the bf16 input: 2 x 16,384 B.
    assert rank_activation_bytes(seq_len=64, micro_batch=4, hidden=64, heads=4, kv_heads=2, intermediate=192,
                                 layers=4, compute_bytes=2, bf16_weights=True, checkpointed=True) == 4 * 32_768


@pytest.mark.parametrize("name, shape, config", [("tiny", TINY, None), ("odd", ODD, ODD_CONFIG)])
def test_a_real_llama_block_with_bf16_weights_saves_what_the_formula_says(name, shape, config):
    config = config or get_workload("llama-tiny").config
    torch.manual_seed(0)
    block = LlamaBlock(config).to(torch.bfloat16)
    x = torch.randn(shape["micro_batch"], config.seq_len, config.n_embd, dtype=torch.bfloat16, requires_grad=True)
    found = {recompute: saved_bytes(block, x, bf16=False, recompute=recompute) for recompute in (False, True)}
    total = {recompute: sum(size * count for size, count in counts.items()) for recompute, counts in found.items()}
    predicted = llama_block_activations(**shape, compute_bytes=2, bf16_weights=True).total
    inputs = recomputed_block_activations(seq_len=shape["seq_len"], micro_batch=shape["micro_batch"],
                                          hidden=shape["hidden"], bf16_weights=True)
    assert total == {False: predicted, True: inputs}
    if name == "tiny":
        assert total == {False: 878_592, True: 32_768}
        # Storage by storage (bytes: how many): 65,536 = s b h x 4, the norms' fp32 upcast inputs and fp32 x / rms(x)
        # (4); 32,768 = s b h x 2, wqkv's, wo's and gate|up's bf16 inputs and the rotated q (4); 1,024, the fp32
        # reciprocal RMSs (2); 2,048, the bf16 cos and sin (2); 4,096, the log-sum-exp; 16,384, the rotated k; 65,536
        # again, wqkv's whole bf16 output, which v views; 196,608, gate|up's output; 98,304, silu(gate) and the product.
        assert found[False] == Counter({65_536: 5, 32_768: 4, 1_024: 2, 2_048: 2, 4_096: 1, 16_384: 1,
                                        196_608: 1, 98_304: 2})
