"""The collective counter sees what a strategy issues, once per call, and passes results through."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.rank.comm_counter import CollectiveCounter

ROOT = Path(__file__).resolve().parent.parent


def test_counts_bytes_and_calls_per_step_in_a_real_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    original = dist.all_reduce
    counter = CollectiveCounter()
    counter.install_torch()
    assert dist.all_reduce is not original
    try:
        tensor = torch.ones(1000)
        dist.all_reduce(tensor)                                 # outside a counted step: ignored
        for _ in range(2):
            with counter.counting(record=True):
                dist.all_reduce(tensor)
                dist.all_reduce(torch.ones(10, dtype=torch.float64))
                gathered = torch.empty(256)
                dist.all_gather_into_tensor(gathered, torch.full((256,), 3.0))   # forwards internally: one call
        with counter.counting(record=False):
            dist.broadcast(tensor, src=0)
        assert torch.equal(gathered, torch.full((256,), 3.0))
        # Per step: 1000 fp32 (4000 B) + 10 fp64 (80 B) all-reduced, 256 fp32 gathered, in a 1-rank group.
        assert counter.per_step() == {
            "all_reduce": {"bytes": 4080.0, "calls": 2.0,
                           "dtypes": {"float32": {"bytes": 4000.0, "element_bytes": 4},
                                      "float64": {"bytes": 80.0, "element_bytes": 8}},
                           "bytes_by_group_size": {"1": 4080.0},
                           "by_group": {"world": {"calls": 2.0, "bytes": 4080.0}}, "group_ranks": {"world": 1}},
            "all_gather": {"bytes": 1024.0, "calls": 1.0,
                           "dtypes": {"float32": {"bytes": 1024.0, "element_bytes": 4}},
                           "bytes_by_group_size": {"1": 1024.0},
                           "by_group": {"world": {"calls": 1.0, "bytes": 1024.0}}, "group_ranks": {"world": 1}}}
    finally:
        counter.uninstall()
        dist.destroy_process_group()
    assert dist.all_reduce is original


TP_STEP = r'''
"""One Megatron-style tensor-parallel block on 2 ranks (DTensor), trained one step under the counter."""
import json, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from harness.rank.comm_counter import CollectiveCounter, label_group
from harness.rank.teardown import exit_without_teardown

B, S, D, HEADS = 2, 8, 16, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.attn_proj = (nn.Linear(D, D) for _ in range(4))
        self.c_fc, self.mlp_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        h = self.ln_1(x)
        q, k, v = (layer(h).view(B, S, -1, D // HEADS).transpose(1, 2) for layer in (self.q, self.k, self.v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(attended.transpose(1, 2).reshape(B, S, -1))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x))))


dist.init_process_group("gloo")
counter = CollectiveCounter()
counter.install_torch()
counter.install_functional()
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
label_group(mesh.get_group("tp"), "tp")
torch.manual_seed(0)
block = parallelize_module(Block(), mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                           "attn_proj": RowwiseParallel(), "c_fc": ColwiseParallel(),
                                           "mlp_proj": RowwiseParallel()})
optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
x = torch.randn(B, S, D)
for step in range(3):
    with counter.counting(record=step > 0, sample_functional=step == 1):
        block(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
if dist.get_rank() == 0:
    json.dump(counter.per_step(), open(sys.argv[1], "w"))
dist.destroy_process_group()
exit_without_teardown(0)  # as the harness's ranks end: Gloo's threads can abort the interpreter's tear-down
'''


@pytest.mark.launch
def test_a_dtensor_tensor_parallel_step_is_counted_as_worked_out_by_hand(tmp_path):
    """Megatron's layout on one block, q, k and v column-parallel apart: forward all-reduces the two
    row-parallel outputs (attn_proj, mlp_proj); backward all-reduces the input gradient of each column-parallel
    layer (q, k, v, c_fc: their common input is replicated, each rank's gradient of it partial). 6 all-reduces
    of one activation, b x s x h fp32 = 2 x 8 x 16 x 4 = 1024 bytes, in the tp group of 2; nothing else (no
    sequence parallelism, so no norm weight has a partial gradient for the optimizer to reduce)."""
    script = tmp_path / "tp_step.py"
    script.write_text(TP_STEP)
    out = tmp_path / "counts.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    activation = 2 * 8 * 16 * 4
    assert json.loads(out.read_text()) == {
        "all_reduce": {"bytes": 6 * activation, "calls": 6,
                       "dtypes": {"float32": {"bytes": 6 * activation, "element_bytes": 4}},
                       "bytes_by_group_size": {"2": 6 * activation},
                       "by_group": {"tp": {"calls": 6, "bytes": 6 * activation}}, "group_ranks": {"tp": 2}}}
