"""`harness report`: its arguments and `command_report`, which refuses a results file with nothing to report and
hands the rest to harness.report.write_report.

    python -m harness report results/reference/ci-cpu/smoke.jsonl --out report/
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.outputs import check_folder
from harness.record import COMMBENCH_KIND, read_rows
from harness.spec import SpecError


def add_parser(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser("report", help="Markdown + self-contained HTML report, CSV and Parquet")
    report.set_defaults(handler=command_report)
    report.add_argument("results", type=Path, nargs="+", help="results JSONL files (cell and comm rows)")
    report.add_argument("--out", type=Path, default=Path("report"), help="output folder (default: report/)")


def command_report(args: argparse.Namespace) -> int:
    from harness.report import write_report

    for path in args.results:   # an empty report, exit 0, would pass for a run that measured nothing
        if not read_rows([path]) and not read_rows([path], kind=COMMBENCH_KIND):
            raise SpecError(f"{path} holds no cell rows and no `harness comm` rows: nothing to report")
    check_folder(args.out, "--out")
    written = write_report(args.results, args.out)
    for path in written:
        print(path)
    return 0
