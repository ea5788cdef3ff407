"""Stopping on a signal: SIGINT (Ctrl-C), SIGTERM (a CI job's time-out, Slurm, Kubernetes, `timeout`) and SIGHUP (a
closed terminal) become an exception in the main thread, so that every launch in flight is stopped and cleaned up
before the command exits 128 + the signal's number (130, 143, 129).

By default SIGTERM and SIGHUP end a Python process at once, running no `finally`: a killed `harness run` left its
torchrun and ranks running under init (`timeout 30 python -m harness run --matrix fault-tolerance`), and 64 ranks of
`harness comm` ran on for 19 minutes. Raised as `Interrupted`, the signal unwinds through the launch's own clean-up
(harness.launch.processes: each command's process group sent SIGTERM, then SIGKILL after its grace; every process
still carrying the launch's marker killed; the plan's clean-up commands run), the emulated cluster's teardown
(harness.emulate: its namespaces removed), the A/B tier's base work tree, and the runner, which records the
interrupted launch as a row of its own (`Status.INTERRUPTED`) before the command exits, as `comm` records its
benchmark; each names the row in `Interrupted.recorded`, which the exit line repeats.

SIGKILL cannot be caught: what stops a launch then is harness.launch.tether and harness.rank.parent_death.

`Interrupted` is a BaseException, as KeyboardInterrupt is, so no `except Exception` on the way swallows it. Signals
that arrive while the clean-up runs are noted and ignored: it is bounded (a grace of seconds, then SIGKILL), and a
second Ctrl-C cutting it short is what left processes behind.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A stop signal arrived: unwind, stopping what runs, and exit `exit_status`. Whoever records what the signal
    cut short as a row of its own (the runner its launch in flight, `comm` its benchmark) names it in `recorded`, so
    that the exit message claims no row that was never written."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.recorded: list[str] = []      # "what -> results file", one for each row recorded as interrupted

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, as a shell reports a process a signal ended: 130 SIGINT, 143 SIGTERM, 129 SIGHUP."""
        return 128 + self.signum


@contextlib.contextmanager
def raising_on_stop_signals() -> Iterator[None]:
    """Within the block, the first stop signal raises `Interrupted` in the main thread; later ones are noted on stderr
    and ignored while the clean-up runs. The previous handlers come back after. Elsewhere than the main thread (where
    Python delivers signals) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handle(signum: int, frame) -> None:
        if received:
            print(f"parbench: {signal.Signals(signum).name} while stopping: ignored until the launch in flight is "
                  "cleaned up", file=sys.stderr)
            return
        received.append(signum)
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, handle) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
