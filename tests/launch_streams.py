"""The session's shared cells, launched as `python -m harness run` streams, two side by side.

A launch on this 2-core machine leaves a core idle for much of its time: each launcher first starts alone
(torchrun's agent, DeepSpeed's runner and then its per-node launcher, horovodrun), importing torch, before
the ranks start. Sampled every 5 s during these cells, one at a time, the machine was 44-90% busy (68% on
average); the 16 fp32 cells took 103 s as two streams against 139 s one after another, with nothing else
running. Where other work already keeps both cores busy, two streams gain nothing.

Nothing read from these rows depends on timing: parity is judged on losses and norms, which a neighbour
does not change; counted bytes and the model-state census are exact; a host stall (harness.rank.timing)
counts CPU time the hypervisor withheld from the whole machine, which a neighbouring process does not.
Each launch keeps its own rendezvous port, folder and marker, whose sweep touches nothing of the other
stream's. Tests that judge timing, time-outs or leftover processes launch their own cells, one at a time.

Each stream is its own `python -m harness run` process, so that a stream can carry its own environment
(a planted fault, harness.rank.faults, is read from it by the runner and by every rank).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness.cli.run import EXIT_CHECK_FAILED
from harness.record import read_results
from harness.spec import RunResult

STREAMS = 2
# A folder every stream's rows are copied into, with the command that made them, and read back from where a later
# session asks for the same stream with the same command: .ci/run gives `make test` and `make test-matrix` one, so
# that the matrix tier reads the gpt-tiny streams `make test` launched instead of launching them again, and its exact
# tier holds those rows (the ci matrix's cells) to the committed expectations.
KEEP_ROWS_ENV = "PARBENCH_KEEP_SUITE_ROWS"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Five steps: the four parity compares (harness.derive.parity.PARITY_STEPS) and a second warm-up step, in which
# the model-state census is read (it needs the optimizer's state, made by the first step's update), so that
# tests/test_memory.py judges these rows too; three timed steps, so that a timed step the host stalled
# (harness.rank.timing) still leaves others for tests/test_ddp_cpu.py's figures. Two cores per node, as
# this machine has, wherever the suite runs: the cells' threads per rank follow it. One launch a cell: the tests judge
# figures that do not depend on the machine (the full matrix's own 5 launches of the plain and bare loops are for the
# harness's cost, which tests/test_bare_loop.py judges on its own rows).
# fp32 unless a stream says otherwise (a later --precision wins): the full matrix's bf16 policy cells and their bf16
# plain loop (harness.matrix.full) are streams of their own (tests/test_fsdp2_policy_cells.py).
COMMON = ("run", "--matrix", "full", "--device", "cpu", "--cpus-per-node", "2", "--precision", "fp32",
          "--warmup-steps", "2", "--timed-steps", "3", "--timeout", "300", "--repeats", "1")


@dataclass(frozen=True)
class Stream:
    """Cells launched one after another into their own results file: a selection of the full matrix."""

    name: str                                  # the results file's stem
    selection: tuple[str, ...]                 # `python -m harness run` flags after `common`
    environment: Mapping[str, str] = field(default_factory=dict)
    common: tuple[str, ...] = COMMON           # another matrix's (tests/test_checkpoint_cells.py: fault-tolerance)


class StreamBank:
    """Streams launched on demand into one folder, each once: the first demand launches, with what it asks for,
    every planned stream not yet launched, so that they share the STREAMS lanes. A stream that fails is not
    launched again: its readers get its error, and the other streams' rows stay theirs (a failure that relaunched
    every stream for each later reader ran CI past its time)."""

    def __init__(self, folder: Path, planned: Sequence[Stream]) -> None:
        self.folder, self.planned = folder, list(planned)
        self.launched: dict[str, list[RunResult] | BaseException] = {}

    def rows(self, *streams: Stream) -> list[RunResult]:
        """The rows of `streams`, in their order; the first failed stream's error where one failed."""
        if any(stream.name not in self.launched for stream in streams):
            due = [s for s in [*self.planned, *streams] if s.name not in self.launched]   # planned longest first
            self.launched.update(run_streams(self.folder, list({s.name: s for s in due}.values()), keep_going=True))
        for stream in streams:
            if isinstance(self.launched[stream.name], BaseException):
                raise RuntimeError(f"stream {stream.name} failed") from self.launched[stream.name]
        return [row for stream in streams for row in self.launched[stream.name]]


def run_streams(folder: Path, streams: Sequence[Stream], keep_going: bool = False) -> dict[str, Any]:
    """{stream name: its rows}, at most STREAMS streams launching at once, longest first as given; with
    `keep_going`, a failed stream's error in place of its rows, where otherwise the first error is raised."""
    with ThreadPoolExecutor(max_workers=STREAMS) as pool:
        running = {stream.name: pool.submit(_run, folder, stream) for stream in streams}
        if not keep_going:
            return {name: future.result() for name, future in running.items()}
        return {name: future.exception() or future.result() for name, future in running.items()}


def _run(folder: Path, stream: Stream) -> list[RunResult]:
    out, log = folder / f"{stream.name}.jsonl", folder / f"{stream.name}.log"
    command = [sys.executable, "-m", "harness", *stream.common, *stream.selection, "--out", str(out)]
    keep = Path(os.environ[KEEP_ROWS_ENV]) if os.environ.get(KEEP_ROWS_ENV) else None
    made_by = json.dumps({"arguments": [*stream.common, *stream.selection], "environment": dict(stream.environment)})
    if keep and (keep / out.name).is_file() and (keep / f"{stream.name}.command").read_text() == made_by:
        return read_results([keep / out.name])
    with log.open("w") as sink:
        done = subprocess.run(command, cwd=PROJECT_ROOT, env={**os.environ, **stream.environment},
                              stdout=sink, stderr=subprocess.STDOUT)
    # 5: a row failed a check (parity, resume), which is what the streams with a planted fault are there to show.
    if done.returncode not in (0, EXIT_CHECK_FAILED) or not out.exists():
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"stream {stream.name}: `{' '.join(command)}` exited {done.returncode}:\n{tail}")
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, keep / out.name)
        (keep / f"{stream.name}.command").write_text(made_by)
    return read_results([out])
