"""A rank ends when the launcher that started it dies, and when the harness that started its launch dies.

    python -m pytest tests/test_no_orphans.py -m launch

A `harness run` killed by SIGKILL runs no clean-up (harness.launch.processes never gets to stop the launch), and
every launch runs in a session of its own, so `kill -9 -PGID` of the harness's group misses it: torchrun and its
ranks ran on. Two links close that gap without the harness being alive to act. Each command the harness starts
goes through harness.launch.tether, which has the kernel send it SIGTERM when the harness dies (a launcher passes
SIGTERM on to its ranks). And each rank calls `die_with_launcher` first thing:

- its own parent-death signal (Linux prctl PR_SET_PDEATHSIG), SIGKILL, for a launcher that dies without passing
  anything on. The kernel sends it when the *thread* that forked the rank ends; the launchers start ranks from
  their main threads (torchrun's agent loop, DeepSpeed's launch.py, Horovod's middleman and its shell), which live
  as long as the launcher. A launcher that died before the signal was set leaves the rank with another parent by
  the time it is set, and no signal would come: the rank checks its parent after setting it and ends at once.
- a watch on the harness itself (OWNER_ENV, which the harness puts in its launches' environment): a launcher that
  does not end with the harness leaves processes between it and the ranks that outlive it (DeepSpeed's runner dies
  of SIGTERM at once and leaves launch.py running, which waits for its ranks), so a rank also ends when the harness
  does; its launcher then sees it fail and ends the rest. The watch is a thread blocked on a pidfd of the harness
  (woken only when it exits: no polling among the timed steps), and only where the harness's pid means the same
  process, on the same boot of the same machine in the same pid namespace (an emulated cluster's nodes, not a
  real cluster's hosts, which their clean-up commands sweep).

Linux only: elsewhere nothing is set, as before.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

PR_SET_PDEATHSIG = 1                 # <linux/prctl.h>
OWNER_ENV = "PARBENCH_LAUNCH_OWNER"  # the harness that started the launch: "pid:start ticks:boot id:pid namespace"
RANK_DEATH_SIGNAL = signal.SIGKILL   # a rank whose launcher is gone has no one to report to
POLL_S = 1.0                         # where a pidfd cannot be had (Linux < 5.3): how often the harness is looked at


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send this process `signum` when the thread that forked it ends; it lasts across exec.
    False where there is no such request (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    return True


def die_with_launcher() -> None:
    """First thing in a rank: end (SIGKILL) when the launcher that started it dies, at once if it has died already,
    and when the harness that started the launch does (the module docstring)."""
    parent = os.getppid()
    if set_parent_death_signal(RANK_DEATH_SIGNAL) and os.getppid() != parent:
        _end()                       # the launcher died between the two calls: the signal will never come
    watch_owner(os.environ.get(OWNER_ENV, ""))


def owner_marker(pid: int | None = None) -> str | None:
    """Process `pid` (this one by default) as OWNER_ENV names it, or None where /proc cannot tell."""
    pid = os.getpid() if pid is None else pid
    started, machine = start_ticks(pid), _machine()
    return None if started is None or machine is None else f"{pid}:{started}:{machine}"


def watch_owner(marker: str) -> threading.Thread | None:
    """End this process (SIGKILL) when the process `marker` names ends, at once if it has ended already; the
    watching thread, or None where the marker names nothing on this machine's pid namespace (or nothing at all)."""
    owner = _here(marker)
    if owner is None:
        return None
    pid, started = owner
    gone = ending(pid, started)
    if gone is None:
        _end()
    watcher = threading.Thread(target=lambda: (gone(), _end()), name="parbench-harness-watch", daemon=True)
    watcher.start()
    return watcher


def ending(pid: int, started: str) -> Callable[[], None] | None:
    """A call that returns once process `pid` (started at `started` ticks) has ended, blocked on a pidfd (polling
    every POLL_S where there is none); None if it has ended already."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):        # no pidfd here (Linux < 5.3)
        pidfd = None
    if start_ticks(pid) != started:          # gone, and its pid perhaps another process's now
        if pidfd is not None:
            os.close(pidfd)
        return None

    def wait() -> None:
        if pidfd is not None:
            readable = select.poll()
            readable.register(pidfd, select.POLLIN)      # readable once the process has ended
            readable.poll()
            return
        while start_ticks(pid) == started:
            time.sleep(POLL_S)

    return wait


def _end() -> None:
    os.kill(os.getpid(), RANK_DEATH_SIGNAL)


def _here(marker: str) -> tuple[int, str] | None:
    """(pid, start ticks) of the process `marker` names, where its pid means that process here; else None."""
    parts = marker.split(":")
    if len(parts) != 4 or not parts[0].isdigit() or ":".join(parts[2:]) != _machine():
        return None
    return int(parts[0]), parts[1]


def start_ticks(pid: int) -> str | None:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat field 22): a pid and this name one
    process, where a pid alone may be reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]     # fields after the command name (field 2) start at field 3


def _machine() -> str | None:
    """This boot of this machine and this pid namespace ("boot id:namespace inode"), or None where /proc cannot
    tell."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")      # pid:[4026531836]
    except OSError:
        return None
    return f"{boot}:{namespace.strip('pid:[]')}"
