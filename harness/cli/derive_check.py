"""`harness derive-check`: its arguments and `command_derive_check`, which hands them to harness.derive_check (every
derived figure of the committed reference rows, by the base's code and this checkout's).

    python -m harness derive-check --set ci-cpu --out results/derive
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    derive = commands.add_parser("derive-check", help="every derived figure of the committed reference rows, by the "
                                 "base's code and this checkout's, held to results/reference/derive-expectations.json "
                                 "(exit 1 on an unacknowledged change; harness/derive_check.py)")
    derive.set_defaults(handler=command_derive_check)
    derive.add_argument("--base", default="HEAD^1", help="the base: the merge base of this ref and HEAD "
                        "(default HEAD^1)")
    derive.add_argument("--record", action="store_true", help="write this checkout's figures to the expectations file "
                        "instead (review the diff and commit it with the change)")
    derive.add_argument("--set", action="append", dest="sets", metavar="NAME", help="only this reference set "
                        "(repeatable; harness/derive/snapshot.py, REFERENCE_SETS)")
    derive.add_argument("--out", type=Path, help="also write both sides' figures here (head.json, base.json)")


def command_derive_check(args: argparse.Namespace) -> int:
    from harness.derive_check import command

    return command(args.base, record_only=args.record, sets=args.sets, out=args.out)
