"""`harness compare`: its arguments, `command_compare` (the regression gate of harness.compare over two results
files) and the "nothing judged" status that `compare` and `ab` share.

    python -m harness compare results/base.jsonl results/new.jsonl --metric step_time_unstalled_median_s
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.cli.arguments import add_threshold_argument
from harness.record import read_rows
from harness.spec import SpecError

# `compare`'s and `ab`'s exit status where nothing could be judged: "0 metrics judged" is not a pass.
EXIT_NOTHING_JUDGED = 6


def add_parser(commands: argparse._SubParsersAction) -> None:
    compare = commands.add_parser("compare", help="flag regressions between two results files (exit 1 if any)")
    compare.set_defaults(handler=command_compare)
    compare.add_argument("base", type=Path)
    compare.add_argument("new", type=Path)
    add_threshold_argument(compare, help="override the measured thresholds: X for every metric, METRIC=X for one "
                           "(relative, e.g. 0.2; exposed_comm_share in share points, 0.05 = 5 points); repeatable")
    compare.add_argument("--alpha", type=float, default=0.05, help="largest chance that a comparison of "
                         "unchanged software names any regression (Holm over its metrics); with their number "
                         "it sets the launches needed (0.05: 3 a side for 1 metric, 5 for up to 12)")
    compare.add_argument("--metric", action="append", default=[], metavar="METRIC", help="judge only this metric "
                         "(repeatable; default: every one): a smaller family needs fewer launches a side")
    compare.add_argument("--all", action="store_true", help="also list unchanged metrics")
    compare.add_argument("--allow-unjudged", action="store_true", help=f"exit 0 where nothing could be judged "
                         f"(default: exit {EXIT_NOTHING_JUDGED}, saying why)")


def command_compare(args: argparse.Namespace) -> int:
    from harness.compare import compare_files, format_result
    from harness.derive.gate import check_metrics, check_thresholds

    if not 0 < args.alpha < 1:
        raise SpecError(f"--alpha must be in (0, 1), got {args.alpha}")
    try:
        thresholds = check_thresholds(dict(args.threshold))
    except ValueError as error:
        raise SpecError(f"--threshold: {error}") from None
    try:
        check_metrics(args.metric)
    except ValueError as error:
        raise SpecError(f"--metric: {error}") from None
    for path in (args.base, args.new):   # "0 metrics judged", exit 0, would pass a run that measured nothing
        if not read_rows([path]):
            raise SpecError(f"{path} holds no cell rows: nothing to compare")
    result = compare_files(args.base, args.new, thresholds, args.alpha, args.metric)
    print(format_result(result, show_all=args.all))
    if result.regressed:
        return 1
    return nothing_judged_status(nothing_judged(result), allow=args.allow_unjudged)


def nothing_judged(result) -> str:
    """Why a gate result judged no metric, with the launches a side that would judge them; "" where it judged one."""
    from harness.derive.gate import Verdict

    if result.judgements and result.count(Verdict.NOT_JUDGED) < len(result.judgements):
        return ""
    launches = sorted({(len(j.base), len(j.new)) for j in result.judgements})
    had = ", ".join(f"{base} v {new}" for base, new in launches) or "none"
    return (f"nothing judged: {len(result.judgements)} metrics with too few launches (had {had}; "
            f"{result.launches_needed_a_side} a side judge this family of {result.family}), "
            f"{len(result.not_compared)} cells not compared (no ok launch, or not in both files)")


def nothing_judged_status(why: str, *, allow: bool) -> int:
    """0 where something was judged; else one line saying why and EXIT_NOTHING_JUDGED (0 where `allow`)."""
    if not why:
        return 0
    status = 0 if allow else EXIT_NOTHING_JUDGED
    print(f"parbench: {why}; exit {status}" + ("" if allow else " (--allow-unjudged: exit 0)"), file=sys.stderr)
    return status
