"""harness.project.projection: hand-written rows projected onto a hand-written cluster, every expected figure
worked out in the test from the alpha-beta formulas (docs/projection.md), not copied from the code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.derive.rows import load_rows
from harness.project.cluster import load_cluster
from harness.project.collectives import Algorithm, ClusterModel
from harness.project.fit import Calibration, LinkFit, Residual
from harness.project.projection import (BACKWARD_SHARE, Scaling, bases_from_rows, description_basis,
                                        format_table, project, projected_record)
from harness.project.facts import REGISTRY_FACTS
from harness.project.run import project_rows
from harness.record import PROJECTION_KIND, append_line, read_rows
from harness.runner import summary_table
from harness.spec import SpecError

REFERENCE = Path(__file__).parent.parent / "results" / "reference" / "ci-cpu"

# 8 GPUs a node; 2 us and 100 GB/s inside a node, 10 us and 25 GB/s per node between nodes.
CLUSTER = {"gpus_per_node": 8, "intra_node_bandwidth_GBps": 100.0, "intra_node_latency_us": 2.0,
           "inter_node_bandwidth_GBps": 25.0, "inter_node_latency_us": 10.0}
MODEL = ClusterModel(load_cluster(None, CLUSTER))


def _row(strategy, world_size, counted, *, compute=0.2, exposed=0.03, global_batch=16, micro_batch=8,
         micro_batches=1, parameters=10**6, recipe="fp32"):
    steps = 3
    return {"schema_version": 2, "run_id": f"run-{strategy}-{world_size}", "cell_id": "c", "repeat": 0,
            "status": "ok", "message": "",
            "spec": {"workload": "gpt-tiny", "strategy": strategy, "world_size": world_size,
                     "global_batch": global_batch, "micro_batch": micro_batch, "precision": "fp32",
                     "warmup_steps": 1, "timed_steps": steps, "seed": 0, "device": "cpu", "nnodes": 1, "options": {}},
            "measurements": {"step_time_s": [compute + exposed] * steps, "host_stalled_step_indices": [],
                             "compute_only_kind": "same work",
                             "compute_only_step_time_s_by_rank": [[compute] * steps] * world_size,
                             "compute_only_host_stalled_by_rank": [[False] * steps] * world_size,
                             "comm_per_step_by_rank": [counted] * world_size, "data_parallel": world_size,
                             "micro_batches_per_step": micro_batches, "parameters": parameters,
                             "parameters_held_by_rank": [parameters] * world_size, "precision_recipe": recipe,
                             "tokens_per_sample": 1}}


def _counted(collective, size, calls, group):
    return {collective: {"bytes": size * calls, "calls": calls, "bytes_by_group_size": {str(group): size * calls}}}


def _only(points, scaling, world_size):
    [point] = [p for p in points if p.scaling is scaling and p.world_size == world_size]
    return point


def _host(latency_s=100e-6, seconds_per_byte=1e-9, ratios=()):
    """A calibration whose all-reduce link is alpha = 100 us, 1 GB/s, its rows at `ratios` of the fit."""
    residuals = tuple(Residual(2, 1e6, ratio, 1.0) for ratio in ratios)
    return Calibration(fits={"all_reduce": LinkFit(collective="all_reduce", algorithm=Algorithm.RING,
                                                   latency_s=latency_s, seconds_per_byte=seconds_per_byte, fixed_s=0.0,
                                                   world_sizes=(2,), residuals=residuals)},
                       backend="gloo", device="cpu")


@pytest.mark.parametrize("strategy, options, counted, gradient_bytes, backward_s, on_the_wire", [
    # 1 ms cycles over a 10.6 ms backward: gradients arrive in 11 cycles, each fused into one all-reduce.
    ("horovod", {}, 52, 947_712, 0.0106, 11),
    # A 1 ms backward is one cycle, but 100 MB need ceil(100e6 / 32 MiB) = ceil(2.98) = 3 buffers.
    ("horovod", {"fusion_threshold_mb": 32}, 52, 100e6, 0.001, 3),
    # A backward of 200 cycles cannot fuse 52 tensors below 52 calls.
    ("horovod", {}, 52, 947_712, 0.2, 52),
    # Fusion turned off: every tensor its own all-reduce.
    ("horovod", {"cycle_time_ms": 0}, 52, 947_712, 0.0106, 52),
    ("horovod", {"fusion_threshold_mb": 0}, 52, 947_712, 0.0106, 52),
    # DDP's counted calls are its buckets, already what the wire carries.
    ("ddp", {}, 3, 947_712, 0.0106, 3),
])
def test_horovods_per_tensor_all_reduces_are_fused_on_the_wire_by_hand(strategy, options, counted, gradient_bytes,
                                                                        backward_s, on_the_wire):
    assert REGISTRY_FACTS.wire_calls(strategy, options, "all_reduce", counted, gradient_bytes,
                                     backward_s) == on_the_wire


def test_a_horovod_row_is_priced_as_its_fused_all_reduces():
    # Measured at 2 ranks: 52 per-tensor all-reduces of 100 MB in all, compute-only 15.9 ms, one micro-batch:
    # gradients arrive over 2/3 x 15.9 = 10.6 ms of backward, 11 one-ms cycles, 11 all-reduces of 100/11 MB.
    rows = [_row("horovod", 2, _counted("all_reduce", 100e6 / 52, 52, 2), compute=0.0159)]
    points, _ = project_rows(rows, MODEL, [16], [Scaling.WEAK])
    point = _only(points, Scaling.WEAK, 16)
    # Each all-reduce among 16 (2 nodes of 8, ring): 28 intra steps of 2 us and 2 inter of 10 us = 76 us of
    # latency; the bytes, 2 x 15/16 x 100 MB through 25 GB/s, are the same however they are split.
    assert point.comm_s == pytest.approx(11 * 76e-6 + 2 * 15 / 16 * 100e6 / 25e9)
    assert [item.calls for item in point.schedule] == [11]
    assert any("52 counted all_reduce calls per step priced as 11 on the wire" in note for note in point.basis.notes)


def test_a_ddp_all_reduce_at_16_gpus_by_hand():
    # Measured at 2 ranks: one all-reduce of S = 100 MB per step, compute-only 200 ms, 8 samples a device.
    rows = [_row("ddp", 2, _counted("all_reduce", 100e6, 1, 2))]
    points, _ = project_rows(rows, MODEL, [16], [Scaling.WEAK])
    point = _only(points, Scaling.WEAK, 16)
    # 16 ranks = 2 nodes of 8, ring: 2(p-m) = 28 intra steps, 2(m-1) = 2 inter steps, and
    # 2(p-1)/p S through the slower link (25 GB/s): 56 us + 20 us + 2 x 15/16 x 100 MB / 25 GB/s = 7.576 ms.
    comm = 28 * 2e-6 + 2 * 10e-6 + 2 * 15 / 16 * 100e6 / 25e9
    assert comm == pytest.approx(7.576e-3)
    assert point.comm_s == pytest.approx(comm)
    # No calibration of the measuring host: its overlap cannot be judged, so all of it is exposed.
    assert point.exposed_s == pytest.approx(comm)
    assert point.step_s == pytest.approx(0.2 + comm)
    assert point.samples_per_s == pytest.approx(8 * 16 / (0.2 + comm))
    assert point.efficiency == pytest.approx(0.2 / (0.2 + comm))
    assert point.exposed_share == pytest.approx(comm / (0.2 + comm))
    assert point.model_state_bytes_per_rank == pytest.approx(16 * 10**6)     # fp32 AdamW, whole: 4 + 4 + 8


def test_the_measured_overlap_is_carried_as_a_fraction_and_bounded_by_backward():
    rows = [_row("ddp", 2, _counted("all_reduce", 100e6, 1, 2), exposed=0.05)]
    # The measuring host prices the counted all-reduce at 2 ranks: 2 x 100 us + 1 x 100 MB x 1 ns = 100.2 ms,
    # of which 50 ms was exposed.
    fraction = 0.05 / (2 * 100e-6 + 100e6 * 1e-9)
    points, _ = project_rows(rows, MODEL, [16], [Scaling.WEAK], measuring_host=_host())
    comm = 28 * 2e-6 + 2 * 10e-6 + 2 * 15 / 16 * 100e6 / 25e9
    assert _only(points, Scaling.WEAK, 16).exposed_s == pytest.approx(fraction * comm)
    # On a slow network the communication outgrows backward (2/3 of 200 ms): what does not fit is exposed.
    slow = ClusterModel(load_cluster(None, {**CLUSTER, "inter_node_bandwidth_GBps": 0.25}))
    points, _ = project_rows(rows, slow, [16], [Scaling.WEAK], measuring_host=_host())
    slow_comm = 28 * 2e-6 + 2 * 10e-6 + 2 * 15 / 16 * 100e6 / 0.25e9
    assert slow_comm - 2 / 3 * 0.2 > fraction * slow_comm
    assert BACKWARD_SHARE == pytest.approx(2 / 3)
    assert _only(points, Scaling.WEAK, 16).exposed_s == pytest.approx(slow_comm - 2 / 3 * 0.2)


def test_a_calibrated_target_gives_a_band_from_its_residuals():
    # Rows sat at 0.8, 0.9, 1.0, 1.1 and 1.5 x the fit: the 10th percentile (linear) is 0.8 + 0.4 x 0.1 =
    # 0.84, the 90th 1.1 + 0.6 x 0.4 = 1.34.
    calibration = _host(ratios=(0.8, 0.9, 1.0, 1.1, 1.5))
    rows = [_row("ddp", 2, _counted("all_reduce", 100e6, 1, 2))]
    points, _ = project_rows(rows, calibration, [4], [Scaling.WEAK])
    point = _only(points, Scaling.WEAK, 4)
    comm = 2 * 3 * 100e-6 + 2 * 3 / 4 * 100e6 * 1e-9            # ring on one link at 4 ranks: 150.6 ms
    assert point.step_s == pytest.approx(0.2 + comm)
    assert point.step_low_s == pytest.approx(0.2 + 0.84 * comm)
    assert point.step_high_s == pytest.approx(0.2 + 1.34 * comm)
    # A described cluster has no residuals: no band.
    cluster_points, _ = project_rows(rows, MODEL, [16], [Scaling.WEAK])
    assert cluster_points[0].step_low_s is None


def test_zero3_all_gathers_keep_their_whole_size_and_follow_the_micro_batches():
    # ZeRO-3 at 2 ranks, global batch 32 in micro-batches of 4: 16 samples a replica, K = 4 micro-batches;
    # it all-gathers the W = 4 MB of weights 2K = 8 times and reduce-scatters G = 4 MB K = 4 times.
    w = g = 4e6
    counted = {**_counted("all_gather", w, 8, 2), **_counted("reduce_scatter", g, 4, 2)}
    rows = [_row("zero3", 2, counted, global_batch=32, micro_batch=4, micro_batches=4)]
    points, _ = project_rows(rows, MODEL, [4, 8, 16], [Scaling.WEAK, Scaling.STRONG])
    weak = _only(points, Scaling.WEAK, 16)
    calls = {s.collective: (s.calls, s.size_bytes, s.ranks(16)) for s in weak.schedule}
    # nccl-tests sizes are the whole gathered output: W at any N (not a shard, not N shards), among 16.
    assert calls == {"all_gather": (8, w, 16), "reduce_scatter": (4, g, 16)}
    # A rank's wire bytes grow from (2-1)/2 W to (16-1)/16 W per call.
    assert weak.wire_bytes_per_rank == pytest.approx(8 * 15 / 16 * w + 4 * 15 / 16 * g)
    one_call = 14 * 2e-6 + 1 * 10e-6 + 15 / 16 * 4e6 / 25e9      # ring on 2 nodes of 8: 188 us
    assert weak.comm_s == pytest.approx(12 * one_call)
    # Strong scaling keeps the global batch 32: 8 samples a replica at 4 ranks (K = 2), 4 at 8 (K = 1).
    at4, at8 = _only(points, Scaling.STRONG, 4), _only(points, Scaling.STRONG, 8)
    assert {s.collective: s.calls for s in at4.schedule} == {"all_gather": 4, "reduce_scatter": 2}
    assert {s.collective: s.calls for s in at8.schedule} == {"all_gather": 2, "reduce_scatter": 1}
    assert at8.compute_s == pytest.approx(0.2 * 4 / 16)
    assert at8.efficiency == pytest.approx(0.2 * 32 / 16 / (8 * at8.step_s))


def test_zero3_parameters_kept_whole_are_gathered_once_a_step_at_any_micro_batch_count():
    # DeepSpeed ZeRO-3 keeps parameters under param_persistence_threshold whole and re-gathers them once a
    # step, after it (on gpt-tiny all of them: 52 all-gathers of 947,712 bytes in all a step, at 2 ranks and
    # K = 4 as at 4 ranks and K = 2). Measured at 2 ranks, K = 4, as such a row records it:
    w = g = 4e6
    counted = {**_counted("all_gather", w / 52, 52, 2), **_counted("reduce_scatter", g, 4, 2)}
    row = _row("zero3", 2, counted, global_batch=32, micro_batch=4, micro_batches=4)
    row["measurements"]["weights_kept_whole_parameters_by_rank"] = [10**6, 10**6]      # all 10**6 parameters
    points, _ = project_rows([row], MODEL, [4, 8], [Scaling.STRONG])
    # Strong scaling to 4 ranks (K = 2) and 8 (K = 1): the 52 gathers stay, the reduce-scatters follow K.
    assert {s.collective: s.calls for s in _only(points, Scaling.STRONG, 4).schedule} == {"all_gather": 52,
                                                                                          "reduce_scatter": 2}
    assert {s.collective: s.calls for s in _only(points, Scaling.STRONG, 8).schedule} == {"all_gather": 52,
                                                                                          "reduce_scatter": 1}
    # A quarter kept whole: the expected gathers at K micro-batches are 2K of the other 3/4 and one of the
    # quarter, 2 x 4 + 1 = 9 at 2 ranks and 2 x 2 + 1 = 5 at 4, so the counted 52 become 52 x 5/9 (the
    # documented blend: DeepSpeed's one call per persistent tensor is not in the expected traffic).
    row["measurements"]["weights_kept_whole_parameters_by_rank"] = [250_000, 250_000]
    points, _ = project_rows([row], MODEL, [4], [Scaling.STRONG])
    [gathers] = [s for s in _only(points, Scaling.STRONG, 4).schedule if s.collective == "all_gather"]
    assert gathers.calls == pytest.approx(52 * 5 / 9)
    # Bytes a step: 8 x 3 MB + 1 MB = 25 MB at 2 ranks, 4 x 3 + 1 = 13 MB at 4: each call 13/25 x 9/5 the size.
    assert gathers.size_bytes == pytest.approx(w / 52 * (13 / 25) / (5 / 9))
    # Ranks that disagree: the one holding the most decides, for the gathers and for whether the states fit
    # (rank 0 holding none must not hide it). Memory at 4 ranks, fp32 (ZeRO paper, 4 + 4 + 12 bytes, all
    # sharded): 10**6 x 20 / 4 = 5 MB, plus 250,000 whole 4-byte weights = 6 MB.
    row["measurements"]["weights_kept_whole_parameters_by_rank"] = [0, 250_000]
    points, _ = project_rows([row], MODEL, [4], [Scaling.STRONG])
    at4 = _only(points, Scaling.STRONG, 4)
    [gathers] = [s for s in at4.schedule if s.collective == "all_gather"]
    assert gathers.calls == pytest.approx(52 * 5 / 9)
    assert at4.model_state_bytes_per_rank == 6_000_000


def test_a_counted_collective_standing_in_for_an_expected_one_follows_it_and_is_not_priced_twice():
    # DeepSpeed ZeRO-2 on gloo reduces its gradients with all-reduces, not the reduce-scatter it stands for:
    # measured at 2 ranks with 4 micro-batches a step, 4 x 4 MB of gradients in 5 calls (one a step more).
    counted = {**_counted("all_reduce", 3.2e6, 5, 2), **_counted("all_gather", 4e6, 1, 2)}
    rows = [_row("zero2", 2, counted, global_batch=32, micro_batch=4, micro_batches=4)]
    points, _ = project_rows(rows, MODEL, [8], [Scaling.STRONG])
    point = points[0]
    kept = {s.collective: (s.calls, s.size_bytes, s.origin) for s in point.schedule}
    # Strong scaling to 8 ranks: 1 micro-batch a step, so ZeRO-2's reduce-scatters per step go from 4 to 1,
    # and the all-reduces standing in for them from 5 to 5 x 1/4, each of the same size.
    assert kept["all_reduce"] == (pytest.approx(1.25), pytest.approx(3.2e6), "counted")
    assert any("counted all_reduce stands in for zero2's expected reduce_scatter" in note for note in point.notes)
    assert "reduce_scatter" not in kept                     # its work is the all-reduces'


def test_memory_per_rank_follows_the_zero_formulas():
    # Rajbhandari et al. 2020 sec. 5.1 with N_d = 64 and Psi = 1e9 parameters.
    psi, n = 10**9, 64
    expected = {("zero1", "autocast"): 4 * psi + 4 * psi + 12 * psi / n,          # P_os, fp32 weights/grads
                ("zero2", "deepspeed-bf16"): 2 * psi + (2 + 12) * psi / n,          # P_os+g
                ("zero3", "deepspeed-bf16"): (2 + 2 + 12) * psi / n,                # P_os+g+p: 250 MB
                ("ddp", "autocast"): (4 + 4 + 8) * psi}
    for (strategy, recipe), total in expected.items():
        basis = description_basis(strategy=strategy, parameters=psi, compute_s=0.1, recipe=recipe)
        points, _ = project(basis, [n], MODEL, REGISTRY_FACTS, [Scaling.WEAK])
        assert points[0].model_state_bytes_per_rank == pytest.approx(total), strategy


def test_a_description_alone_prices_the_strategy_s_own_schedule():
    # 1e9 parameters, 2-byte gradients, 120 ms a step: DDP all-reduces 2 GB once per step.
    basis = description_basis(strategy="ddp", parameters=10**9, compute_s=0.12, gradient_element_bytes=2)
    points, _ = project(basis, [16], MODEL, REGISTRY_FACTS, [Scaling.WEAK])
    comm = 28 * 2e-6 + 2 * 10e-6 + 2 * 15 / 16 * 2e9 / 25e9
    assert points[0].step_s == pytest.approx(0.12 + comm)
    # ZeRO-3: all-gathers of 2 GB for forward and backward, a reduce-scatter of 2 GB.
    basis = description_basis(strategy="zero3", parameters=10**9, compute_s=0.12, gradient_element_bytes=2)
    points, _ = project(basis, [16], MODEL, REGISTRY_FACTS, [Scaling.WEAK])
    ring = 14 * 2e-6 + 1 * 10e-6 + 15 / 16 * 2e9 / 25e9
    assert points[0].comm_s == pytest.approx(3 * ring)


def test_projected_rows_are_never_read_as_measurements(tmp_path, capsys):
    results = tmp_path / "mixed.jsonl"
    results.write_text((REFERENCE / "smoke.jsonl").read_text())
    measured = load_rows([results])
    points, _ = project_rows(measured, MODEL, [8, 16], [Scaling.WEAK])
    for point in points:
        append_line(results, projected_record(point, MODEL))
    assert len(load_rows([results])) == len(measured) == 2          # the cell readers skip them
    summary = summary_table(load_rows([results]))
    assert summary.count("gpt-tiny/") == 2
    projected = read_rows([results], kind=PROJECTION_KIND)
    assert len(projected) == 2
    assert {row["status"] for row in projected} == {"projected"}
    ddp = next(row for row in measured if row["spec"]["strategy"] == "ddp")
    assert projected[0]["inputs"]["rows"] == [ddp["run_id"]]
    assert projected[0]["inputs"]["target"]["gpus_per_node"] == 8


def test_the_committed_rows_project_to_1024_gpus_on_a_preset(tmp_path, capsys):
    out = tmp_path / "projected.jsonl"
    assert main(["project", str(REFERENCE / "smoke.jsonl"), "--comm", str(REFERENCE / "comm-ws2.jsonl"),
                 "--cluster", "dgx-h100-ib", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gpt-tiny/ddp/fp32" in printed and "\nweak     1024 " in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert max(row["world_size"] for row in rows) == 1024
    assert rows[0]["inputs"]["comm_rows"] == [str(REFERENCE / "comm-ws2.jsonl")]


def test_every_data_parallel_strategy_of_the_committed_full_rows_projects_to_1024_gpus(tmp_path, capsys):
    # results/reference/ci-cpu/full.jsonl: `run --matrix full --workload gpt-tiny` on the 2-core machine,
    # every data-parallel strategy at world sizes 1 and 2 with its compute-only pass.
    out = tmp_path / "projected.jsonl"
    assert main(["project", str(REFERENCE / "full.jsonl"), "--comm", str(REFERENCE / "comm-ws2.jsonl"),
                 "--cluster", "dgx-h100-ib", "--world-sizes", "8,1024", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    at_1024 = {row["strategy"] for row in rows if row["world_size"] == 1024 and row["scaling"] == "weak"}
    assert at_1024 == {"ddp", "horovod", "zero1", "zero2", "zero3", "fsdp2"}


def test_a_description_alone_projects_every_data_parallel_strategy(capsys):
    assert main(["project", "--params", "1.5B", "--compute-ms", "120", "--cluster", "dgx-h100-ib",
                 "--scaling", "weak"]) == 0
    printed = capsys.readouterr().out
    for strategy in ("ddp", "horovod", "zero1", "zero2", "zero3", "fsdp2"):
        assert f"described/{strategy}/" in printed


@pytest.mark.parametrize("arguments, message", [
    (["--params", "1B", "--compute-ms", "10"], "needs a target"),
    (["--params", "1B", "--cluster", "dgx-h100-ib"], "needs --compute-ms MS, or --shape (or --model) with a --cluster"),
    (["--params", "1B", "--compute-ms", "10", "--cluster", "dgx-h100-ib", "--world-sizes", "12"],
     "do not fill whole nodes of 8"),
    (["--params", "1B", "--compute-ms", "10", "--cluster", "dgx-h100-ib", "--strategies", "pipeline"],
     "give --shape SEQ,HIDDEN,HEADS,LAYERS"),
    (["--params", "1B", "--compute-ms", "10", "--cluster", "dgx-h100-ib", "--strategies", "dataparallel"],
     "not modelled"),
    (["--params", "1B", "--compute-ms", "10", "--set", "gpus_per_node=4", "--comm",
      str(REFERENCE / "comm-ws2.jsonl")], "--set changes a cluster"),
    (["--cluster", "dgx-h100-ib"], "give measured ROWS"),
])
def test_bad_input_is_one_line(arguments, message, capsys):
    assert main(["project", *arguments]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error, error


def test_a_row_with_no_compute_only_time_is_left_out_with_its_reason():
    row = _row("ddp", 2, _counted("all_reduce", 1e6, 1, 2))
    row["measurements"]["compute_only_step_time_s_by_rank"] = None
    row["measurements"]["compute_only_unavailable_because"] = "did not fit"
    bases, skipped = bases_from_rows([row], REGISTRY_FACTS)
    assert not bases and "did not fit" in skipped[0]
    with pytest.raises(SpecError, match="no measured row to project from"):
        project_rows([row], MODEL, [8])


# ---- f: exposed time over priced communication (issue 33, finding 6) -------------------------------------

def test_f_above_one_measured_on_rows_is_carried_unclipped_and_said_in_the_output():
    # DDP at 2 ranks exposed 150 ms; the measuring host prices its all-reduce of 100 MB at
    # 2 x 100 us + 100 MB x 1 ns = 100.2 ms: f = 150 / 100.2 = 1.497, above 1.
    rows = [_row("ddp", 2, _counted("all_reduce", 100e6, 1, 2), exposed=0.15)]
    f = 0.15 / (2 * 100e-6 + 100e6 * 1e-9)
    assert f == pytest.approx(1.497, abs=1e-3)
    points, _ = project_rows(rows, MODEL, [16], [Scaling.WEAK], measuring_host=_host())
    point = _only(points, Scaling.WEAK, 16)
    comm = 28 * 2e-6 + 2 * 10e-6 + 2 * 15 / 16 * 100e6 / 25e9         # ring, 2 nodes of 8: 7.576 ms
    assert point.basis.exposed_fraction == pytest.approx(f)              # not clipped to 1
    assert point.exposed_s == pytest.approx(f * comm)                    # 11.34 ms, more than comm itself
    assert point.exposed_s > point.comm_s
    said = format_table(points)
    assert "f = 1.5 > 1: exposed time is 1.5 x the priced communication" in said
    assert any(note.startswith("f = 1.5 > 1") for note in projected_record(point, MODEL)["notes"])


def test_a_description_takes_f_above_one_and_prices_it():
    # DDP, 1e9 parameters, 2-byte gradients: one all-reduce of 2 GB among 16 (ring, 2 nodes of 8):
    # 76 us + 2 x 15/16 x 2 GB / 25 GB/s = 150.076 ms; f = 1.5 exposes 225.114 ms behind 120 ms of compute.
    basis = description_basis(strategy="ddp", parameters=10**9, compute_s=0.12, gradient_element_bytes=2,
                              exposed_fraction=1.5)
    points, _ = project(basis, [16], MODEL, REGISTRY_FACTS, [Scaling.WEAK])
    comm = 28 * 2e-6 + 2 * 10e-6 + 2 * 15 / 16 * 2e9 / 25e9
    assert comm == pytest.approx(150.076e-3)
    assert points[0].exposed_s == pytest.approx(1.5 * 150.076e-3)
    assert points[0].step_s == pytest.approx(0.12 + 0.225114)
    assert any(note.startswith("f = 1.5 > 1") for note in points[0].notes)
    # f <= 1 carries no such note.
    basis = description_basis(strategy="ddp", parameters=10**9, compute_s=0.12, exposed_fraction=1.0)
    assert not any("> 1" in note for note in project(basis, [16], MODEL, REGISTRY_FACTS, [Scaling.WEAK])[0][0].notes)


def test_the_command_line_takes_f_above_one_and_says_so(capsys):
    assert main(["project", "--params", "1B", "--compute-ms", "120", "--cluster", "dgx-h100-ib", "--scaling", "weak",
                 "--world-sizes", "16", "--strategies", "ddp", "--exposed-fraction", "1.25"]) == 0
    printed = capsys.readouterr().out
    assert "overlap: given: f = 1.25" in printed and "note: f = 1.25 > 1" in printed


@pytest.mark.parametrize("value", ["-0.5", "nan", "inf"])
def test_an_exposed_fraction_below_zero_or_not_finite_is_one_line(value, capsys):
    assert main(["project", "--params", "1B", "--compute-ms", "120", "--cluster", "dgx-h100-ib",
                 "--exposed-fraction", value]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "finite number >= 0" in error, error


# ---- --strategies and the other description flags with measured rows ---------------------------------------

def test_strategies_with_rows_projects_only_those_cells(tmp_path, capsys):
    out = tmp_path / "projected.jsonl"
    assert main(["project", str(REFERENCE / "full.jsonl"), "--comm", str(REFERENCE / "comm-ws2.jsonl"),
                 "--cluster", "dgx-h100-ib", "--world-sizes", "8", "--scaling", "weak", "--strategies", "ddp,zero3",
                 "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["strategy"] for row in rows) == ["ddp", "zero3"]
    printed = capsys.readouterr().out
    assert "gpt-tiny/horovod" not in printed and "gpt-tiny/plain" not in printed


@pytest.mark.parametrize("extra, message", [
    (["--strategies", "ddp,zero9"], "--strategies zero9: no row of it to project; the rows hold: ddp, fsdp2, horovod"),
    (["--exposed-fraction", "0.5"], "--exposed-fraction describes a model (--params)"),
    (["--grad-bytes", "2", "--recipe", "deepspeed-bf16"], "--grad-bytes, --recipe describes a model"),
])
def test_a_description_flag_with_rows_is_one_line(extra, message, capsys):
    assert main(["project", str(REFERENCE / "full.jsonl"), "--cluster", "dgx-h100-ib", *extra]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error, error


# ---- each call by the algorithm its library would choose (issue 33, finding 7) ---------------------------------

def test_ddp_and_horovod_at_1024_gpus_of_dgx_h100_ib_are_priced_as_nccl_would_choose_by_hand(tmp_path, capsys):
    # The committed CPU rows: DDP all-reduces S = 947,712 bytes once a step (gpt-tiny's fp32 gradients);
    # Horovod's 52 per-tensor all-reduces go on the wire as 11 fused ones of S/11 (its note).
    # dgx-h100-ib (harness/project/presets.py): g = 8 GPUs a node, alpha_i = 3.4 us, B_i = 450 GB/s;
    # alpha_e = 14 us, B_e = 400 GB/s a node. 1024 GPUs are m = 128 nodes.
    s = 947_712
    # Ring (Thakur, Rabenseifner and Gropp 2005: 2(p-1) steps of S/p; NCCL tuning.cc: 2(m-1) of them cross
    # a node; the slower link, B_e, paces the 2(p-1)/p S bytes):
    #   2 (1024 - 128) x 3.4 us + 2 x 127 x 14 us + 2 x 1023/1024 x S / 400 GB/s
    #   = 6092.8 us + 3556 us + 4.734 us = 9653.534 us
    ring = 2 * 896 * 3.4e-6 + 2 * 127 * 14e-6 + 2 * 1023 / 1024 * s / 400e9
    assert ring == pytest.approx(9653.534e-6, abs=1e-9)
    # NCCL's tree as collectives.py models it (a chain through a node's 8 GPUs, a double binary tree over
    # the 128 nodes, up and down; 2S through the slower link; Sanders, Speck and Traeff 2009):
    #   2 x (7 x 3.4 us + log2(128) x 14 us) + 2 x S / 400 GB/s = 243.6 us + 4.739 us = 248.339 us
    tree = 2 * (7 * 3.4e-6 + 7 * 14e-6) + 2 * s / 400e9
    assert tree == pytest.approx(248.339e-6, abs=1e-9)
    rows = load_rows([REFERENCE / "full.jsonl"])
    dgx = load_cluster("dgx-h100-ib")
    points, _ = project_rows(rows, ClusterModel(dgx), [1024], [Scaling.WEAK], strategies=["ddp", "horovod"])
    ddp = next(p for p in points if p.basis.strategy == "ddp")
    assert [(i.collective, i.size_bytes, i.calls) for i in ddp.schedule] == [("all_reduce", s, 1)]
    assert ddp.comm_s == pytest.approx(tree, rel=1e-9)          # NCCL's least time: the tree, not the ring
    assert ddp.algorithms == ("tree",)
    horovod = next(p for p in points if p.basis.strategy == "horovod")
    # 11 tree all-reduces of S/11: 11 x (243.6 us + 2 x 86,155.6 B / 400 GB/s) = 11 x 244.031 us = 2.684 ms.
    assert horovod.comm_s == pytest.approx(11 * (243.6e-6 + 2 * s / 11 / 400e9), rel=1e-9)
    assert horovod.comm_s == pytest.approx(2.684e-3, abs=1e-6)
    assert horovod.algorithms == ("tree",)
    # --algorithm all_reduce=ring still forces the ring: DDP's 9.654 ms, and its weak efficiency with f as
    # the rows measured it: compute / (compute + f x ring) (f x ring is above ring - 2/3 compute).
    forced, _ = project_rows(rows, ClusterModel(dgx, {"all_reduce": "ring"}), [1024], [Scaling.WEAK],
                             strategies=["ddp"])
    assert forced[0].comm_s == pytest.approx(ring, rel=1e-9)
    assert forced[0].algorithms == ("ring",)
    f, compute = forced[0].basis.exposed_fraction, forced[0].basis.compute_s
    assert forced[0].efficiency == pytest.approx(compute / (compute + f * ring), rel=1e-9)
    # The printed table and the projected rows name the algorithm of each collective.
    out = tmp_path / "projected.jsonl"
    assert main(["project", str(REFERENCE / "full.jsonl"), "--comm", str(REFERENCE / "comm-ws2.jsonl"),
                 "--cluster", "dgx-h100-ib", "--world-sizes", "8,1024", "--scaling", "weak", "--strategies", "ddp",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "library nccl: each call by its least modelled time" in printed
    assert printed.count("all_reduce=ring") == 1 and printed.count("all_reduce=tree") == 1   # 8 GPUs: one node
    written = {row["world_size"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert [e["algorithm"] for e in written[1024]["schedule"]] == ["tree"]
    assert [e["algorithm"] for e in written[8]["schedule"]] == ["ring"]
    assert written[1024]["inputs"]["target"]["library"] == "nccl"


def test_mpi_prices_an_all_reduce_by_halving_doubling_at_1024_gpus_by_hand():
    # Rabenseifner's all-reduce (Thakur et al. 2005, sec. 4.4), the larger halves kept inside the node:
    # 2 x (lg 8 x 3.4 us + 7/8 x S / 450 GB/s + lg 128 x 14 us + 127/128 x S / 400 GB/s)
    # = 2 x (10.2 + 1.843 + 98 + 2.351) us = 224.787 us, below NCCL's tree (248.339 us).
    s = 947_712
    expected = 2 * (3 * 3.4e-6 + 7 / 8 * s / 450e9 + 7 * 14e-6 + 127 / 128 * s / 400e9)
    assert expected == pytest.approx(224.787e-6, abs=1e-9)
    model = ClusterModel(load_cluster("dgx-h100-ib"), library="mpi")
    assert model.choose("all_reduce", s, 1024) == ("halving_doubling", pytest.approx(expected, rel=1e-9))


def test_a_library_or_algorithm_with_a_calibrated_target_is_one_line(capsys):
    for extra in (["--library", "mpi"], ["--algorithm", "all_reduce=tree"]):
        assert main(["project", "--params", "1B", "--compute-ms", "10", "--comm",
                     str(REFERENCE / "comm-ws2.jsonl"), *extra]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "a calibration was fitted with its own" in error, error


def test_launches_of_one_strategy_at_two_global_batches_are_two_bases_never_one():
    # DDP at 2 ranks measured at global batch 16 (0.2 s of compute) and at 64 (four times the work, 0.8 s):
    # merged into one basis, its medians would mix both steps under one per-device batch, and f with them.
    small = _row("ddp", 2, _counted("all_reduce", 4e6, 1, 2), compute=0.2, exposed=0.03, global_batch=16)
    large = _row("ddp", 2, _counted("all_reduce", 4e6, 1, 2), compute=0.8, exposed=0.03, global_batch=64)
    small["run_id"], large["run_id"] = "small", "large"
    bases, skipped = bases_from_rows([small, large], REGISTRY_FACTS, _host())
    assert not skipped
    assert sorted((b.global_batch, b.per_device_batch, b.run_ids) for b in bases) == [(16, 8, ("small",)),
                                                                                     (64, 32, ("large",))]
    # Each from its own launches: compute 0.2 s and 0.8 s, the same 30 ms beyond it over 4.2 ms of priced
    # ring all-reduce among 2 (2 x 100 us + 2 x 1/2 x 4 MB at 1 GB/s), f = 0.03 / 0.0042 in both.
    assert sorted(b.compute_s for b in bases) == [pytest.approx(0.2), pytest.approx(0.8)]
    assert [b.exposed_fraction for b in bases] == [pytest.approx(0.03 / 0.0042)] * 2
