"""Command line: a thin adapter over the harness's plain functions. Each subcommand's module under harness/cli/ owns
its arguments (its `add_parser`) and its `command_*`; harness.cli.arguments holds the argument types and the groups
several subcommands share. This module assembles them (`build_parser`) and turns what a command raises into the exit
statuses below (`main`).

    python -m harness run --matrix full
    python -m harness run --matrix smoke --strategy ddp --world-sizes 2 --global-batch 32
    python -m harness run --matrix scaling --dry-run --gpus-per-node 8 --nnodes 4 --placement k8s --out k8s/scaling
    python -m harness list
    python -m harness memory --params 7B --dp 8 --option tp=8
    python -m harness comm --world-size 2
    python -m harness project results/reference/ci-cpu/smoke.jsonl --cluster dgx-h100-ib
    python -m harness project --params 1.5B --compute-ms 120 --cluster dgx-h100-ib --strategies ddp,zero3
    python -m harness plan --params 7B --shape 4096,4096,32,32 --cluster dgx-h100-ib --nodes 8 --tokens 1e9
    python -m harness report results/full-*.jsonl --out report/
    python -m harness compare results/base.jsonl results/new.jsonl
    python -m harness expect results/ci.jsonl --against results/reference/ci-expectations/ci.json
    python -m harness ab
    python -m harness derive-check
    python -m harness reproduce 3f2a9c

Exit statuses, the same for every command:
  0  done, and what was judged passed
  1  a regression (`compare`, `ab`), a difference (`expect`, `derive-check`), or a row that could not be appended
     (a full disk)
  2  bad input, in one line `parbench: error: ...`, before any process is launched
  3  `expect`: rows of other versions than the expectations' (an upgrade, whose figures must be re-recorded)
  4  `run`: a launch ended `failed`, `oom` or `timeout` (harness.cli.run.EXIT_CELLS_FAILED), after every other cell
     has run and every row is written
  5  `run`: a launch's rows failed a check, parity or a resume `mismatch` (harness.cli.run.EXIT_CHECK_FAILED),
     likewise
  6  `compare`, `ab`: nothing could be judged (harness.cli.compare.EXIT_NOTHING_JUDGED), with one line saying why and
     how many launches a side would judge; `--allow-unjudged` exits 0 instead
`run --allow-failed-cells` exits 0 instead of 4 or 5, for runs whose rows are judged afterwards.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from harness.cli import (ab, comm, compare, derive_check, doctor, expect, listing, memory, plan, project, report,
                         reproduce, run)
from harness.cli.arguments import parser_of
from harness.launch.interrupt import Interrupted, raising_on_stop_signals
from harness.record import AppendError, ResultsError
from harness.spec import SpecError

# The order argparse lists them in, in --help and in an unknown command's error.
SUBCOMMANDS = (run, memory, comm, project, plan, report, compare, expect, ab, derive_check, reproduce, listing, doctor)


def build_parser() -> argparse.ArgumentParser:
    return parser_of(*(module.add_parser for module in SUBCOMMANDS),
                     description="parbench: distributed training strategies, benchmarked on identical workloads.")


def interrupted_outcome(stop: Interrupted) -> str:
    """What a stop signal left: what was stopped, and a row recorded as interrupted only where one was."""
    recorded = f"; recorded as interrupted: {'; '.join(stop.recorded)}" if stop.recorded else ""
    return f"what was running is stopped and cleaned up{recorded}; rows already written are kept"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        with raising_on_stop_signals():      # SIGINT, SIGTERM, SIGHUP: stop what runs, clean up, exit 128 + signal
            return args.handler(args)
    except Interrupted as stop:
        print(f"parbench: {stop.name}: {interrupted_outcome(stop)}; exit {stop.exit_status}", file=sys.stderr)
        return stop.exit_status
    except (SpecError, ResultsError) as error:
        print(f"parbench: error: {error}", file=sys.stderr)
        return 2
    except AppendError as error:   # not bad input: the results file's disk or file system failed
        print(f"parbench: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("parbench: interrupted; rows of finished cells are kept", file=sys.stderr)
        return 130
