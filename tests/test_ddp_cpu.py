"""Real 2-rank DDP over gloo on CPU, launched by torchrun through the harness, against the plain loop: the
smoke matrix's cells. They are tests/conftest.py's fp32 rows of the same cells (the smoke matrix's cells are
the full matrix's plain and DDP cells), run for 2 warm-up and 3 timed steps instead of the matrix's 3 and 10:
nothing here needs more steps, and launching them again would measure nothing new."""

import math
import statistics

import pytest

from harness.derive.exposed import exposed_communication
from harness.derive.memory import predicted_model_states
from harness.matrix import Machine, Selection, build_matrix
from harness.derive.parity import Verdict, judge
from harness.spec import DeviceKind, Status

SMOKE = build_matrix("smoke", Machine(device=DeviceKind.CPU, devices_per_node=2),
                     Selection(workloads=("resnet20-cifar", "gpt-tiny")))


def test_the_smoke_matrix_is_the_plain_loop_and_ddp_at_two_ranks_on_each_tiny_workload():
    assert [(s.workload, s.strategy, s.world_size) for s in SMOKE] == [
        ("resnet20-cifar", "plain", 1), ("resnet20-cifar", "ddp", 2), ("gpt-tiny", "plain", 1), ("gpt-tiny", "ddp", 2)]


@pytest.fixture(scope="module")
def smoke_rows(gpt_tiny_fp32, resnet_smoke_fp32):
    """The rows of the smoke matrix's cells, in its order: each the smoke cell itself, steps aside."""
    fp32 = {"gpt-tiny": gpt_tiny_fp32, "resnet20-cifar": resnet_smoke_fp32}
    rows = [fp32[spec.workload][spec.strategy] for spec in SMOKE]
    for spec, row in zip(SMOKE, rows):
        assert row.spec == spec.replace(warmup_steps=row.spec.warmup_steps, timed_steps=row.spec.timed_steps)
    return rows


@pytest.mark.launch
def test_smoke_writes_one_ok_row_per_cell(smoke_rows):
    assert all(r.status is Status.OK for r in smoke_rows), [r.message for r in smoke_rows]
    for row in smoke_rows:
        assert row.environment["torch"] and row.launch_command and row.schema_version == 2
        assert len(row.measurements["step_time_s"]) == row.spec.timed_steps
        assert all(t > 0 for t in row.measurements["step_time_s"])
        assert "samples_per_s" not in row.measurements    # derived when read (harness.derive), never stored


@pytest.mark.launch
def test_losses_are_finite_and_fall(smoke_rows):
    for row in smoke_rows:
        losses = row.measurements["loss_per_step"]
        assert len(losses) == row.spec.warmup_steps + row.spec.timed_steps
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0]


@pytest.mark.launch
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


@pytest.mark.launch
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
            {"collective": "all_reduce", "size_bytes": gradient_bytes, "calls": 1, "ranks": 2, "group": "world",
             "stride": 1}]


@pytest.mark.launch
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
