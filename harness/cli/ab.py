"""`harness ab`: its arguments and `command_ab`, the same-job A/B of the base commit against this checkout
(harness.ab), with the exit status of a run that judged nothing.

    python -m harness ab --strategy ddp --launches 3
"""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

from harness.cli.arguments import _csv, add_threshold_argument
from harness.cli.compare import EXIT_NOTHING_JUDGED, nothing_judged, nothing_judged_status
from harness.matrix import MATRICES
from harness.spec import SpecError


def add_parser(commands: argparse._SubParsersAction) -> None:
    ab = commands.add_parser("ab", help="same-job A/B: the base commit and this checkout, launches in turns, "
                             "judged on step time and peak memory (exit 1 on a regression)")
    ab.set_defaults(handler=command_ab)
    ab.add_argument("--base", default="HEAD^1", help="the base: the merge base of this ref and HEAD (default "
                    "HEAD^1, the previous main)")
    ab.add_argument("--a-a", action="store_true", help="base = HEAD: every regression is a false alarm")
    ab.add_argument("--repeat", type=int, default=1, help="run the tier N times and tally them (default 1)")
    ab.add_argument("--strategy", type=_csv, help="the cells' strategies, comma-separated (default: DDP and each "
                    "strategy the change touches, as many as the tier's budget holds; harness/ab.py, select_cells)")
    ab.add_argument("--launches", type=int, help="launches a side at least (default 8, harness/ab.py's AB_LAUNCHES, "
                    "fewer where the budget holds more touched cells; "
                    "3 at the least, and more where the gate needs them for the family)")
    add_threshold_argument(ab, help="as for compare (default: the tier's measured step-time threshold, harness/ab.py)")
    ab.add_argument("--plant-new", default="", metavar="FAULT", help="PARBENCH_FAULT for the new side's launches "
                    "alone, e.g. slow-step:factor=1.3:rank=all:step=0:strategy=ddp")
    ab.add_argument("--matrix", default="smoke", help=f"one of: {', '.join(MATRICES)} (default smoke)")
    ab.add_argument("--out", type=Path, help="folder for both sides' rows and launch logs (default results/ab-<time>)")
    ab.add_argument("--budget-cap", type=float, metavar="SECONDS", help="hold the tier's own choice of cells to at most "
                    "this many seconds of launches (default: its own budgets, 620 s, up to 1,000 where a strategy's "
                    "own code changed; harness/ab.py)")
    ab.add_argument("--print-budget", action="store_true", help="print the seconds of launch time the tier's own "
                    "choice of cells for this change is held to (0 where it would judge nothing), and launch nothing: "
                    ".ci/run leaves the tier that much")
    ab.add_argument("--allow-unjudged", action="store_true", help=f"exit 0 where the tier judged nothing (a shallow "
                    f"clone, a base that does not launch; default: exit {EXIT_NOTHING_JUDGED}, saying why)")


def command_ab(args: argparse.Namespace) -> int:
    from harness import ab
    from harness.environment import PROJECT_ROOT

    if args.matrix not in MATRICES:
        raise SpecError(f"--matrix {args.matrix!r}: known: {', '.join(MATRICES)}")
    if args.budget_cap is not None and not args.budget_cap > 0:
        raise SpecError(f"--budget-cap {args.budget_cap:g}: a number of seconds above 0 is allowed")
    if args.print_budget:
        print(f"{ab.planned_budget(PROJECT_ROOT, args.base, args.budget_cap):.0f}")
        return 0
    out = args.out or Path("results") / f"ab-{datetime.now():%Y%m%d-%H%M%S}"
    try:
        results = ab.measure(PROJECT_ROOT, out, base_ref=args.base, a_a=args.a_a, repeat=args.repeat,
                             min_launches=args.launches, thresholds=dict(args.threshold), plant_new=args.plant_new,
                             matrix=args.matrix, strategies=args.strategy, budget_cap_s=args.budget_cap)
    except ab.Unavailable as why:
        print(f"A/B run: {ab.Outcome.SKIPPED.value}: {why}")
        return nothing_judged_status(f"nothing judged: {why}", allow=args.allow_unjudged)
    worst = max(result.exit_status for result in results)
    # A run whose gate judged no metric at all (its base failed to launch, no cell on both sides); one that judged
    # some and left others has its verdict on those.
    empty = [result for result in results if result.gate is None or nothing_judged(result.gate)]
    if worst == 0 and empty:
        return nothing_judged_status(f"nothing judged in {len(empty)} of {len(results)} runs: {empty[0].reason}",
                                     allow=args.allow_unjudged)
    return worst
