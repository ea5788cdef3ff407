"""Figures derived from raw rows at read time (harness/derive): hand-computed values, the audit's
findings on scaling references and summary/report agreement, and the package's freedom from torch."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.cli import main
from harness.derive.cells import cell_table
from harness.derive.scaling import scaling_efficiency
from harness.derive.throughput import Basis, launch_throughput

REFERENCE_ROWS = Path(__file__).parent.parent / "results" / "reference" / "ci-cpu" / "smoke.jsonl"


def _row(strategy="ddp", world_size=2, steps=(0.1, 0.2, 1.5, 0.1, 0.2), stalled=(), options=None, cell="c1",
         global_batch=16):
    return {"schema_version": 1, "run_id": f"{cell}-{len(steps)}", "cell_id": cell, "repeat": 0, "status": "ok",
            "message": "",
            "spec": {"workload": "gpt-tiny", "strategy": strategy, "world_size": world_size,
                     "global_batch": global_batch, "micro_batch": 4, "precision": "fp32", "warmup_steps": 1,
                     "timed_steps": len(steps), "seed": 0, "device": "cpu", "nnodes": 1, "options": options or {}},
            "measurements": {"step_time_s": list(steps), "host_stalled_step_indices": list(stalled),
                             "loss_per_step": [6.0, 5.9], "shared_device": False}}


def test_throughput_of_a_launch_by_hand():
    row = _row(stalled=[2])
    every = launch_throughput(row, Basis.ALL_STEPS)
    # median(0.1, 0.2, 1.5, 0.1, 0.2) = 0.2 s -> 16 / 0.2 = 80 samples/s, 40 per device.
    assert math.isclose(every["samples_per_s"], 80.0) and math.isclose(every["samples_per_s_per_device"], 40.0)
    clean = launch_throughput(row, Basis.UNSTALLED)
    # without step 2: median(0.1, 0.2, 0.1, 0.2) = 0.15 s -> 16 / 0.15 = 106.67 samples/s.
    assert math.isclose(clean["samples_per_s"], 16 / 0.15)
    assert math.isclose(clean["samples_per_s_all_steps"], 80.0) and clean["host_stalled_steps"] == 1
    # The step shown beside each throughput is the one it came from (issue 33, finding 5).
    assert math.isclose(clean["step_time_on_basis_s"], 0.15) and math.isclose(every["step_time_on_basis_s"], 0.2)


def test_a_strategy_variant_is_never_merged_into_the_default_s_scaling_reference():
    # Finding 11. ddp at ws1 runs at 100 samples/s, ddp[bucket_cap_mb=1] at ws1 at 50; ddp at ws2 at 180.
    # Against its own ws1 reference ddp scales 180 / (2 x 100) = 0.90. Merging the variant into the
    # reference (median of 100 and 50 = 75, as harness/scaling.py did) gave 180 / (2 x 75) = 1.20.
    common = {"workload": "w", "precision": "fp32", "micro_batch": 4, "device": "cpu", "shared_device": False,
              "global_batch": 16}
    cells = pd.DataFrame([
        {**common, "strategy": "ddp", "options": "", "world_size": 1, "samples_per_s": 100.0},
        {**common, "strategy": "ddp", "options": "bucket_cap_mb=1", "world_size": 1, "samples_per_s": 50.0},
        {**common, "strategy": "ddp", "options": "", "world_size": 2, "samples_per_s": 180.0},
        {**common, "strategy": "ddp", "options": "bucket_cap_mb=1", "world_size": 2, "samples_per_s": 90.0},
        {**common, "strategy": "pipeline", "options": "stages=1", "world_size": 1, "samples_per_s": 80.0},
        {**common, "strategy": "pipeline", "options": "stages=2", "world_size": 2, "samples_per_s": 120.0},
    ])
    out = scaling_efficiency(cells).set_index(["strategy", "options", "world_size"])
    assert math.isclose(out.loc[("ddp", "", 2), "strong_efficiency_vs_ws1"], 0.90)
    assert math.isclose(out.loc[("ddp", "bucket_cap_mb=1", 2), "strong_efficiency_vs_ws1"], 90 / (2 * 50))
    # A pipeline's stage count follows the world size by construction: 120 / (2 x 80) = 0.75.
    assert math.isclose(out.loc[("pipeline", "stages=2", 2), "strong_efficiency_vs_ws1"], 0.75)


def test_a_cell_without_a_reference_draws_no_bar(monkeypatch):
    # Finding 11: NaN efficiencies were drawn as zero-height bars, which read as an efficiency of 0.
    from harness.report import plots

    figures = []
    monkeypatch.setattr(plots, "svg", lambda figure: figures.append(figure) or "<svg/>")
    summary = pd.DataFrame([
        {"workload": "w", "strategy": "ddp", "options": "", "world_size": 2, "status": "ok", "shared_device": False,
         "samples_per_s": 10.0, "strong_efficiency_vs_ws1": 0.9, "strong_efficiency_vs_plain": float("nan")},
        {"workload": "w", "strategy": "zero2", "options": "", "world_size": 2, "status": "ok",
         "shared_device": False, "samples_per_s": 10.0, "strong_efficiency_vs_ws1": float("nan"),
         "strong_efficiency_vs_plain": 0.8}])
    assert plots.plot_efficiency(summary, "w") == "<svg/>"
    heights = sorted(round(bar.get_height(), 6) for bar in figures[0].axes[0].patches)
    assert heights == [0.8, 0.9]
    assert sum(text.get_text() == "n/a" for text in figures[0].axes[0].texts) == 2


def test_the_console_summary_and_the_report_show_the_same_throughput(tmp_path, capsys):
    # Finding 14: the summary used every step and the report the unstalled ones. Here the ddp launch has a
    # stalled step: on the table's basis (unstalled) its throughput is 16 / median(0.1, 0.2, 0.1, 0.2) =
    # 106.7 samples/s, and the plain one's 16 / median(0.2, 0.2, 0.2) = 80.
    from harness.runner import summary_table

    rows = [_row("plain", 1, steps=(0.2, 0.2, 0.2), cell="p"), _row(stalled=[2])]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summary_table(rows)
    assert main(["report", str(path), "--out", str(tmp_path / "report")]) == 0
    markdown = (tmp_path / "report" / "report.md").read_text()
    ddp_line = next(line for line in summary.splitlines() if line.startswith("gpt-tiny/ddp"))
    assert " 106.7 " in ddp_line
    assert "| gpt-tiny | ddp |" in markdown and "| 107 |" in markdown
    assert cell_table(rows).set_index("strategy").loc["ddp", "samples_per_s"] == pytest.approx(16 / 0.15)


def test_the_committed_reference_rows_still_report():
    # Rows written by schema 1 (results/reference/ci-cpu/smoke.jsonl, as committed) read and derive.
    rows = [json.loads(line) for line in REFERENCE_ROWS.read_text().splitlines()]
    assert {row["schema_version"] for row in rows} == {1}
    cells = cell_table(rows).set_index("strategy")
    plain = rows[0]["measurements"]
    unstalled = [t for i, t in enumerate(plain["step_time_s"]) if i not in plain["host_stalled_step_indices"]]
    assert cells.loc["plain", "samples_per_s"] == pytest.approx(16 / sorted(unstalled)[len(unstalled) // 2])


def test_every_console_line_shows_the_step_its_samples_per_s_came_from():
    # Issue 33, finding 5: "step ms" was the median of every step and samples/s that of the unstalled ones
    # (the committed smoke rows: plain 46.1 ms beside 400.6 samples/s, where 16 / 46.1 ms = 347). Each
    # line's step, by hand from the raw rows: the host stalled steps of both launches, so the table's
    # basis is the unstalled steps, and both figures must come from them.
    from harness.runner import summary_table

    rows = [json.loads(line) for line in REFERENCE_ROWS.read_text().splitlines()]
    by_hand = {}
    for row in rows:
        m = row["measurements"]
        unstalled = sorted(t for i, t in enumerate(m["step_time_s"]) if i not in m["host_stalled_step_indices"])
        assert 0 < len(unstalled) < len(m["step_time_s"])
        middle = len(unstalled) // 2
        by_hand[row["spec"]["strategy"]] = (unstalled[middle] if len(unstalled) % 2
                                            else (unstalled[middle - 1] + unstalled[middle]) / 2)
    lines = [line for line in summary_table(rows).splitlines() if line.startswith("gpt-tiny/")]
    assert len(lines) == 2
    for line in lines:
        label, status, step_ms, samples = line.split()[:4]
        global_batch = int(label.split("/gb")[1].split("/")[0])
        assert float(step_ms) == pytest.approx(by_hand[label.split("/")[1]] * 1e3, abs=0.05)
        # global batch / step = samples/s, to the printed rounding of the step (0.05 ms).
        assert global_batch / (float(step_ms) / 1e3) == pytest.approx(float(samples), rel=0.05 / float(step_ms))


def test_the_report_table_shows_the_step_its_samples_per_s_came_from(tmp_path):
    # The same for the report's cell table: "step ms" on the basis, the raw median beside it only where the
    # basis is the unstalled steps. The ddp launch stalled its step 2: 16 / median(0.1, 0.2, 0.1, 0.2) =
    # 106.7 samples/s from a 150 ms step; its raw median over every step is 200 ms.
    from harness.report.table import tables

    [table] = tables(cell_table([_row("plain", 1, steps=(0.2, 0.2, 0.2), cell="p"), _row(stalled=[2])]))
    ddp = dict(zip(table.titles, table.rows[1]))
    assert (ddp["step ms"], ddp["samples/s"], ddp["step ms, all steps"]) == ("150", "107", "200")


@pytest.mark.launch
def test_the_derive_package_imports_neither_torch_nor_the_registries():
    modules = [f"harness.derive.{p.stem}" for p in (Path(__file__).parent.parent / "harness" / "derive").glob("*.py")]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "heavy = [m for m in ('torch', 'deepspeed', 'horovod', 'harness.strategies', 'workloads') "
              "if m in sys.modules]\nassert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_a_cell_without_an_ok_launch_is_summarised_with_its_status(capsys):
    # `make run` on CPU records DataParallel as skipped: the summary must show it, not fail on an interval
    # of no launches.
    from harness.runner import summary_table

    skipped = {**_row("dataparallel", 2, cell="dp"), "status": "skipped", "measurements": {},
               "message": "DataParallel replicates over CUDA devices only"}
    table = summary_table([_row("plain", 1, steps=(0.2, 0.2, 0.2), cell="p"), skipped])
    line = next(x for x in table.splitlines() if "/dataparallel/" in x)
    assert "skipped" in line and "CUDA devices only" in line


def _loaded(row, ranks_on_host, threads, cores):
    row["measurements"].update({"ranks_on_host_by_rank": ranks_on_host, "threads_by_rank": threads,
                                "host_cpu_cores_by_rank": cores})
    return row


@pytest.mark.parametrize("ranks_on_host, threads, cores, oversubscribed, text", [
    ([2, 2], [1, 1], [1, 1], True, "oversubscribed: 2 ranks x 1 thread on 1 core"),     # 2 threads, 1 core
    ([2, 2], [1, 1], [2, 2], False, "2 ranks x 1 thread on 2 cores"),                    # one core each
    ([2, 2], [2, 2], [2, 2], True, "oversubscribed: 2 ranks x 2 threads on 2 cores"),    # threads count too
    # two hosts: ranks 0 and 1 alone on 8 cores, rank 2 with 2 threads on a 1-core host: the second host
    ([2, 2, 1], [2, 2, 2], [8, 8, 1], True, "oversubscribed: 1 rank x 2 threads on 1 core"),
])
def test_a_launch_whose_ranks_outnumber_its_host_cores_is_marked(ranks_on_host, threads, cores, oversubscribed,
                                                                 text):
    from harness.derive.hosts import host_load

    row = _loaded(_row(world_size=len(threads)), ranks_on_host, threads, cores)
    assert host_load(row["measurements"]) == {"host_oversubscribed": oversubscribed, "host_load": text}


def test_rows_that_did_not_record_their_host_load_are_not_called_unshared():
    from harness.derive.hosts import host_load

    assert host_load(_row()["measurements"]) == {"host_oversubscribed": None, "host_load": None}
    cells = cell_table([_row()])
    assert cells.loc[0, "host_oversubscribed"] is None and cells.loc[0, "host_load"] is None


def test_the_summary_and_the_report_mark_an_oversubscribed_cell(tmp_path):
    from harness.runner import summary_table

    rows = [_loaded(_row("plain", 1, steps=(0.2, 0.2, 0.2), cell="p"), [1], [1], [1]),
            _loaded(_row(cell="d"), [2, 2], [1, 1], [1, 1])]
    table = summary_table(rows)
    plain = next(line for line in table.splitlines() if line.startswith("gpt-tiny/plain"))
    ddp = next(line for line in table.splitlines() if line.startswith("gpt-tiny/ddp"))
    assert ddp.endswith("  oversubscribed: 2 ranks x 1 thread on 1 core") and "oversubscribed" not in plain
    assert table.splitlines()[-1].startswith("(oversubscribed: a host ran more rank threads than it has cores")
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(path), "--out", str(tmp_path / "report")]) == 0
    markdown = (tmp_path / "report" / "report.md").read_text()
    ddp_row = next(line for line in markdown.splitlines() if line.startswith("| gpt-tiny | ddp |"))
    assert "| oversubscribed: 2 ranks x 1 thread on 1 core |" in ddp_row
    assert "| 1 rank x 1 thread on 1 core |" in next(line for line in markdown.splitlines()
                                                     if line.startswith("| gpt-tiny | plain |"))


def test_a_one_launch_cell_beside_a_five_launch_one_shows_no_interval_rather_than_nan():
    # Issue 61: in a table beside a cell of five launches, a one-launch cell's missing interval became NaN and
    # the console printed "nan-nan ()".
    from harness.runner import summary_table

    five = [{**_row("plain", 1, steps=(0.2, 0.21, 0.2), cell="p"), "run_id": f"p-{n}", "repeat": n} for n in range(5)]
    summary = summary_table([*five, _row()])
    ddp_line = next(line for line in summary.splitlines() if line.startswith("gpt-tiny/ddp"))
    plain_line = next(line for line in summary.splitlines() if line.startswith("gpt-tiny/plain"))
    assert "nan" not in summary and ddp_line.endswith("1 launch"), ddp_line
    assert re.search(r"\d+-\d+ \(.+\)$", plain_line), plain_line
