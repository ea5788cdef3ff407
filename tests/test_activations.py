"""Activation memory of a block (harness.derive.activations) against Korthikanti et al.'s published terms worked
out by hand, and against the bytes a real gpt-tiny block saves for backward, whole and at TP 2, fp32 and bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.derive.activations import block_activations, korthikanti_bytes_per_layer, recomputed_block_activations

ROOT = Path(__file__).resolve().parent.parent


def test_korthikantis_table_2_by_hand():
    # GPT-3 175B in their Table 3: s 2048, h 12288, a 96; 5 a s / h = 5 x 96 x 2048 / 12288 = 80.
    s, h, a = 2048, 12288, 96
    assert korthikanti_bytes_per_layer(seq_len=s, micro_batch=1, hidden=h, heads=a) == s * h * (34 + 80)
    # Tensor parallel of 8: s b h (10 + 24/8 + 80/8) = s b h x 23.
    assert korthikanti_bytes_per_layer(seq_len=s, micro_batch=1, hidden=h, heads=a, tp=8) == s * h * 23


def test_the_workloads_block_by_hand():
    # gpt-tiny: s 64, h 64, a 4, micro-batch 4: s b h = 16,384 values, s b = 256 tokens.
    fp32 = block_activations(seq_len=64, micro_batch=4, hidden=64, heads=4)
    # Whole: 2 layer-norm inputs + 2 column-parallel inputs, 4 bytes each; split: q, k, v, the attention
    # output, GeLU's input (4h) and output (4h), 12 values of 4 bytes; statistics: 16 B a token for the two
    # norms' mean and deviation, 4 B a head and token for the log-sum-exp.
    assert (fp32.whole, fp32.split, fp32.statistics, fp32.weight_copies) == (
        16_384 * 16, 16_384 * 48, 16 * 256 + 4 * 4 * 256, 0)
    assert fp32.total == 1_056_768
    bf16_tp2 = block_activations(seq_len=64, micro_batch=4, hidden=64, heads=4, tp=2, compute_bytes=2)
    # Norm inputs stay fp32 (8 B), column-parallel inputs bf16 (4 B); 12 bf16 values split over 2 ranks (12 B);
    # the log-sum-exp over 2 heads a rank; bf16 copies of half of each block's 12 h^2 weights.
    assert (bf16_tp2.whole, bf16_tp2.split, bf16_tp2.statistics, bf16_tp2.weight_copies) == (
        16_384 * 12, 16_384 * 12, 16 * 256 + 4 * 2 * 256, 2 * 12 * 64 * 64 / 2)
    with pytest.raises(ValueError, match="heads"):
        block_activations(seq_len=64, micro_batch=4, hidden=64, heads=4, tp=3)
    # A shape whose s, b, h and a all differ, so that no two can be swapped unseen: s 32, b 3, h 48, a 6 at TP 2
    # in fp32: s b h = 4,608 values, s b = 96 tokens.
    odd = block_activations(seq_len=32, micro_batch=3, hidden=48, heads=6, tp=2)
    assert (odd.whole, odd.split, odd.statistics) == (4_608 * 16, 4_608 * 48 / 2, 16 * 96 + 4 * 3 * 96)


def test_a_rows_predicted_activations_follow_its_shape_tensor_parallelism_and_recipe():
    from harness.derive.activations import predicted_activation_bytes

    shape = {"family": "gpt", "seq_len": 64, "n_layer": 4, "n_embd": 64, "n_head": 4}
    spec = {"workload": "gpt-tiny", "strategy": "fsdp2-tp", "micro_batch": 4, "precision": "fp32"}
    row = {"workload_description": shape, "strategy_config": {"tensor_parallel": 2}, "precision_recipe": "fp32"}
    # 4 blocks at TP 2 in fp32: whole 16 B and split 48 / 2 B a value of s b h = 16,384; statistics 16 B a token
    # and 4 B a head and token over the 2 heads a rank holds, s b = 256 tokens.
    assert predicted_activation_bytes(spec, row) == 4 * (16_384 * 16 + 16_384 * 24 + 16 * 256 + 4 * 2 * 256)
    assert predicted_activation_bytes({**spec, "strategy": "pipeline"}, row) is None
    assert predicted_activation_bytes({**spec, "precision": "bf16"}, {**row, "precision_recipe": "deepspeed-bf16"}) is None
    assert predicted_activation_bytes(spec, {**row, "workload_description": {"family": "resnet"}}) is None


MEASURE = r'''
"""Bytes a block's forward saves for backward (storages, parameters left out), whole and at TP 2."""
import json, sys
import torch, torch.distributed as dist, torch.utils.checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from harness.rank.teardown import exit_without_teardown
from harness.strategies.tensor_parallel import parallelize_blocks
from workloads import get_workload
from workloads.gpt import Block, GPTConfig


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def saved_bytes(block, x, bf16, recompute=False):
    parameters = {local(p).untyped_storage().data_ptr() for p in block.parameters()}
    storages = {}

    def pack(tensor):
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if recompute:
                torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                block(x)
    return sum(storages.values())


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
found = {}
# gpt-tiny's shape, and one whose s, b, h and a all differ (s 32, b 3, h 48, a 6).
for name, config, batch in (("tiny", get_workload("gpt-tiny").config, 4),
                            ("odd", GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_embd=48, n_head=6), 3)):
    torch.manual_seed(0)
    block = Block(config)
    x = torch.randn(batch, config.seq_len, config.n_embd, requires_grad=True)
    found.update({f"{name}-tp1-{p}": saved_bytes(block, x, p == "bf16") for p in ("fp32", "bf16")})
    found.update({f"{name}-recompute-{p}": saved_bytes(block, x, p == "bf16", True) for p in ("fp32", "bf16")})
    parallelize_blocks([block], mesh)
    found.update({f"{name}-tp2-{p}": saved_bytes(block, x, p == "bf16") for p in ("fp32", "bf16")})
if dist.get_rank() == 0:
    json.dump(found, open(sys.argv[1], "w"))
dist.destroy_process_group()
exit_without_teardown(0)  # as the harness's ranks end: Gloo's threads can abort the interpreter's tear-down
'''


@pytest.mark.launch
def test_a_real_block_saves_what_the_formula_says_whole_and_at_tp_2(tmp_path):
    script, out = tmp_path / "measure.py", tmp_path / "saved.json"
    script.write_text(MEASURE)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(out.read_text())
    shapes = {"tiny": dict(seq_len=64, micro_batch=4, hidden=64, heads=4),
              "odd": dict(seq_len=32, micro_batch=3, hidden=48, heads=6)}
    predicted = {f"{name}-tp{tp}-{p}": block_activations(**shape, tp=tp, compute_bytes=4 if p == "fp32" else 2).total
                 for name, shape in shapes.items() for tp in (1, 2) for p in ("fp32", "bf16")}
    predicted.update({f"{name}-recompute-{p}": recomputed_block_activations(**{k: v for k, v in shape.items()
                                                                               if k != "heads"})
                      for name, shape in shapes.items() for p in ("fp32", "bf16")})
    assert measured == predicted
    # Checkpointed (torch's non-reentrant checkpoint, one block), only the fp32 input stays, in bf16 too:
    # 4 x 64 x 4 x 64 = 65,536 B on gpt-tiny's shape and 4 x 32 x 3 x 48 = 18,432 B on the other.
    assert {key: value for key, value in measured.items() if "recompute" in key} == {
        "tiny-recompute-fp32": 65_536, "tiny-recompute-bf16": 65_536,
        "odd-recompute-fp32": 18_432, "odd-recompute-bf16": 18_432}
    # What checkpointing saved on gpt-tiny's block in fp32: everything but the input, of the formula's
    # s b h (2 x 4 + 2 x 4 + 12 x 4) + 16 s b + 4 a s b = 256 x 64 x 64 + 16 x 256 + 16 x 256 = 1,056,768 B.
    assert measured["tiny-tp1-fp32"] - measured["tiny-recompute-fp32"] == 1_056_768 - 65_536


def test_the_block_with_bf16_weights_by_hand():
    from harness.derive.activations import rank_activation_bytes

    # gpt-tiny's block under bf16 weights (no autocast): s b h = 16,384 values, s b = 256 tokens. Whole, 8 B a value:
    # the 2 layer norms' bf16 inputs and the 2 column-parallel inputs, 2 B each; split, 12 bf16 values (24 B);
    # statistics, on the CPU 2 norms x (mean, reciprocal deviation) in bf16 (8 B a token) and the fp32 log-sum-exp
    # (4 heads x 4 B a token); no weight copies.
    cpu = block_activations(seq_len=64, micro_batch=4, hidden=64, heads=4, compute_bytes=2, bf16_weights=True)
    assert (cpu.whole, cpu.split, cpu.statistics, cpu.weight_copies) == (
        16_384 * 8, 16_384 * 24, 8 * 256 + 4 * 4 * 256, 0)
    assert cpu.total == 131_072 + 393_216 + 2_048 + 4_096 == 530_432
    # CUDA's layer norm keeps its statistics in fp32: 16 B a token.
    cuda = block_activations(seq_len=64, micro_batch=4, hidden=64, heads=4, compute_bytes=2, bf16_weights=True,
                             fused_norm=True)
    assert cuda.total == 530_432 + 8 * 256
    # fused_norm changes nothing without bf16 weights (autocast's layer norms run in fp32 on either device).
    autocast = dict(seq_len=64, micro_batch=4, hidden=64, heads=4, compute_bytes=2)
    assert block_activations(**autocast, fused_norm=True) == block_activations(**autocast)
    # The odd shape (s 32, b 3, h 48, a 6) at TP 2: s b h = 4,608, s b = 96; 3 heads a rank.
    odd = block_activations(seq_len=32, micro_batch=3, hidden=48, heads=6, tp=2, compute_bytes=2, bf16_weights=True)
    assert (odd.whole, odd.split, odd.statistics) == (4_608 * 8, 4_608 * 24 / 2, 8 * 96 + 4 * 3 * 96)
    # Checkpointed, its bf16 input: 2 x 16,384 B; 4 such blocks of a stage.
    assert recomputed_block_activations(seq_len=64, micro_batch=4, hidden=64, bf16_weights=True) == 32_768
    tiny = dict(seq_len=64, micro_batch=4, hidden=64, heads=4, layers=4, compute_bytes=2, bf16_weights=True)
    assert rank_activation_bytes(**tiny) == 4 * 530_432
    assert rank_activation_bytes(**tiny, fused_norm=True) == 4 * (530_432 + 8 * 256)
    assert rank_activation_bytes(**tiny, checkpointed=True) == 4 * 32_768
    with pytest.raises(ValueError, match="bf16_weights"):
        block_activations(seq_len=64, micro_batch=4, hidden=64, heads=4, compute_bytes=4, bf16_weights=True)


def _saved_bytes(block, x, recompute: bool = False) -> int:
    """The storages a block's forward saves for backward, parameters left out, each once (no autocast)."""
    import torch
    import torch.utils.checkpoint

    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if recompute:
            torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        else:
            block(x)
    return sum(storages.values())


@pytest.mark.parametrize("name", ["tiny", "odd"])
def test_a_real_block_with_bf16_weights_saves_what_the_formula_says(name):
    import torch

    from workloads import get_workload
    from workloads.gpt import Block, GPTConfig

    config, batch = {"tiny": (get_workload("gpt-tiny").config, 4),
                     "odd": (GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_embd=48, n_head=6), 3)}[name]
    torch.manual_seed(0)
    block = Block(config).to(torch.bfloat16)
    x = torch.randn(batch, config.seq_len, config.n_embd, dtype=torch.bfloat16, requires_grad=True)
    shape = dict(seq_len=config.seq_len, micro_batch=batch, hidden=config.n_embd)
    predicted = block_activations(**shape, heads=config.n_head, compute_bytes=2, bf16_weights=True).total
    assert _saved_bytes(block, x) == predicted
    assert _saved_bytes(block, x, recompute=True) == recomputed_block_activations(**shape, bf16_weights=True)
    if name == "tiny":
        assert (_saved_bytes(block, x), _saved_bytes(block, x, recompute=True)) == (530_432, 32_768)
