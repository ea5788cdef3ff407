"""`harness expect`: its arguments and `command_expect`, which holds a run's machine-independent figures to
committed expectations or records them (harness.derive.expectations).

    python -m harness expect results/ci.jsonl --against results/reference/ci-expectations/ci.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.outputs import check_folder
from harness.record import read_rows
from harness.spec import SpecError


def add_parser(commands: argparse._SubParsersAction) -> None:
    expect = commands.add_parser("expect", help="hold the figures that do not depend on the machine to committed "
                                 "expectations (exit 1 on a difference, 3 if recorded under other versions)")
    expect.set_defaults(handler=command_expect)
    expect.add_argument("results", type=Path, nargs="+", help="results JSONL files of one run")
    expect.add_argument("--against", type=Path, required=True, help="the expectations file (JSON), e.g. "
                        "results/reference/ci-expectations/ci.json")
    expect.add_argument("--write", action="store_true", help="record the rows' figures as the expectations "
                        "instead of checking them (review the diff before committing it)")


def command_expect(args: argparse.Namespace) -> int:
    from harness.derive.expectations import ExpectationsError, check, dumps, load, record

    rows = []
    for path in args.results:   # "0 figures", exit 0, would pass a run that measured nothing
        found = read_rows([path])
        if not found:
            raise SpecError(f"{path} holds no cell rows: nothing to hold to expectations")
        rows.extend(found)
    try:
        if args.write:
            if args.against.is_dir():
                raise SpecError(f"--against {args.against} is a folder; expected the expectations file (.json)")
            check_folder(args.against.parent, "--against", shown=args.against)
            expectations = record(rows)
            args.against.write_text(dumps(expectations))
            print(f"recorded {len(expectations['cells'])} cells' figures in {args.against}: review the diff")
            return 0
        outcome = check(rows, load(args.against))
    except ExpectationsError as error:
        raise SpecError(str(error)) from None
    update = f"python -m harness expect {' '.join(str(path) for path in args.results)} --against {args.against} --write"
    print("\n".join(outcome.lines(update)))
    return outcome.exit_status
