"""One `harness run` in the test's process, its rows by cell label: what the matrix tests of a strategy family (moe,
long-context) launch, honestly or with a planted fault (PARBENCH_FAULT, set for the run alone)."""

from __future__ import annotations

from harness.cli import main
from harness.rank.faults import FAULT_ENV
from harness.record import read_rows
from harness.spec import RunSpec


def labelled_run(tmp_path, arguments: list[str], fault: str | None, monkeypatch) -> dict[str, dict]:
    """{label: row} of `harness run ARGUMENTS --out tmp_path/rows.jsonl`, with `fault` planted (None: none)."""
    if fault:
        monkeypatch.setenv(FAULT_ENV, fault)
    else:
        monkeypatch.delenv(FAULT_ENV, raising=False)
    out = tmp_path / "rows.jsonl"
    main(["run", *arguments, "--out", str(out)])
    return {RunSpec.from_dict(row["spec"]).label: row for row in read_rows([out])}
