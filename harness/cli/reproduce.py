"""`harness reproduce`: its arguments and `command_reproduce`, which re-runs the cell behind a recorded row where it
ran and appends the new row beside it (harness.reproduce finds the row and compares the two).

    python -m harness reproduce 3f2a9c --results results/smoke.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.cli.arguments import add_timeout_argument
from harness.cli.run import run_placed
from harness.outputs import check_results_file


def add_parser(commands: argparse._SubParsersAction) -> None:
    reproduce = commands.add_parser("reproduce", help="re-run the cell behind a row and append the new row")
    reproduce.set_defaults(handler=command_reproduce)
    reproduce.add_argument("run_id", help="a row's run_id (a unique prefix is enough)")
    reproduce.add_argument("--results", type=Path, nargs="+", help="files to search (default: results/*.jsonl)")
    add_timeout_argument(reproduce, default=900.0, help="seconds before the launch's ranks are killed")


def command_reproduce(args: argparse.Namespace) -> int:
    from harness.environment import capture_environment
    from harness.reproduce import environment_differences, find_row, placement_for, same_losses
    from harness.runner import RunOptions, summary_table
    from harness.strategies import checked

    paths = args.results or sorted(Path("results").glob("*.jsonl"))
    found = find_row(args.run_id, paths)
    check_results_file(found.path, "the results file")   # the new row is appended beside the original
    original = found.result
    placement = placement_for(original)
    for line in environment_differences(original.environment, capture_environment()):
        print(f"parbench: warning: {line}", file=sys.stderr)
    print(f"parbench: reproducing {original.spec.label} (run {original.run_id[:12]}) -> {found.path}",
          file=sys.stderr)
    spec = checked(original.spec.replace(repeats=1))    # its strategy and options as this version knows them
    [again] = run_placed([spec], RunOptions(results=found.path, timeout_s=args.timeout, placement=placement))
    print(summary_table([again.to_dict()], results_file=found.path))
    if again.status.value != "ok":
        return 1
    verdict = "identical, bit for bit" if same_losses(original, again) else "different"
    print(f"\nlosses {verdict}; new row {again.run_id[:12]} appended to {found.path}")
    return 0
