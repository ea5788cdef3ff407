"""Real 2-rank DDP over gloo on CPU, launched by torchrun through the harness, against the plain loop."""

import math
import statistics

import pytest

from harness.derive.exposed import exposed_communication
from harness.derive.memory import predicted_model_states
from harness.matrix import Machine, Selection, build_matrix
from harness.derive.parity import Verdict, judge
from harness.record import read_results
from harness.runner import RunOptions, run_specs
from harness.spec import DeviceKind, Status

pytestmark = pytest.mark.launch   # every test here reads cells launched for real


@pytest.fixture(scope="module")
def smoke_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "smoke.jsonl"
    specs = build_matrix("smoke", Machine(device=DeviceKind.CPU, devices_per_node=2),
                         Selection(workloads=("resnet20-cifar", "gpt-tiny")))
    run_specs(specs, RunOptions(results=out, timeout_s=300))
    return read_results([out])


def test_smoke_writes_one_ok_row_per_cell(smoke_rows):
    assert [(r.spec.workload, r.spec.strategy, r.spec.world_size) for r in smoke_rows] == [
        ("resnet20-cifar", "plain", 1), ("resnet20-cifar", "ddp", 2), ("gpt-tiny", "plain", 1), ("gpt-tiny", "ddp", 2)]
    assert all(r.status is Status.OK for r in smoke_rows), [r.message for r in smoke_rows]
    for row in smoke_rows:
        assert row.environment["torch"] and row.launch_command and row.schema_version == 2
        assert len(row.measurements["step_time_s"]) == row.spec.timed_steps
        assert all(t > 0 for t in row.measurements["step_time_s"])
        assert "samples_per_s" not in row.measurements    # derived when read (harness.derive), never stored


def test_losses_are_finite_and_fall(smoke_rows):
    for row in smoke_rows:
        losses = row.measurements["loss_per_step"]
        assert len(losses) == row.spec.warmup_steps + row.spec.timed_steps
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0]


def test_ddp_at_world_size_2_matches_world_size_1_in_fp32(smoke_rows):
    by_key = {(r.spec.workload, r.spec.world_size): r for r in smoke_rows}
    verdicts = {(r.spec.workload, r.spec.world_size): p
                for r, p in zip(smoke_rows, judge([r.to_dict() for r in smoke_rows]))}
    for workload in ("resnet20-cifar", "gpt-tiny"):
        ddp = by_key[(workload, 2)]
        assert ddp.spec.global_batch == by_key[(workload, 1)].spec.global_batch
        assert verdicts[workload, 2].verdict is Verdict.MATCH, verdicts[workload, 2]
        assert verdicts[workload, 1].verdict is Verdict.REFERENCE
        assert ddp.launch_command[-6].endswith("torchrun") or "torchrun" in " ".join(ddp.launch_command)


def test_ddp_all_reduces_exactly_its_gradient_bytes_each_step(smoke_rows):
    for row in smoke_rows:
        m = row.measurements
        if row.spec.strategy != "ddp":
            assert m["comm_per_step_by_rank"] == [{}]
            continue
        gradient_bytes = m["parameters"] * 4                  # fp32 gradients
        for per_rank in m["comm_per_step_by_rank"]:
            # One averaging all-reduce per bucket, on the last micro-batch only (no_sync before it);
            # buckets are views of the gradients, so there is no padding to allow for.
            assert per_rank["all_reduce"]["bytes"] == gradient_bytes
            assert set(per_rank) == {"all_reduce"}
        assert m["comm_expected_per_step"]["collectives"] == [
            {"collective": "all_reduce", "size_bytes": gradient_bytes, "calls": 1, "ranks": 2}]


def test_rows_carry_memory_predictions_exposed_comm_and_mfu_fields(smoke_rows):
    from harness.derive.cells import launch_record
    from harness.derive.throughput import Basis

    for row in smoke_rows:
        m = row.measurements
        figures = launch_record(row.to_dict(), Basis.UNSTALLED)      # derived when read, as every reader does
        stalled = m["host_stalled_step_indices"]
        unstalled = [t for i, t in enumerate(m["step_time_s"]) if i not in stalled]
        assert predicted_model_states(m)[0]["total"] == 16 * m["parameters"]     # fp32 Adam, unsharded
        assert figures["mfu"] is None and figures["peak_flops_per_s"] is None   # a CPU has no datasheet peak
        assert figures["model_flops_per_s_per_device"] == pytest.approx(
            m["train_flops_per_sample"] * row.spec.global_batch / statistics.median(unstalled) / row.spec.world_size)
        exposed = exposed_communication(m)
        if row.spec.strategy == "plain":
            assert exposed.exposed_comm_s is None and "no communication" in exposed.note
        else:
            assert len(m["compute_only_step_time_s"]) == row.spec.timed_steps
            assert m["compute_only_kind"] == "same work"
            assert m["compute_only_optimizer_elements_by_rank"] == [m["parameters"]] * 2   # DDP: every element
            assert exposed.exposed_comm_share == pytest.approx(exposed.exposed_comm_s / statistics.median(unstalled))
        assert m["host_stalled_steps"] == len(stalled) and len(m["host_lost_cpu_s_per_step"]) == row.spec.timed_steps
        assert figures["step_time_unstalled_median_s"] == pytest.approx(statistics.median(unstalled))
