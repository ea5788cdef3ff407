"""What every command of a launch is started through, so that nothing of it outlives the harness, even one killed
by SIGKILL: the command is sent SIGTERM when the harness dies, and so is the rest of its process group.

    python -m harness.launch.tether --parent 4242 --group -- torchrun --nnodes=1 ... -m harness.rank.worker ...

A launcher runs in a session of its own (harness.launch.processes), so a harness killed by SIGKILL, which runs no
clean-up, left it and its ranks running. The tether asks the kernel for the parent-death signal (Linux prctl
PR_SET_PDEATHSIG), SIGTERM, as `kill_group` sends first (a launcher passes it on to its ranks), then becomes the
command, which keeps the request across exec. A small program, not a `preexec_fn`: Python runs that between fork
and exec, which is unsafe while the harness has other threads (tqdm's monitor).

The signal reaches the launcher alone. What it started in its own process group does not get it: DeepSpeed's
runner dies of SIGTERM at once, without a word to the launch.py it started, which then waits for ranks that may be
importing torch for many seconds before they can notice (harness.rank.parent_death): 14.8 s on the 2-core VM. So
the tether first leaves a watcher in the group (`--group`, where the tether leads a group of its own, which is then
the launch's alone: started with start_new_session), blocked until the harness ends, which then does what
`kill_group` would have: SIGTERM to the group's other processes, SIGKILL to the whole group, itself included, once
they are gone or after KILL_GRACE_S. Not SIGTERM to the launcher, which has its own from the kernel: torchrun raises
on each SIGTERM, and a second one would cut short its stopping of its ranks. While the harness lives, its own
`kill_group` ends the watcher with the launch's other processes.

The signal comes when the *thread* that started the tether ends, not the whole harness: harness.launch.processes
starts a launch's commands, waits for them and stops them in one call, so that thread outlives them. A harness that
died before the tether asked for the signal would never send it: the tether then checks that its parent is still
the harness (`--parent`) and runs nothing if not.

Linux only: elsewhere `tethered` leaves the command as it is.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from harness.rank.parent_death import ending, set_parent_death_signal, start_ticks

LAUNCHER_DEATH_SIGNAL = signal.SIGTERM
KILL_GRACE_S = 10.0        # as harness.launch.processes.kill_group's


def tethered(command: Sequence[str], *, group: bool = True) -> list[str]:
    """`command` started through the tether, bound to this process; `command` itself where that is not possible.
    `group`: with a watcher that stops the rest of its process group too (started in a session of its own, with
    Popen's start_new_session, the group is the command's alone: stop the group, not the process, which leaves
    the watcher); False for a command that leaves nothing in its group (sshd: each session is one of its own)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    watch = ["--group"] if group else []
    return [sys.executable, "-m", "harness.launch.tether", "--parent", str(os.getpid()), *watch, "--", *command]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.launch.tether", description=__doc__.splitlines()[0])
    parser.add_argument("--parent", type=int, required=True, help="the harness's pid")
    parser.add_argument("--group", action="store_true", help="leave a watcher that stops the command's process "
                        "group when the harness ends (where the tether leads a group of its own)")
    parser.add_argument("--watch-group", metavar="TICKS", help="be the group's watcher, for the harness started at "
                        "TICKS (the tether starts it)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    if args.watch_group is not None:
        return watch_group(args.parent, args.watch_group)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    set_parent_death_signal(LAUNCHER_DEATH_SIGNAL)
    started = start_ticks(args.parent)
    if os.getppid() != args.parent or started is None:
        print(f"parbench tether: the harness (pid {args.parent}) is gone; not starting {command[0]}", file=sys.stderr)
        return 128 + LAUNCHER_DEATH_SIGNAL
    if args.group and os.getpgrp() == os.getpid():    # a group of its own (start_new_session): the launch's alone
        # Holding none of the command's streams: whoever reads them to the end waits for the command, not for it.
        subprocess.Popen([sys.executable, "-m", "harness.launch.tether", "--parent", str(args.parent),
                          "--watch-group", started], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        os.execvp(command[0], command)
    except OSError as error:        # as a shell reports a command it cannot run
        print(f"parbench tether: cannot run {command[0]}: {error.strerror}", file=sys.stderr)
        return 127


def watch_group(harness: int, started: str) -> int:
    """Wait until the harness ends, then stop this process group: SIGTERM to all but the launcher (the kernel sent
    it its own) and this watcher, SIGKILL to all once they are gone or after KILL_GRACE_S."""
    launcher = os.getppid()
    # Its own SIGTERM to the group must not end it before the SIGKILL; the harness's kill_group ends it with SIGKILL.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gone = ending(harness, started)
    if gone is not None:
        gone()
    group, me = os.getpgrp(), os.getpid()
    for pid in group_members(group) - {me, launcher}:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + KILL_GRACE_S
    while group_members(group) - {me} and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(group, signal.SIGKILL)
    return 0


def group_members(group: int) -> set[int]:
    """The live processes of process group `group` (a zombie has ended), from /proc."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[2] == str(group) and fields[0] != "Z":       # fields 3 (state) and 5 (pgrp)
            members.add(int(entry.name))
    return members


if __name__ == "__main__":
    sys.exit(main())
