"""The unit tier launches nothing: a test not marked `launch` that starts a process fails, naming the marker.

`pytest -m "not launch"` is the tier that must run in under a minute and start no process (no harness
launch, torchrun, horovodrun, deepspeed, python or shell subprocess, sshd, `ip netns`). Counting on every
author to mark such a test would make the tier only as good as the last review, so every way this
interpreter can start a process is wrapped for the whole session (tests/conftest.py registers the guard):

- subprocess.Popen (subprocess.run, check_output, os.popen and asyncio's subprocesses go through it),
- _posixsubprocess.fork_exec (multiprocessing's spawn and forkserver start methods),
- os.fork, os.forkpty, os.posix_spawn, os.posix_spawnp, os.system.

While a test without the marker is set up or runs, a start is refused: the wrapper raises `pytest.fail`
(a BaseException, so the harness's `except Exception` that turns a failure into a row cannot swallow it)
and records the attempt, so that a start made from another thread, or caught by the code under test,
still fails the test when the phase ends.

A fixture shared across tests (module or session scope) is set up once, by whichever test asks first. A
fixture that started a process is remembered, and a test without the marker that uses it fails even when a
marked test set it up earlier: the verdict does not depend on which tests were selected or in what order.
Tear-downs are not guarded: a shared fixture is torn down after whichever test used it last, marked or
not, and what it stops there it started in its set-up, where it was seen.
"""

from __future__ import annotations

import os
import subprocess
import threading
from typing import Any, Callable

import _posixsubprocess
import pytest

MARKER = "launch"
HINT = f'mark it `{MARKER}` (@pytest.mark.{MARKER}); the unit tier, pytest -m "not {MARKER}", starts no process'

# Every entry point through which this interpreter starts a process: (owner, attribute).
PROCESS_STARTS = ((subprocess.Popen, "_execute_child"), (_posixsubprocess, "fork_exec"), (os, "fork"),
                  (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"))


def describe(name: str, args: tuple) -> str:
    """The entry point and, where the call names it, the program a start would run."""
    if name == "Popen._execute_child" and len(args) > 1:   # _execute_child(self, args, executable, ...)
        program = args[1]
        words = [program] if isinstance(program, (str, bytes, os.PathLike)) else list(program)
        return f"{name}: {_one_line(' '.join(map(str, words)))}"
    if name == "os.system" and args:
        return f"{name}: {_one_line(str(args[0]))}"
    return name


def _one_line(command: str, limit: int = 120) -> str:
    words = " ".join(command.split())      # a `python -c` script spans lines
    return words if len(words) <= limit else words[:limit] + "..."


class LaunchGuard:
    """A pytest plugin: refuses process starts while a test without the `launch` marker is set up or runs."""

    def __init__(self) -> None:
        self.unmarked_test: str | None = None       # node id of the unmarked test being set up or run
        # Fixtures as (where defined: a node id prefix, name), so that two fixtures of one name in two modules
        # stay apart.
        self.fixtures_in_setup: list[tuple[str, str]] = []     # whose own set-up is running, innermost last
        self.launching_fixtures: dict[tuple[str, str], str] = {}   # -> the first process it started
        self.refused: list[str] = []                # starts refused in the current phase
        self._originals: list[tuple[Any, str, Callable]] = []
        self._lock = threading.Lock()

    # ---- the wrapped entry points ----------------------------------------------------------------------

    def install(self) -> None:
        for owner, attribute in PROCESS_STARTS:
            if not hasattr(owner, attribute):       # os.forkpty and os.posix_spawn are not everywhere
                continue
            original = getattr(owner, attribute)
            self._originals.append((owner, attribute, original))
            setattr(owner, attribute, self._wrap(original, f"{owner.__name__}.{attribute}"))

    def uninstall(self) -> None:
        while self._originals:
            owner, attribute, original = self._originals.pop()
            setattr(owner, attribute, original)

    def _wrap(self, original: Callable, name: str) -> Callable:
        def guarded(*args, **kwargs):
            what = describe(name, args)
            with self._lock:
                for fixture in self.fixtures_in_setup:
                    self.launching_fixtures.setdefault(fixture, what)
                test = self.unmarked_test
                if test is not None:
                    self.refused.append(what)
            if test is not None:
                pytest.fail(f"{test} started a process ({what}) but is not marked `{MARKER}`: {HINT}")
            return original(*args, **kwargs)

        return guarded

    # ---- hooks ---------------------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        self.fixtures_in_setup.append((fixturedef.baseid, fixturedef.argname))
        try:
            return (yield)
        finally:
            self.fixtures_in_setup.pop()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        if not _marked(item):
            names = set(getattr(item, "fixturenames", ()))
            used = [(fixture, what) for fixture, what in self.launching_fixtures.items()
                    if fixture[1] in names and _visible_from(fixture[0], item.nodeid)]
            if used:
                (_, name), what = used[0]
                raise pytest.fail.Exception(f"{item.nodeid} uses fixture {name!r}, which started a process "
                                            f"({what}), but is not marked `{MARKER}`: {HINT}", pytrace=False)
        return (yield from self._guarded(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from self._guarded(item))

    def _guarded(self, item):
        self.unmarked_test = None if _marked(item) else item.nodeid
        self.refused.clear()
        try:
            result = yield
        except pytest.fail.Exception:     # the refusal itself (or another pytest.fail): already says why
            self._end_phase()
            raise
        except BaseException as error:    # the code under test caught the refusal and failed otherwise
            if refused := self._end_phase():
                raise self._failure(item, refused) from error
            raise
        if refused := self._end_phase():  # caught and not re-raised, or met in another thread
            raise self._failure(item, refused)
        return result

    def _end_phase(self) -> list[str]:
        self.unmarked_test = None
        refused, self.refused = list(dict.fromkeys(self.refused)), []
        return refused

    @staticmethod
    def _failure(item: pytest.Item, refused: list[str]) -> BaseException:
        return pytest.fail.Exception(f"{item.nodeid} tried to start a process ({'; '.join(refused)}) but is not "
                                     f"marked `{MARKER}`: {HINT}", pytrace=False)


def _visible_from(baseid: str, nodeid: str) -> bool:
    """Whether a fixture defined at `baseid` (a conftest's folder, a module, a class) reaches test `nodeid`."""
    return not baseid or nodeid == baseid or nodeid.startswith((baseid + "/", baseid + "::"))


def _marked(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARKER) is not None
