"""Command line: a thin adapter over the harness's plain functions.

    python -m harness run --matrix full
    python -m harness run --matrix smoke --strategy ddp --world-sizes 2 --global-batch 32
    python -m harness list

Bad input ends with one line `parbench: error: ...` and exit status 2, before any process is launched.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path
from typing import Sequence

from harness.matrix import MATRICES, Machine, Selection, build_matrix
from harness.record import ResultsError
from harness.spec import RunSpec, SpecError


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _int_csv(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None


def _option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    if lowered in ("none", "null"):
        return key, None
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (no usage dump) so they read like the harness's own."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SpecError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m harness", description="parbench: distributed training strategies, "
                     "benchmarked on identical workloads.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run a matrix of cells and append their rows")
    run.add_argument("--matrix", default="smoke", help=f"one of: {', '.join(MATRICES)}")
    run.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when a GPU is visible")
    run.add_argument("--workload", type=_csv, help="comma-separated workloads to keep")
    run.add_argument("--strategy", type=_csv, help="comma-separated strategies to keep")
    run.add_argument("--world-sizes", type=_int_csv, help="comma-separated world sizes")
    run.add_argument("--repeats", type=int, help="launches per cell")
    run.add_argument("--global-batch", type=int, help="samples per optimizer step (overrides the matrix)")
    run.add_argument("--micro-batch", type=int, help="samples per forward pass per rank (overrides)")
    run.add_argument("--precision", help="fp32 or bf16 (overrides)")
    run.add_argument("--warmup-steps", type=int)
    run.add_argument("--timed-steps", type=int)
    run.add_argument("--seed", type=int)
    run.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                     help="strategy option for every selected cell (repeatable)")
    run.add_argument("--out", type=Path, help="results JSONL (default: results/<matrix>-<time>.jsonl)")
    run.add_argument("--timeout", type=float, default=900.0, help="seconds per launch before its ranks are killed")
    run.add_argument("--dry-run", action="store_true", help="print the cells and exit")

    commands.add_parser("list", help="matrices, workloads and strategies")
    return parser


def plan_run(args: argparse.Namespace) -> list[RunSpec]:
    """The validated cells a `run` invocation asks for; raises SpecError before anything launches."""
    machine = Machine.detect(args.device)
    overrides = tuple((name, getattr(args, name)) for name in
                      ("global_batch", "micro_batch", "precision", "warmup_steps", "timed_steps", "seed")
                      if getattr(args, name) is not None)
    select = Selection(workloads=args.workload, strategies=args.strategy, world_sizes=args.world_sizes,
                       repeats=args.repeats, overrides=overrides, options=tuple(args.option))
    return build_matrix(args.matrix, machine, select)


def command_run(args: argparse.Namespace) -> int:
    from harness.runner import RunOptions, run_specs, summary_table

    specs = plan_run(args)
    if args.dry_run:
        for spec in specs:
            print(spec.label, f"x{spec.repeats}")
        return 0
    out = args.out or Path("results") / f"{args.matrix}-{datetime.now():%Y%m%d-%H%M%S}.jsonl"
    launches = sum(spec.repeats for spec in specs)
    print(f"parbench: {len(specs)} cells, {launches} launches -> {out}", file=sys.stderr)
    results = run_specs(specs, RunOptions(results=out, timeout_s=args.timeout),
                        on_result=lambda r: print(f"  {r.status.value:<8} {r.spec.label}", file=sys.stderr))
    print(summary_table(results))
    print(f"\nrows appended to {out}")
    return 0


def command_list(args: argparse.Namespace) -> int:
    from harness.strategies import STRATEGIES
    from workloads import WORKLOADS

    print("matrices:")
    for name, function in MATRICES.items():
        print(f"  {name:<14} {(function.__doc__ or '').strip().splitlines()[0]}")
    print("workloads:")
    for name, workload in WORKLOADS.items():
        print(f"  {name:<14} {workload.family.value:<7} {workload.train_flops_per_sample:.3g} train FLOPs/sample")
    print("strategies:")
    for name, strategy in STRATEGIES.items():
        options = ", ".join(f"{k}={v.default}" for k, v in strategy.options.items())
        print(f"  {name:<14} {strategy.launcher.value:<11} {strategy.description}"
              + (f"  [options: {options}]" if options else ""))
    return 0


COMMANDS = {"run": command_run, "list": command_list}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (SpecError, ResultsError) as error:
        print(f"parbench: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("parbench: interrupted; rows of finished cells are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
