"""Checkpoint time and goodput in the projection (harness.project.goodput, `--storage-GBps`, `--mtbf-hours`,
`--restart-s`): every expected figure worked out here by hand from the formulas (docs/clusters.md, "Checkpoint
time and goodput"), never read from the code:

    C = bytes / (G x 1e9 B/s);  M = H x 3600 s / N;  tau = sqrt(2 C M);  waste = C / tau + tau / (2 M) + R / M;
    goodput = max(0, 1 - waste), "no progress" where tau >= M.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.cli import main
from harness.derive.rows import load_rows
from harness.project.cluster import load_cluster, preset
from harness.project.collectives import ClusterModel
from harness.project.goodput import CheckpointTarget
from harness.project.projection import Scaling, projected_record
from harness.project.run import project_description, project_rows
from one_line import assert_one_line_error   # tests/one_line.py

HYBRID = Path(__file__).parent.parent / "results" / "reference" / "hybrid-cpu" / "cells.jsonl"
H100 = ClusterModel(preset("dgx-h100-ib"))
# 8 GPUs a node; 2 us and 100 GB/s inside a node, 10 us and 25 GB/s per node between nodes.
CLUSTER = ClusterModel(load_cluster(None, {"gpus_per_node": 8, "intra_node_bandwidth_GBps": 100.0,
                                           "intra_node_latency_us": 2.0, "inter_node_bandwidth_GBps": 25.0,
                                           "inter_node_latency_us": 10.0}))

# The brief's example: 1.5e9 parameters, 100 GB/s of storage, 50,000 h MTBF per GPU.
PARAMETERS, STORAGE_GBPS, MTBF_HOURS = 1.5e9, 100.0, 50_000.0
# At N = 1024: M = 50,000 h x 3600 s/h / 1024 = 180,000,000 s / 1024 = 175,781.25 s (48.83 h).
M_1024 = 175_781.25
# At N = 8: M = 180,000,000 s / 8 = 22,500,000 s (6,250 h).
M_8 = 22_500_000.0


def _described(strategies, *, world_sizes=(8, 1024), recipe="autocast", scalings=(Scaling.WEAK,), **target):
    points, _ = project_description(strategies, H100, world_sizes, scalings, parameters=int(PARAMETERS),
                                    compute_s=0.12, recipe=recipe, checkpointing=CheckpointTarget(**target))
    return points


def _at(points, strategy, world_size, scaling=Scaling.WEAK):
    [point] = [p for p in points if p.basis.strategy == strategy and p.world_size == world_size
               and p.scaling is scaling]
    return point


# ---- what a checkpoint holds ----------------------------------------------------------------------------------


def test_a_ddp_checkpoint_holds_fp32_weights_and_two_adam_moments_once_not_the_gradients():
    # torch AdamW under autocast: 4 (fp32 weights) + 8 (two fp32 moments) = 12 B a parameter; gradients are not
    # saved. 1.5e9 x 12 B = 18e9 B = 18 GB; at 100 GB/s = 100e9 B/s: C = 18e9 / 100e9 = 0.18 s.
    point = _at(_described(["ddp"], storage_GBps=STORAGE_GBPS), "ddp", 1024)
    assert point.checkpoint.bytes_per_parameter == 12
    assert point.checkpoint.bytes == pytest.approx(18e9)
    assert point.checkpoint.save_s == pytest.approx(0.18)


@pytest.mark.parametrize("strategy, recipe, per_parameter", [
    # horovod and fsdp2: torch AdamW, 4 + 8 = 12 (fsdp2's shards of each, 12 over the ranks).
    ("horovod", "autocast", 12), ("fsdp2", "autocast", 12),
    # ZeRO-1/2 save the module's fp32 weights (4) beside the fp32 master partition + two moments (12): 16.
    ("zero1", "autocast", 16), ("zero2", "autocast", 16),
    # DeepSpeed's bf16 section: the module's bf16 weights (2) + the same 12: 14.
    ("zero1", "deepspeed-bf16", 14), ("zero2", "deepspeed-bf16", 14),
    # ZeRO-3 saves its fp32 partitions and moments alone: 12 in either recipe (measured: harness/strategies/zero.py).
    ("zero3", "autocast", 12), ("zero3", "deepspeed-bf16", 12),
    # Offload moves the states, not what the files hold: ZeRO-1's host copy of its gradients is not saved.
    ("zero1[offload_optimizer=cpu]", "autocast", 16),
    # A parameter server: its 8 servers' fp32 shards (4) and moments (8), 12 once over them, though its plan, the
    # fullest rank's (a worker: 4 + 4, no optimizer state), would say 4.
    ("ps[servers=8]", "autocast", 12),
])
def test_each_strategy_saves_its_own_bytes_a_parameter(strategy, recipe, per_parameter):
    point = _at(_described([strategy], recipe=recipe, storage_GBps=STORAGE_GBPS), strategy.partition("[")[0], 8)
    # 1.5e9 parameters x per_parameter B, at 100e9 B/s: 16 -> 24e9 B, 0.24 s; 14 -> 21e9 B, 0.21 s; 12 -> 18e9, 0.18 s.
    expected_bytes = {16: 24e9, 14: 21e9, 12: 18e9}[per_parameter]
    assert point.checkpoint.bytes == pytest.approx(expected_bytes)
    assert point.checkpoint.save_s == pytest.approx(expected_bytes / 100e9)


def test_a_tensor_parallel_checkpoint_holds_the_whole_model_not_one_ranks_slice():
    # The committed fsdp2-tp rows (tp 2, gpt-tiny, fp32): each rank holds 137,728 parameters of the model's 236,928.
    # A checkpoint holds the whole model: 236,928 x 12 B = 2,843,136 B (a slice would be 137,728 x 12 = 1,652,736).
    points, _ = project_rows(load_rows([HYBRID]), H100, (8,), (Scaling.WEAK,), strategies=["fsdp2-tp[tp=2]"],
                             checkpointing=CheckpointTarget(storage_GBps=1.0))
    fp32 = [p for p in points if p.basis.precision == "fp32"]
    assert fp32 and all(p.checkpoint.bytes == 2_843_136 for p in fp32)


# ---- a measured save -----------------------------------------------------------------------------------------


def _row(checkpoint=None, parameters=10**6):
    """A ddp cell at 2 ranks (fp32, 10^6 parameters), its all-reduce counted, with `checkpoint` as the worker
    records a save."""
    steps, counted = 3, {"all_reduce": {"bytes": 4e6, "calls": 1, "bytes_by_group_size": {"2": 4e6}}}
    measurements = {"step_time_s": [0.23] * steps, "host_stalled_step_indices": [], "compute_only_kind": "same work",
                    "compute_only_step_time_s_by_rank": [[0.2] * steps] * 2,
                    "compute_only_host_stalled_by_rank": [[False] * steps] * 2,
                    "comm_per_step_by_rank": [counted] * 2, "data_parallel": 2, "micro_batches_per_step": 1,
                    "parameters": parameters, "parameters_held_by_rank": [10**6] * 2, "precision_recipe": "fp32",
                    "tokens_per_sample": 1}
    if checkpoint is not None:
        measurements["checkpoint"] = checkpoint
    return {"schema_version": 2, "run_id": "run-ddp-2", "cell_id": "c", "repeat": 0, "status": "ok", "message": "",
            "spec": {"workload": "gpt-tiny", "strategy": "ddp", "world_size": 2, "global_batch": 16, "micro_batch": 8,
                     "precision": "fp32", "warmup_steps": 1, "timed_steps": steps, "seed": 0, "device": "cpu",
                     "nnodes": 1, "options": {}},
            "measurements": measurements}


def _saved(bytes_by_rank, method="dcp", **more):
    """A resumed launch's `checkpoint` record as harness.rank.checkpointed_run writes it."""
    return {"role": "resume", "step": 3, "method": method, "holds": ["weights", "optimizer"], "model_tensors": 53,
            "tied_parameters": 0, "saved_at_world_size": 2, "save_s_by_rank": [0.5, 0.6],
            "bytes_by_rank": bytes_by_rank, "files_by_rank": [1, 1], "load_s_by_rank": [0.4, 0.4],
            "resumed_from_step": 3, **more}


def _from_rows(rows, **target):
    points, _ = project_rows(rows, CLUSTER, (8,), (Scaling.WEAK,), checkpointing=CheckpointTarget(**target))
    [point] = points
    return point


def test_a_measured_save_gives_the_bytes_and_the_notes_say_so():
    # 6,750,000 + 6,750,000 = 13,500,000 B over 10^6 parameters = 13.5 B a parameter (the plan would say 12);
    # the same model at the target: 13.5 x 10^6 = 13,500,000 B; at 0.5 GB/s = 5e8 B/s: C = 1.35e7 / 5e8 = 0.027 s.
    point = _from_rows([_row(_saved([6_750_000, 6_750_000]))], storage_GBps=0.5)
    assert point.checkpoint.bytes_per_parameter == pytest.approx(13.5)
    assert point.checkpoint.bytes == pytest.approx(13_500_000)
    assert point.checkpoint.save_s == pytest.approx(0.027)
    assert any("measured save" in note and "dcp save at step 3 on 2 ranks" in note for note in point.notes)


def test_a_save_by_rank_0_alone_counts_every_rank_s_bytes():
    # Horovod saves from rank 0: 12,000,000 + 0 = 12,000,000 B / 10^6 = 12 B a parameter; at 0.5 GB/s: 0.024 s.
    point = _from_rows([_row(_saved([12_000_000, 0], method="horovod rank 0"))], storage_GBps=0.5)
    assert point.checkpoint.bytes == pytest.approx(12_000_000)
    assert point.checkpoint.save_s == pytest.approx(0.024)


@pytest.mark.parametrize("checkpoint, parameters", [
    (None, 10**6),                                  # rows from before the measurement: no "checkpoint"
    ({"method": "dcp", "bytes_by_rank": []}, 10**6),  # a save that recorded no bytes
    (_saved([6_750_000, 6_750_000]), None),         # no parameter count to divide by
    # A planted fault that leaves the optimizer out: 2,000,000 + 2,000,000 B, 4 B a parameter, not ddp's save.
    (_saved([2_000_000, 2_000_000], planted="checkpoint-without-optimizer"), 10**6),
])
def test_without_a_usable_measured_save_the_bytes_come_from_the_plan(checkpoint, parameters):
    # ddp in fp32: 4 + 8 = 12 B a parameter; 10^6 parameters (parameters_held_by_rank) -> 12,000,000 B.
    row = _row(checkpoint, parameters=parameters)
    if parameters is None:
        del row["measurements"]["parameters"]
    point = _from_rows([row], storage_GBps=0.5)
    assert point.checkpoint.bytes == pytest.approx(12_000_000)
    assert not any("measured save" in note for note in point.notes)


# ---- the failure model ---------------------------------------------------------------------------------------


def test_the_interval_is_young_daly_on_the_job_mtbf_and_the_waste_its_first_order_terms():
    point = _at(_described(["ddp"], storage_GBps=STORAGE_GBPS, mtbf_hours_per_gpu=MTBF_HOURS), "ddp", 1024)
    cost = point.checkpoint
    # C = 0.18 s (above). M = 175,781.25 s. tau = sqrt(2 x 0.18 x 175,781.25) = sqrt(63,281.25) = 251.5576 s.
    tau = math.sqrt(63_281.25)
    # waste = 0.18 / 251.5576 + 251.5576 / (2 x 175,781.25) = 0.00071555 + 0.00071555 = 0.0014311 (at Young's
    # optimum the two terms are equal, sqrt(C / 2M) each); goodput = 1 - 0.0014311 = 0.9985689.
    waste = 0.18 / tau + tau / 351_562.5
    assert cost.job_mtbf_s == pytest.approx(M_1024)
    assert cost.interval_s == pytest.approx(tau)
    assert tau == pytest.approx(251.5576, rel=1e-6)
    assert cost.waste_fraction == pytest.approx(waste)
    assert cost.goodput == pytest.approx(0.9985689, rel=1e-6)


def test_the_job_mtbf_is_one_gpus_over_the_gpus():
    points = _described(["ddp"], storage_GBps=STORAGE_GBPS, mtbf_hours_per_gpu=MTBF_HOURS)
    # N = 8: M = 22,500,000 s; tau = sqrt(2 x 0.18 x 22,500,000) = sqrt(8,100,000) = 2,846.05 s.
    eight = _at(points, "ddp", 8).checkpoint
    assert eight.job_mtbf_s == pytest.approx(M_8)
    assert eight.interval_s == pytest.approx(math.sqrt(8_100_000))
    # N = 1024 fails 128 times as often: M = 175,781.25 s.
    assert _at(points, "ddp", 1024).checkpoint.job_mtbf_s == pytest.approx(M_1024)


def test_a_restart_adds_its_seconds_once_per_failure():
    point = _at(_described(["ddp"], storage_GBps=STORAGE_GBPS, mtbf_hours_per_gpu=MTBF_HOURS, restart_s=600.0),
                "ddp", 1024)
    # waste = 0.0014311 (above) + R / M = 600 / 175,781.25 = 0.0034133 -> 0.0048444; goodput = 0.9951556.
    tau = math.sqrt(63_281.25)
    assert point.checkpoint.waste_fraction == pytest.approx(0.18 / tau + tau / 351_562.5 + 600 / 175_781.25)
    assert point.checkpoint.goodput == pytest.approx(0.9951556, rel=1e-6)
    # The interval does not change: Young's tau has no restart term.
    assert point.checkpoint.interval_s == pytest.approx(tau)


def test_where_the_interval_reaches_the_job_mtbf_there_is_no_progress_and_no_goodput():
    # At 0.0001 GB/s = 1e5 B/s: C = 18e9 / 1e5 = 180,000 s.
    points = _described(["ddp"], storage_GBps=1e-4, mtbf_hours_per_gpu=MTBF_HOURS)
    # N = 1024: tau = sqrt(2 x 180,000 x 175,781.25) = sqrt(6.328125e10) = 251,557.6 s >= M = 175,781.25 s.
    far = _at(points, "ddp", 1024).checkpoint
    assert far.interval_s == pytest.approx(math.sqrt(6.328125e10)) and far.interval_s >= M_1024
    assert far.no_progress and far.goodput is None and far.waste_fraction is None
    # N = 8: tau = sqrt(2 x 180,000 x 22,500,000) = sqrt(8.1e12) = 2,846,049 s < M = 22,500,000 s; waste =
    # 180,000 / 2,846,049 + 2,846,049 / 45,000,000 = 0.0632456 + 0.0632456 = 0.1264911; goodput = 0.8735089.
    near = _at(points, "ddp", 8).checkpoint
    assert not near.no_progress and near.goodput == pytest.approx(0.8735089, rel=1e-6)


def test_the_table_says_no_progress_rather_than_a_number(capsys):
    assert main(["project", "--params", "1.5B", "--compute-ms", "120", "--cluster", "dgx-h100-ib", "--strategies",
                 "ddp", "--scaling", "weak", "--world-sizes", "8,1024", "--storage-GBps", "0.0001", "--mtbf-hours",
                 "50000"]) == 0
    [line_1024] = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("1024 ")]
    assert "no progress" in line_1024 and "%" not in line_1024.split("no progress")[1]


def test_goodput_is_floored_at_zero_where_the_restarts_alone_take_longer_than_the_mtbf():
    # N = 1024, R = 200,000 s: R / M = 200,000 / 175,781.25 = 1.1378 > 1, with tau = 251.6 s < M: goodput 0, not
    # negative, and not "no progress" (the first-order model holds; the job does no useful work).
    point = _at(_described(["ddp"], storage_GBps=STORAGE_GBPS, mtbf_hours_per_gpu=MTBF_HOURS, restart_s=200_000.0),
                "ddp", 1024)
    assert point.checkpoint.goodput == 0.0 and not point.checkpoint.no_progress


def test_weak_and_strong_scaling_at_one_size_checkpoint_the_same_model():
    points = _described(["zero2"], scalings=(Scaling.WEAK, Scaling.STRONG), storage_GBps=STORAGE_GBPS,
                        mtbf_hours_per_gpu=MTBF_HOURS)
    weak, strong = _at(points, "zero2", 1024, Scaling.WEAK), _at(points, "zero2", 1024, Scaling.STRONG)
    # 1.5e9 x 16 B = 24e9 B either way: C = 0.24 s; tau = sqrt(2 x 0.24 x 175,781.25) = sqrt(84,375) = 290.47 s.
    assert weak.checkpoint == strong.checkpoint
    assert weak.checkpoint.interval_s == pytest.approx(math.sqrt(84_375))


# ---- the command line and the projected rows ------------------------------------------------------------------


def test_projected_rows_carry_the_checkpoint_figures(tmp_path, capsys):
    out = tmp_path / "projected.jsonl"
    assert main(["project", "--params", "1.5B", "--compute-ms", "120", "--cluster", "dgx-h100-ib", "--strategies",
                 "ddp", "--scaling", "weak", "--world-sizes", "1024", "--storage-GBps", "100", "--mtbf-hours", "50000",
                 "--out", str(out)]) == 0
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    # 18e9 B, 0.18 s, M = 175,781.25 s, tau = sqrt(63,281.25) s, goodput 0.9985689 (above).
    assert row["checkpoint_bytes"] == pytest.approx(18e9) and row["checkpoint_save_s"] == pytest.approx(0.18)
    assert row["storage_write_GBps"] == 100 and row["mtbf_hours_per_gpu"] == 50_000
    assert row["job_mtbf_s"] == pytest.approx(M_1024)
    assert row["checkpoint_interval_s"] == pytest.approx(math.sqrt(63_281.25))
    assert row["goodput_fraction"] == pytest.approx(0.9985689, rel=1e-6) and row["goodput_no_progress"] is False
    assert "Young 1974" in row["inputs"]["assumptions"]["checkpoint"]
    printed = capsys.readouterr().out
    assert "checkpoint: 18 GB a save" in printed and "99.86%" in printed


def test_without_the_flags_the_output_and_rows_are_as_before(tmp_path, capsys):
    arguments = ["project", "--params", "1.5B", "--compute-ms", "120", "--cluster", "dgx-h100-ib", "--strategies",
                 "ddp", "--scaling", "weak", "--world-sizes", "8"]
    assert main([*arguments, "--out", str(tmp_path / "rows.jsonl")]) == 0
    printed = capsys.readouterr().out
    assert "checkpoint" not in printed and "goodput" not in printed
    [row] = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    added = {"checkpoint_bytes", "checkpoint_bytes_per_parameter", "checkpoint_bytes_source", "storage_write_GBps",
             "checkpoint_save_s", "mtbf_hours_per_gpu", "job_mtbf_s", "restart_s", "checkpoint_interval_s",
             "checkpoint_waste_fraction", "goodput_fraction", "goodput_no_progress"}
    assert not added & set(row)
    assert "checkpoint" not in row["inputs"]["assumptions"]
    points, _ = project_description(["ddp"], H100, (8,), (Scaling.WEAK,), parameters=10**9, compute_s=0.1)
    assert points[0].checkpoint is None and "checkpoint_bytes" not in projected_record(points[0], H100)


# ---- bad input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target, words", [
    (dict(storage_GBps=0.0), ["--storage-GBps", "positive"]),
    (dict(storage_GBps=-5.0), ["--storage-GBps", "positive"]),
    (dict(storage_GBps=math.nan), ["--storage-GBps", "finite"]),
    (dict(storage_GBps=math.inf), ["--storage-GBps", "finite"]),
    (dict(storage_GBps=True), ["--storage-GBps"]),
    (dict(storage_GBps=100.0, mtbf_hours_per_gpu=0.0), ["--mtbf-hours", "positive"]),
    (dict(storage_GBps=100.0, mtbf_hours_per_gpu=math.inf), ["--mtbf-hours", "finite"]),
    (dict(storage_GBps=100.0, mtbf_hours_per_gpu=-1.0), ["--mtbf-hours"]),
    (dict(storage_GBps=100.0, mtbf_hours_per_gpu=10.0, restart_s=-1.0), ["--restart-s", ">= 0"]),
    (dict(storage_GBps=100.0, mtbf_hours_per_gpu=10.0, restart_s=math.nan), ["--restart-s", "finite"]),
    (dict(storage_GBps=100.0, restart_s=60.0), ["--restart-s", "--mtbf-hours"]),
])
def test_a_bad_target_is_one_line(target, words):
    assert_one_line_error(lambda: CheckpointTarget(**target), words)


@pytest.mark.parametrize("flags, message", [
    (["--storage-GBps", "0"], "--storage-GBps must be a positive, finite"),
    (["--storage-GBps", "nan"], "--storage-GBps must be a positive, finite"),
    (["--mtbf-hours", "50000"], "--mtbf-hours needs --storage-GBps"),
    (["--restart-s", "60"], "--restart-s needs --storage-GBps"),
    (["--storage-GBps", "100", "--mtbf-hours", "-1"], "--mtbf-hours must be a positive, finite"),
])
def test_bad_flags_are_one_line_and_nothing_is_written(flags, message, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert main(["project", "--params", "1.5B", "--compute-ms", "120", "--cluster", "dgx-h100-ib", *flags,
                 "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error, error
    assert not out.exists()


def test_validate_refuses_the_checkpoint_flags(capsys):
    reference = Path(__file__).parent.parent / "results" / "reference" / "ci-cpu"
    assert main(["project", "--validate", str(reference / "full.jsonl"), "--comm", str(reference / "comm-ws2.jsonl"),
                 "--storage-GBps", "100"]) == 2
    assert "--storage-GBps" in capsys.readouterr().err

