"""A launch recorded more than once counts once, by its last row in time (harness.derive.launches), in `run`'s verdict
and in `report` alike: `run --resume` appends a new row for a launch it runs again, and the report read "partial: 1
of 2 launches ok" for a resumed cell; and where a launch had two rows, `run --resume` judged the one last in the file
while the report judged the worst of both. Rows written here by hand; nothing is launched."""

from __future__ import annotations

import json
import uuid

import pytest

from harness import runner
from harness.cli.run import EXIT_CHECK_FAILED, failed_checks, run_exit_status
from harness.derive.cells import cell_table, launch_table
from harness.derive.launches import last_rows
from harness.derive.rows import load_rows
from harness.report.verdicts import verdicts
from harness.runner import RunOptions, run_specs
from harness.spec import RunResult, RunSpec, Status
from harness.strategies import checked

# What run_environment records with capture_environment replaced below: the cells' conditions.
ENVIRONMENT = {"cpu_model": "test", "cpu_count": 2, "placement": "local"}
PLAIN = RunSpec(workload="gpt-tiny", strategy="plain", world_size=1, global_batch=16, micro_batch=4, warmup_steps=1,
                timed_steps=2)
MEASURED = {"loss_per_step": [6.25, 6.2, 6.1], "step_time_s": [0.05, 0.05], "host_stalled_step_indices": [],
            "shared_device": False}


def row(spec: RunSpec = PLAIN, *, repeat: int = 0, status: Status = Status.OK, started: str,
        measurements: dict | None = None) -> dict:
    ok = status is Status.OK
    return RunResult(spec=spec, status=status, run_id=uuid.uuid4().hex, repeat=repeat,
                     measurements=(measurements or MEASURED) if ok else {}, environment=ENVIRONMENT,
                     message="" if ok else "SIGTERM arrived 3 s into the launch", started_at=started).to_dict()


def write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(autouse=True)
def environment(monkeypatch):
    monkeypatch.setattr(runner, "capture_environment", lambda freeze_dir: {"cpu_model": "test", "cpu_count": 2})


def test_each_launch_counts_by_its_last_row_in_time_whatever_the_order_of_the_file():
    interrupted = row(status=Status.INTERRUPTED, started="2026-01-01T10:00:00+00:00")
    resumed = row(started="2026-01-01T10:05:00+00:00")
    other = row(repeat=1, started="2026-01-01T10:01:00+00:00")
    assert last_rows([interrupted, other, resumed]) == [resumed, other]
    assert last_rows([resumed, other, interrupted]) == [resumed, other]


def test_of_two_rows_started_in_the_same_second_the_later_in_the_file_counts():
    first, second = row(started="2026-01-01T10:00:00+00:00"), row(started="2026-01-01T10:00:00+00:00")
    assert last_rows([first, second]) == [second] and last_rows([second, first]) == [first]


def test_rows_of_two_results_files_are_two_launches(tmp_path):
    write(tmp_path / "a.jsonl", [row(started="2026-01-01T10:00:00+00:00")])
    write(tmp_path / "b.jsonl", [row(started="2026-01-02T10:00:00+00:00")])
    rows = load_rows([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    assert len(last_rows(rows)) == 2
    assert cell_table(rows)["launches"].tolist() == [2]


def test_a_resumed_launch_counts_once_in_the_report(tmp_path):
    out = tmp_path / "rows.jsonl"
    write(out, [row(status=Status.INTERRUPTED, started="2026-01-01T10:00:00+00:00"),
                row(started="2026-01-01T10:05:00+00:00")])
    rows = load_rows([out])
    cells = cell_table(rows)
    assert (cells["launches"].tolist(), cells["ok"].tolist(), cells["status"].tolist()) == ([1], [1], ["ok"])
    assert verdicts(cells, launch_table(rows)).not_run == ["None: every one of the 1 cell ran."]


def test_rows_csv_keeps_every_row_and_marks_the_one_a_later_row_replaced(tmp_path):
    import pandas as pd

    from harness.report.document import write_report

    out = tmp_path / "rows.jsonl"
    write(out, [row(started="2026-01-01T10:05:00+00:00"), row(repeat=1, started="2026-01-01T10:01:00+00:00"),
                row(status=Status.INTERRUPTED, started="2026-01-01T10:00:00+00:00")])
    write_report([out], tmp_path / "report")
    table = pd.read_csv(tmp_path / "report" / "rows.csv")
    assert table[["repeat", "status", "replaced"]].values.tolist() == [[0, "ok", False], [1, "ok", False],
                                                                      [0, "interrupted", True]]
    assert list(table.columns[table.columns.get_loc("status"):][:3]) == ["status", "replaced", "memory_flagged"]


def test_a_resume_runs_again_a_launch_whose_last_row_did_not_end_ok(tmp_path, monkeypatch):
    out = tmp_path / "rows.jsonl"
    write(out, [row(started="2026-01-01T10:00:00+00:00"),
                row(status=Status.FAILED, started="2026-01-01T10:05:00+00:00")])
    launched = []
    monkeypatch.setattr(runner, "build_before_launch", lambda specs, say: None)
    monkeypatch.setattr(runner, "run_cell", lambda spec, *, repeat, **kwargs: launched.append(repeat) or RunResult(
        spec=spec, status=Status.OK, run_id="again", repeat=repeat, measurements=MEASURED,
        environment=kwargs["environment"]))
    results = run_specs([PLAIN], RunOptions(results=out, resume=True))
    assert launched == [0] and [r.run_id for r in results] == ["again"]


# A checkpoint cell's launch, recorded twice: the resume check of one row matches, the other's does not (its update
# at the resumed step is off, as where the optimizer state was not saved; tests/test_checkpoint_resume.py).
PROBE = {"gradient_norm_first_step": 0.6, "parameter_norm_after_first_step": 40.0, "update_norm_first_step": 0.29,
         "gradient_norm_by_tensor_first_step": {"a": 0.3, "b": 0.5},
         "update_norm_by_tensor_first_step": {"a": 0.2, "b": 0.21}}
LOSSES = [6.2514, 6.2437, 6.2329, 6.2138, 6.1923, 6.2083]


def checkpointed(update_norm: float) -> dict:
    return {"loss_per_step": list(LOSSES), "step_time_s": [0.05] * 3, "host_stalled_step_indices": [],
            "shared_device": False, "precision_recipe": "fp32", "gradient_reduce_dtypes": ["float32"],
            "checkpoint_probe": {"step": 2, **PROBE, "update_norm_first_step": update_norm},
            "checkpoint": {"resumed_from_step": 2, "saved_at_world_size": 2},
            "resume_reference": {"world_size": 2, "loss_per_step": list(LOSSES), "probe": {"step": 2, **PROBE}}}


@pytest.mark.parametrize("last_in_time", ["match", "mismatch"])
@pytest.mark.parametrize("last_in_file", ["earlier", "later"])
def test_run_resume_and_the_report_judge_a_launch_by_the_same_row(tmp_path, last_in_time, last_in_file):
    spec = checked(RunSpec(workload="gpt-tiny", strategy="ddp", world_size=2, global_batch=16, micro_batch=4,
                           warmup_steps=3, timed_steps=3, options={"checkpoint": "at:2"}))
    norms = {"match": 0.29, "mismatch": 0.48}
    other = "mismatch" if last_in_time == "match" else "match"
    newer = row(spec, started="2026-01-01T10:05:00+00:00", measurements=checkpointed(norms[last_in_time]))
    older = row(spec, started="2026-01-01T10:00:00+00:00", measurements=checkpointed(norms[other]))
    out = tmp_path / "rows.jsonl"
    write(out, [newer, older] if last_in_file == "earlier" else [older, newer])
    results = run_specs([spec], RunOptions(results=out, resume=True))      # recorded: nothing is launched
    checks = failed_checks([result.to_dict() for result in results], out)
    assert cell_table(load_rows([out]))["resume"].tolist() == [last_in_time]
    assert bool(checks) == (last_in_time == "mismatch")
    assert run_exit_status(results, allow_failed=False, checks_failed=checks) == (
        EXIT_CHECK_FAILED if last_in_time == "mismatch" else 0)
