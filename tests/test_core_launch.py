"""The one launch `make test` makes: each launcher starts real ranks end to end, once, in about a minute.

`make test` (the README's test command) is the unit tier and this: the plain loop, then DDP under torchrun, ZeRO-2
under DeepSpeed's launcher and Horovod under horovodrun at 2 ranks on gpt-tiny, as a user's `harness run` would,
then `harness report`. Every other launch test runs in CI's launch tier, a budget of them a commit (tests/launch_budget.py),
and all of them under `make test-launch`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.derive.parity import Verdict, judge
from harness.record import read_rows

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ("ddp", "zero2", "horovod")      # torchrun, DeepSpeed's launcher, horovodrun
LAUNCHED = ("plain", *STRATEGIES)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(exit status, console, rows, report.md) of one `harness run` of the four cells and `harness report` of them."""
    out = tmp_path_factory.mktemp("core") / "rows.jsonl"
    done = subprocess.run([sys.executable, "-m", "harness", "run", "--matrix", "full", "--device", "cpu",
                           "--workload", "gpt-tiny", "--world-sizes", "2", "--strategy", ",".join(LAUNCHED),
                           "--precision", "fp32", "--warmup-steps", "2", "--timed-steps", "3", "--repeats", "1",
                           "--timeout", "300", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    console = done.stdout + done.stderr
    if done.returncode == 0:
        report = subprocess.run([sys.executable, "-m", "harness", "report", str(out), "--out", str(out.parent / "report")],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        console += report.stdout + report.stderr
    return done.returncode, console, read_rows([out]) if out.exists() else [], out.parent / "report" / "report.md"


@pytest.mark.launch
@pytest.mark.core
def test_each_launcher_trains_real_ranks_that_match_the_plain_loop(launched):
    status, console, rows, _ = launched
    assert status == 0, console[-3000:]
    by_strategy = {row["spec"]["strategy"]: row for row in rows}
    assert sorted(by_strategy) == sorted(LAUNCHED), console[-3000:]
    assert all(row["status"] == "ok" for row in rows), [row.get("message") for row in rows]
    assert {by_strategy[s]["spec"]["world_size"] for s in STRATEGIES} == {2}
    verdicts = {row["spec"]["strategy"]: verdict for row, verdict in zip(rows, judge(rows))}
    assert {s: verdicts[s].verdict for s in STRATEGIES} == {s: Verdict.MATCH for s in STRATEGIES}


@pytest.mark.launch
@pytest.mark.core
def test_the_run_ends_in_a_report_that_names_every_cell(launched):
    status, console, _, report = launched
    assert status == 0 and report.exists(), console[-3000:]
    text = report.read_text()
    assert "Loss parity against the plain loop, 4 cells: 1 reference, 3 match." in text
    for strategy in LAUNCHED:
        assert f"| gpt-tiny | {strategy} | " in text
