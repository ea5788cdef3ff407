"""Every strategy at world size 2 on CPU (gloo), launched by its own launcher, against the plain loop, on
both tiny workloads.

Tolerance (harness/parity.py): fp32 losses of the first PARITY_STEPS steps within 1e-4 relative of the
plain single-process reference at the same global batch. Step 0 is the loss of the initial weights on
the same data, so it differs only by the order of the loss sum; later steps add one AdamW update each,
computed from gradients whose all-reduce / reduce-scatter / pipeline order differs from the reference by
rounding (measured at 2 ranks: at most 1.3e-5 absolute on ResNet-20, one float32 ulp on gpt-tiny). A real
error (gradients summed instead of averaged, an accumulation step lost, a replica fed the wrong samples, a
stage built from different weights) moves the loss after the first update by more than 1e-3. Subtler
errors need ResNet-20: its BatchNorm amplifies a small change of the initial weights, where gpt-tiny
hardly shows one (Horovod's 1e-5 weight decay before the first step, tests/test_horovod_wrap.py, moved
gpt-tiny's first losses by 2e-6 and ResNet-20's by 3.6e-4).

Each cell runs exactly the PARITY_STEPS steps compared (one warm-up, three timed): this is about training
the same way, not about speed, and launches dominate the test's time.
"""

import math

import pytest

from harness.matrix import Machine, Selection, build_matrix
from harness.parity import PARITY_STEPS, RELATIVE_TOLERANCE, Verdict
from harness.record import read_results
from harness.runner import RunOptions, run_specs
from harness.spec import DeviceKind, Precision, Status

CPU = Machine(device=DeviceKind.CPU, gpus=0, cores=2)
MULTI_PROCESS = ("horovod", "zero1", "zero2", "zero3", "fsdp2", "pipeline")
WORKLOADS = ("resnet20-cifar", "gpt-tiny")
PARITY_ONLY = (("warmup_steps", 1), ("timed_steps", PARITY_STEPS - 1))


@pytest.fixture(scope="module")
def all_rows(tmp_path_factory):
    """{(workload, strategy): row}"""
    out = tmp_path_factory.mktemp("strategies") / "rows.jsonl"
    specs = build_matrix("full", CPU, Selection(workloads=WORKLOADS, world_sizes=(2,), overrides=PARITY_ONLY,
                                                strategies=("plain", "dataparallel", *MULTI_PROCESS)))
    run_specs(specs, RunOptions(results=out, timeout_s=300))
    return {(row.spec.workload, row.spec.strategy): row for row in read_results([out])}


@pytest.fixture(scope="module")
def rows(all_rows):
    """{strategy: row} on gpt-tiny"""
    return {strategy: row for (workload, strategy), row in all_rows.items() if workload == "gpt-tiny"}


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("strategy", MULTI_PROCESS)
def test_strategy_at_two_ranks_trains_like_the_plain_loop(all_rows, strategy, workload):
    row, reference = all_rows[workload, strategy], all_rows[workload, "plain"]
    assert row.status is Status.OK, row.message
    assert row.spec.world_size == 2 and row.spec.global_batch == reference.spec.global_batch
    losses, expected = row.measurements["loss_per_step"], reference.measurements["loss_per_step"]
    assert all(math.isfinite(x) for x in losses)
    tolerance = RELATIVE_TOLERANCE[Precision.FP32]
    for step in range(PARITY_STEPS):
        assert abs(losses[step] - expected[step]) <= tolerance * expected[step], (workload, strategy, step, losses,
                                                                                  expected)
    assert row.measurements["parity_verdict"] == Verdict.MATCH
    assert row.measurements["precision_recipe"] == "fp32"


def test_each_strategy_was_started_by_its_own_launcher(rows):
    launchers = {name: " ".join(row.launch_command) for name, row in rows.items() if row.status is Status.OK}
    assert "horovodrun" in launchers["horovod"] and "--gloo" in launchers["horovod"]
    for name in ("zero1", "zero2", "zero3", "fsdp2", "pipeline"):
        assert "torchrun" in launchers[name] and "--nproc-per-node=2" in launchers[name]


def test_dataparallel_without_two_gpus_is_skipped_with_the_reason(rows):
    row = rows["dataparallel"]
    assert row.status is Status.SKIPPED and "CUDA devices only" in row.message
    assert not row.measurements


def test_strategies_record_their_configuration(rows):
    assert rows["zero3"].measurements["strategy_config"]["deepspeed_config"]["zero_optimization"]["stage"] == 3
    assert rows["zero1"].measurements["strategy_config"]["deepspeed_config"]["zero_optimization"]["overlap_comm"] \
        is False
    assert rows["horovod"].measurements["strategy_config"]["horovod_build"]["gloo_built"] is True
    assert rows["horovod"].measurements["strategy_config"]["broadcast_from_rank_0"] == "parameters and buffers"
    assert rows["pipeline"].measurements["pipeline_stages"] == 2
    assert rows["fsdp2"].measurements["strategy_config"]["sharded_units"] == 5   # 4 blocks + root
