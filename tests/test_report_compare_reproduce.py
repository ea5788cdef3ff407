"""Reports, the regression gate and reproduction, on rows from real CPU launches."""

import dataclasses
import json
import re

import pandas as pd
import pytest

from harness.cli import main
from harness.matrix import Machine, Selection, build_matrix
from harness.record import append_row, read_results
from harness.runner import RunOptions, run_specs
from harness.spec import DeviceKind


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The plain gpt-tiny cell and DDP at 2 ranks, run twice into two files (a run and its repeat)."""
    folder = tmp_path_factory.mktemp("runs")
    specs = build_matrix("smoke", Machine(device=DeviceKind.CPU, gpus=0, cores=2),
                         Selection(workloads=("gpt-tiny",), overrides=(("timed_steps", 30),)))
    files = []
    for name in ("base", "new"):
        path = folder / f"{name}.jsonl"
        run_specs(specs, RunOptions(results=path, timeout_s=300))
        files.append(path)
    return files


def test_compare_stays_quiet_on_a_repeat_of_the_same_run(two_runs, capsys):
    base, new = two_runs
    assert main(["compare", str(base), str(new)]) == 0
    assert "0 regressions" in capsys.readouterr().out


def test_compare_flags_a_planted_50_percent_slowdown(two_runs, tmp_path, capsys):
    # 50%, well past the 15% threshold: DDP step times on a loaded 2-vCPU VM spread enough that a 20% shift
    # of 20-odd unstalled steps has missed alpha 0.01 (p = 0.017 seen), and this test is about the gate.
    base, _ = two_runs
    slowed = tmp_path / "slowed.jsonl"
    for result in read_results([base]):
        m = dict(result.measurements)
        m["step_time_s"] = [t * 1.5 for t in m["step_time_s"]]
        m["step_time_median_s"] *= 1.5
        append_row(slowed, dataclasses.replace(result, measurements=m))
    assert main(["compare", str(base), str(slowed)]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if line.endswith("regression")]
    assert len(flagged) == 2 and all("step_time_s" in line for line in flagged)
    assert all(re.search(r"\+50\.0%", line) for line in flagged)


def test_reproduce_gives_the_same_losses_bit_for_bit(two_runs, capsys):
    base, _ = two_runs
    original = next(r for r in read_results([base]) if r.spec.strategy == "ddp")
    assert main(["reproduce", original.run_id[:10], "--results", str(base)]) == 0
    assert "losses identical, bit for bit" in capsys.readouterr().out
    again = read_results([base])[-1]
    assert again.spec == original.spec.replace(repeats=1) and again.run_id != original.run_id
    assert again.measurements["loss_per_step"] == original.measurements["loss_per_step"]


def test_report_writes_markdown_html_csv_parquet_matching_the_rows(two_runs, tmp_path, capsys):
    base, new = two_runs
    hostile = tmp_path / "hostile.jsonl"
    for result in read_results([new]):   # a user-controlled string that must not become markup
        environment = {**result.environment, "host": "<script>alert(1)</script>"}
        append_row(hostile, dataclasses.replace(result, environment=environment))
    out = tmp_path / "report"
    assert main(["report", str(base), str(hostile), "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<svg") >= 4
    assert not re.findall(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page)   # nothing fetched
    assert "<link" not in page and "<script" not in page
    rows = pd.read_parquet(out / "rows.parquet")
    recorded = {r.run_id: r.measurements["samples_per_s"] for r in read_results([base, hostile])}
    assert len(rows) == len(pd.read_csv(out / "rows.csv")) == len(recorded) >= 4
    assert dict(zip(rows["run_id"], rows["samples_per_s"])) == recorded
    markdown = (out / "report.md").read_text()
    assert "| gpt-tiny | ddp |" in markdown


def test_a_malformed_line_names_its_file_and_line(tmp_path, capsys):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"spec": {}, "status": "ok"}\n{not json\n')
    for command in (["report", str(broken), "--out", str(tmp_path / "r")], ["compare", str(broken), str(broken)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{broken}:" in err and "Traceback" not in err
