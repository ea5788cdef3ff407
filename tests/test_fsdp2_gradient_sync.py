"""FSDP2 under gradient accumulation (harness.strategies.fsdp2, `gradient_sync`): gradient sync off until the last
micro-batch keeps every parameter's unsharded fp32 gradient meanwhile, which `harness plan` and `harness memory`
count (`Strategy.working_memory_bytes`); `gradient_sync=every` reduce-scatters each micro-batch and keeps only the
shards. The bytes measured on 2 CPU ranks; the collectives and the parity of a real cell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.derive.memory import RankParameters
from harness.spec import RunSpec
from harness.strategies import get_strategy
from harness.strategies.base import PrecisionRecipe
from workloads import get_workload

ROOT = Path(__file__).resolve().parent.parent


def _expected(options: dict) -> dict:
    # gpt-tiny at 2 ranks, 16 samples in micro-batches of 4: 2 micro-batches a replica.
    spec = RunSpec(workload="gpt-tiny", strategy="fsdp2", world_size=2, global_batch=16, micro_batch=4, options=options)
    torch.manual_seed(0)
    traffic = get_strategy("fsdp2").expected_traffic(spec, get_workload("gpt-tiny").build_layers())
    return {c.collective.value: c.calls for c in traffic.collectives}


def test_every_micro_batch_reduce_scatters_k_times_the_last_once():
    assert _expected({}) == {"all_gather": 2 * 2, "reduce_scatter": 1}
    assert _expected({"gradient_sync": "every"}) == {"all_gather": 2 * 2, "reduce_scatter": 2}


def test_the_planned_working_memory_keeps_unsharded_gradients_only_with_sync_off():
    fsdp2 = get_strategy("fsdp2")
    rank = RankParameters(held=1_000, unit=100, outside_blocks=200, largest_module=200, data_parallel=4,
                          micro_batches=3)
    last = fsdp2.working_memory_bytes(rank, PrecisionRecipe.FSDP_MP_POLICY, fsdp2.resolve_options({}))
    # Gathered: the root unit and two blocks in bf16, (200 + 2 x 100) x 2; every gradient unsharded in fp32, 4 x 1000.
    assert last == {"gathered": 800, "accumulated gradients": 4_000}
    every = fsdp2.working_memory_bytes(rank, PrecisionRecipe.FSDP_MP_POLICY,
                                       fsdp2.resolve_options({"gradient_sync": "every"}))
    # One unit's gradient awaiting its reduce-scatter: the largest module's, in bf16 and again in fp32.
    assert every == {"gathered": 800, "gradients awaiting reduce-scatter": 200 * (2 + 4)}
    single = RankParameters(held=1_000, unit=100, outside_blocks=200, largest_module=200, data_parallel=4,
                            micro_batches=1)
    one = fsdp2.working_memory_bytes(single, PrecisionRecipe.FSDP_MP_POLICY, fsdp2.resolve_options({}))
    assert "accumulated gradients" not in one          # one micro-batch: nothing is accumulated


# A 2-rank script: four Linear layers of 500 x 500 + 500 (250,500 each, 1,002,000 in all), each fully_shard'ed over
# 2 ranks, two micro-batches forward and backward with gradient sync off, then on; after each the bytes of the gradients FSDP2
# keeps, read from its own parameters (torch 2.13's FSDPParam: the unsharded parameter's gradient and the accumulated
# one it upcasts into, and the sharded parameter's gradient).
SCRIPT = r"""
import json
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(500, 500) for _ in range(4)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
found = {}
for sync in ("off", "on"):
    for param in model.parameters():
        param.grad = None
    model.set_requires_gradient_sync(sync == "on")
    for _ in range(2):
        model(torch.randn(8, 500)).sum().backward()
    unsharded = sharded = 0
    for layer in model:
        for param in layer._get_fsdp_state()._fsdp_param_group.fsdp_params:
            for grad in (param.unsharded_accumulated_grad, param._unsharded_param.grad):
                if grad is not None:
                    unsharded += grad.numel() * grad.element_size()
            if param.sharded_param.grad is not None:
                sharded += param.sharded_param.grad.to_local().numel() * param.sharded_param.grad.element_size()
    found[sync] = {"unsharded": unsharded, "sharded": sharded}
    if sync == "off":       # the last micro-batch of an accumulation syncs: reduce what was kept before the next
        model.set_requires_gradient_sync(True)
        model(torch.randn(8, 500)).sum().backward()
if dist.get_rank() == 0:
    print(json.dumps(found))
dist.destroy_process_group()
"""


@pytest.mark.launch
def test_sync_off_keeps_every_unsharded_gradient_measured_on_two_ranks(tmp_path):
    script = tmp_path / "accumulate.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # What `working_memory_bytes` counts with sync off: 4 bytes a parameter the rank holds, whole (4,008,000 B);
    # with sync on, this rank's shard of each (2,004,000 B).
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "off": {"unsharded": 4 * 1_002_000, "sharded": 0}, "on": {"unsharded": 0, "sharded": 4 * 1_002_000 // 2}}


@pytest.fixture(scope="module")
def sync_every_rows(tmp_path_factory):
    """The full matrix's gpt-tiny FSDP2 cell at 2 ranks (2 micro-batches a replica) reduce-scattering every
    micro-batch, and the plain loop: {strategy: row}."""
    from launch_streams import Stream, run_streams

    stream = Stream("fsdp2-sync-every", ("--workload", "gpt-tiny", "--world-sizes", "2", "--strategy", "plain,fsdp2",
                                         "--option", "gradient_sync=every"))
    rows = run_streams(tmp_path_factory.mktemp("fsdp2-sync-every"), [stream])[stream.name]
    return {row.spec.strategy: row for row in rows}


@pytest.mark.launch
@pytest.mark.matrix
def test_reduce_scattering_every_micro_batch_trains_the_plain_loops_model_and_counts_k_calls(sync_every_rows):
    from harness.derive.parity import Verdict, judge
    from harness.spec import Status

    plain, fsdp2 = sync_every_rows["plain"], sync_every_rows["fsdp2"]
    for row in (plain, fsdp2):
        assert row.status is Status.OK, row.message
    assert fsdp2.spec.options_dict["gradient_sync"] == "every"
    assert judge([plain.to_dict(), fsdp2.to_dict()])[1].verdict is Verdict.MATCH
    # gpt-tiny's 236,928 fp32 parameters in 5 units (4 blocks, and the root holding the embeddings, final norm and
    # the tied head): every unit reduce-scattered after each of the 2 micro-batches, 10 calls of 4 x 236,928 =
    # 947,712 bytes a micro-batch; gathered twice a micro-batch, 20 calls.
    m = fsdp2.measurements
    for counted in m["comm_per_step_by_rank"]:
        assert counted["reduce_scatter"]["calls"] == 2 * 5
        assert counted["reduce_scatter"]["bytes"] == 2 * 4 * 236_928
        assert counted["all_gather"]["calls"] == 2 * 2 * 5
