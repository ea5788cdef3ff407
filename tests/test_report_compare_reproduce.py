"""Reports, the regression gate and reproduction, on rows from real CPU launches."""

import dataclasses
import json
import re
import statistics
import uuid

import pandas as pd
import pytest

from harness.cli import main
from harness.matrix import Machine, Selection, build_matrix
from harness.record import append_row, read_results
from harness.runner import RunOptions, run_specs
from harness.spec import DeviceKind


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two files holding the same two real launches, the plain gpt-tiny cell and DDP at 2 ranks: the run in
    base.jsonl, and in new.jsonl under new run ids, as a second run of the same cells records them. What is
    judged of them (1 vs 1 launches, a report of both files) asks nothing of a second launch's own noise.
    Thirty timed steps, so that a host stall (harness.rank.timing) cannot take every step of a launch."""
    folder = tmp_path_factory.mktemp("runs")
    specs = build_matrix("smoke", Machine(device=DeviceKind.CPU, devices_per_node=2),
                         Selection(workloads=("gpt-tiny",), overrides=(("timed_steps", 30),)))
    base, new = folder / "base.jsonl", folder / "new.jsonl"
    for result in run_specs(specs, RunOptions(results=base, timeout_s=300)):
        append_row(new, dataclasses.replace(result, run_id=uuid.uuid4().hex))
    return [base, new]


@pytest.mark.launch
def test_compare_judges_nothing_from_one_launch_a_side_and_says_so(two_runs, capsys):
    # One launch per cell a side: 1 vs 1 launches fire the rule by chance half the time (1 / C(2, 1)), so
    # nothing is judged, whatever the launches hold; every metric is named with why.
    base, new = two_runs
    assert main(["compare", str(base), str(new)]) == 6            # nothing judged: its own status, not a pass
    captured = capsys.readouterr()
    assert "parbench: nothing judged: 5 metrics with too few launches (had 1 v 1; 5 a side" in captured.err
    lines = captured.out.splitlines()
    named = [line for line in lines if "not judged: 1 vs 1 launches" in line]
    # plain: step time, peak RSS; DDP: those and the exposed communication share.
    assert len(named) == 5
    assert lines[-2] == "0 metrics judged: 0 regressions, 0 improvements, 0 same; 5 not judged; 0 cells not compared"
    assert lines[-1] == ("chance of any false regression <= 0.05 over a family of 5 metrics (Holm): "
                         "5 launches a side judge each")


def _as_launches(results, factor: float = 1.0, memory: float = 1.0):
    """Five launches per cell from each real row, 1% to 5% slower, all times scaled by `factor` and every
    peak resident memory figure by `memory`. Five a side: the two cells' 5 metrics are one family, and
    1 / C(10, 5) = 1/252 <= 0.05 / 5 (harness/derive/gate.py)."""
    for result in results:
        for repeat, spread in enumerate((1.01, 1.02, 1.03, 1.04, 1.05)):
            m = dict(result.measurements)
            m["step_time_s"] = [t * spread * factor for t in m["step_time_s"]]
            m["peak_rss_bytes_by_rank"] = [b * memory for b in m["peak_rss_bytes_by_rank"]]
            yield dataclasses.replace(result, measurements=m, repeat=repeat, run_id=f"{result.run_id}-{repeat}")


@pytest.mark.launch
@pytest.mark.parametrize("planted, metric, separation", [
    # Each side's launches lie within 1.05 / 1.01 - 1 = 4% of each other; 1.3 times slower, the closest
    # launches are 1.3 x 1.01 / 1.05 - 1 = 25.0% apart, beyond the 15% CPU default.
    ({"factor": 1.3}, "step_time", r"\+25\.0%"),
    # Peak RSS is the same in the three copies of a row: 1.3 times larger is 30.0% apart, beyond 2%.
    ({"memory": 1.3}, "peak_rss", r"\+30\.0%")])
def test_compare_flags_a_planted_30_percent_regression_at_five_launches(two_runs, tmp_path, capsys, planted,
                                                                          metric, separation):
    base, _ = two_runs
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    for row in _as_launches(read_results([base])):
        append_row(before, row)
    for row in _as_launches(read_results([base]), **planted):
        append_row(after, row)
    assert main(["compare", str(before), str(after)]) == 1
    out = capsys.readouterr().out
    # The plain and the DDP cell. (Slower real steps over an unchanged compute-only baseline also raise
    # DDP's exposed share, which may be flagged beside them.)
    flagged = [line for line in out.splitlines() if line.endswith("regression") and metric in line]
    assert len(flagged) == 2 and all(re.search(separation, line) for line in flagged)


@pytest.mark.launch
def test_reproduce_gives_the_same_losses_bit_for_bit(two_runs, capsys):
    base, _ = two_runs
    original = next(r for r in read_results([base]) if r.spec.strategy == "ddp")
    assert main(["reproduce", original.run_id[:10], "--results", str(base)]) == 0
    assert "losses identical, bit for bit" in capsys.readouterr().out
    again = read_results([base])[-1]
    assert again.spec == original.spec.replace(repeats=1) and again.run_id != original.run_id
    assert again.measurements["loss_per_step"] == original.measurements["loss_per_step"]


@pytest.mark.launch
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
    # Throughput over every timed step, by hand from the raw rows: global batch / median step time.
    by_hand = {r.run_id: r.spec.global_batch / statistics.median(r.measurements["step_time_s"])
               for r in read_results([base, hostile])}
    assert len(rows) == len(pd.read_csv(out / "rows.csv")) == len(by_hand) >= 4
    assert dict(zip(rows["run_id"], rows["samples_per_s_all_steps"])) == pytest.approx(by_hand)
    markdown = (out / "report.md").read_text()
    assert "| gpt-tiny | ddp |" in markdown


def test_a_malformed_line_names_its_file_and_line(tmp_path, capsys):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"spec": {}, "status": "ok"}\n{not json\n')
    for command in (["report", str(broken), "--out", str(tmp_path / "r")], ["compare", str(broken), str(broken)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{broken}:" in err and "Traceback" not in err
