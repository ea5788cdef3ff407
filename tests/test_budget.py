"""A run's time budget (`harness run --budget`, harness.runner.Budget): no launch starts with too little of it left,
each launch times out at what is left, and the launches never started are rows that say so."""

from __future__ import annotations

import pytest

from harness.matrix import Machine, Selection, build_matrix
from harness.record import read_results
from harness.runner import BUDGET_FLOOR_S, Budget, RunOptions, run_specs
from harness.spec import DeviceKind, SpecError, Status


@pytest.mark.launch       # the run records its environment (git), though it launches no cell
def test_a_spent_budget_starts_nothing_and_records_every_launch_skipped_saying_why(tmp_path):
    # Under the floor from the start: no launch may begin.
    specs = build_matrix("smoke", Machine(device=DeviceKind.CPU, devices_per_node=2), Selection(repeats=2))
    out = tmp_path / "rows.jsonl"
    rows = run_specs(specs, RunOptions(results=out, budget_s=BUDGET_FLOOR_S - 1))
    assert len(rows) == 4 and all(row.status is Status.SKIPPED for row in rows)
    assert all("of the run's budget of 29 s (--budget)" in row.message for row in rows)
    # Repeat by repeat (harness.runner): every cell's first launch, then every second one.
    assert [(r.spec.strategy, r.repeat) for r in read_results([out])] == [("plain", 0), ("ddp", 0), ("plain", 1),
                                                                           ("ddp", 1)]


def test_a_launch_times_out_at_what_is_left_of_the_budget():
    budget = Budget(100.0)
    assert 99 < budget.timeout(900.0) <= 100 and budget.timeout(10.0) == 10.0 and not budget.spent()
    assert Budget(None).timeout(900.0) == 900.0 and not Budget(None).spent()


@pytest.mark.parametrize("seconds", [0.0, -5.0, float("inf"), float("nan")])
def test_a_budget_must_be_a_positive_finite_number_of_seconds(tmp_path, seconds):
    with pytest.raises(SpecError, match="budget_s must be a positive, finite number of seconds"):
        RunOptions(results=tmp_path / "rows.jsonl", budget_s=seconds)
