"""Compile figures where a reader sees them (harness.derive.compiled): rows.csv, the report's cell table and a
verdict line, from rows whose ranks recorded them (harness.strategies.compiling.compile_figures)."""

import csv
import json

from harness.cli import main
from tests.test_derive import _row


def _compiled(row, seconds, frames, breaks, recompiles):
    row["spec"]["options"] = {"compile": True}
    row["measurements"].update({"compiled": True, "compile_seconds_by_rank": seconds,
                                "compiled_frames_by_rank": frames, "graph_breaks_by_rank": breaks,
                                "recompiles_in_timed_steps_by_rank": recompiles,
                                "compile_cache_hits_by_rank": [0] * len(seconds)})
    return row


def test_a_compiled_run_s_report_and_rows_csv_show_compile_seconds_graph_breaks_and_recompiles(tmp_path):
    # Issue 61: compiled ZeRO-3 (108 frames, 34 graph breaks on llama-tiny) looked like FSDP2 (1 frame, 0) in every
    # document. A launch shows its slowest rank's seconds and its largest counts: ZeRO-3's ranks below give
    # max(21.0, 20.5) = 21.0 s, max(112, 110) = 112 frames, max(36, 34) = 36 breaks, max(0, 2) = 2 recompiles.
    rows = [_row("plain", 1, cell="p"),
            _compiled(_row("zero3", cell="z"), [21.0, 20.5], [112, 110], [36, 34], [0, 2]),
            _compiled(_row("ddp", cell="d"), [1.25, 1.5], [1, 1], [0, 0], [0, 0])]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["report", str(source), "--out", str(tmp_path / "report")]) == 0
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert ("- zero3[compile=True] compiled in 21.0 s before its timed steps (112 frames, 36 graph breaks); its timed "
            "steps recompiled 2 frames: their step times include compiling.") in markdown
    assert ("- ddp[compile=True] compiled in 1.5 s before its timed steps (1 frame, 0 graph breaks); its timed steps "
            "recompiled nothing.") in markdown
    assert "- plain compiled" not in markdown
    header = next(line for line in markdown.splitlines() if line.startswith("| workload |"))
    titles = [title.strip() for title in header.strip("|").split("|")]
    zero3 = next(line for line in markdown.splitlines() if line.startswith("| gpt-tiny | zero3"))
    cells = dict(zip(titles, (cell.strip() for cell in zero3.strip("|").split("|"))))
    assert (cells["compile s"], cells["graph breaks"], cells["recompiles in timed steps"]) == ("21", "36", "2")
    with (tmp_path / "report" / "rows.csv").open() as handle:
        by_strategy = {line["strategy"]: line for line in csv.DictReader(handle)}
    zero3, ddp = ({key: float(by_strategy[name][key]) for key in ("compile_seconds", "compiled_frames", "graph_breaks",
                                                                  "recompiles_in_timed_steps")} for name in ("zero3", "ddp"))
    assert zero3 == {"compile_seconds": 21.0, "compiled_frames": 112, "graph_breaks": 36, "recompiles_in_timed_steps": 2}
    assert ddp == {"compile_seconds": 1.5, "compiled_frames": 1, "graph_breaks": 0, "recompiles_in_timed_steps": 0}
    assert by_strategy["plain"]["compile_seconds"] == ""
