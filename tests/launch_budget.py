"""The launch tier in a budget of wall time: which tests that launch ranks a CI run takes, and the turn of the others.

Every test that starts a process (marked `launch`) takes about an hour on a 2-core machine, most of it interpreters
starting and ranks stepping; CI has 30 minutes for all its tiers. So `.ci/run` takes a budget of them:

    pytest -m "launch and not core" --launch-budget 800 --launch-changed-within 12 \
        --launch-always tests/test_ddp_cpu.py,tests/test_llama_cells.py

1. The modules `--launch-always` names (whose streams the exact tier reads: first, so that nothing crowds them out),
   then the test modules the change adds or edits (`--launch-changed-within`: the commits of the 12 hours before
   HEAD's, a stop's batch of them, and the work tree), then one window of the rest: every launch module in a fixed cycle, cut into
   consecutive windows that each fit the budget, and window number (turn mod windows) taken, the turn being the
   commit count (`git rev-list --count HEAD`) unless `--launch-turn` says. Consecutive commits take consecutive
   windows, so every launch test runs within `windows` commits of any change, and a change's own tests at once.
2. A module's cost is its own tests' seconds plus the shared streams it reads (tests/conftest.py, StreamBank), each
   counted once however many selected modules read it, from LAUNCH_COSTS (measured; `--launch-costs-out` writes a
   run's figures, which refresh it). A module without a figure counts UNMEASURED_S.
3. Modules are added in that order while the selection's cost fits the budget; one that does not fit is named, never
   dropped in silence. While the tests run, a module whose estimate would carry the tier past its budget, judged at
   its first test, is skipped whole, saying so: estimates are from another day, and the tier stops adding work
   rather than overrun.

Nothing here judges a figure: it only chooses which tests run. Every test still runs in full under
`make test-launch` (no budget), which is what a release or a change to the suite's own machinery should run.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pytest

LAUNCH_COSTS = Path(__file__).with_name("launch_costs.json")
# A launch module without a measured figure (a new one): about one module launching a stream of a few cells.
UNMEASURED_S = 120.0
MARKER = "launch"


@dataclass(frozen=True)
class Module:
    path: str                             # relative to the repository root: tests/test_x.py
    own_s: float                          # its tests' seconds, the shared streams aside
    streams: frozenset[str] = frozenset()  # the shared streams its tests read


@dataclass
class Choice:
    """What a budgeted run takes: the modules in the order they were added, why each, and those left out."""

    taken: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)
    past_budget: list[str] = field(default_factory=list)
    other_turns: list[str] = field(default_factory=list)
    estimate_s: float = 0.0
    turn: int = 0
    windows: int = 1


def cost(modules: Iterable[Module], stream_s: Mapping[str, float]) -> float:
    """Seconds of these modules run together: their own, and each stream they read once."""
    modules = list(modules)
    streams = set().union(*(m.streams for m in modules)) if modules else set()
    return sum(m.own_s for m in modules) + sum(stream_s.get(s, UNMEASURED_S) for s in streams)


def windows(modules: Sequence[Module], stream_s: Mapping[str, float], budget_s: float) -> list[list[Module]]:
    """The cycle of modules (those sharing streams side by side, then by path) cut into consecutive windows of at most
    `budget_s` each; a module costlier than the budget alone is a window of its own."""
    cycle = sorted(modules, key=lambda m: (sorted(m.streams), m.path))
    cut: list[list[Module]] = []
    for module in cycle:
        if cut and cost([*cut[-1], module], stream_s) <= budget_s:
            cut[-1].append(module)
        else:
            cut.append([module])
    return cut


def choose(modules: Sequence[Module], stream_s: Mapping[str, float], budget_s: float, *, turn: int,
           changed: Iterable[str] = (), always: Iterable[str] = ()) -> Choice:
    """`always` (what later tiers read: first, so that nothing crowds it out), then the changed modules, then window
    `turn` mod windows, each added while the whole fits `budget_s`. The
    windows cut the other modules to the room `always` leaves, the streams it reads already paid for; they do not
    depend on the change, so the turns keep their order whatever each commit changes."""
    by_path = {m.path: m for m in modules}
    always = [p for p in dict.fromkeys(always) if p in by_path]
    paid = set().union(*(by_path[p].streams for p in always)) if always else set()
    room = budget_s - cost([by_path[p] for p in always], stream_s)
    rest = [m for m in modules if m.path not in always]
    cut = windows(rest, {s: (0.0 if s in paid else v) for s, v in stream_s.items()}, room) if rest else []
    choice = Choice(turn=turn % len(cut) if cut else 0, windows=max(1, len(cut)))
    window = [m.path for m in cut[choice.turn]] if cut else []
    order = ([(p, "always (its streams feed the exact tier)") for p in always]
             + [(p, "changed by this stop's commits") for p in sorted(set(changed)) if p in by_path]
             + [(p, f"window {choice.turn + 1} of {choice.windows}") for p in window])
    for path, why in order:
        if path in choice.why:
            continue
        if cost([by_path[p] for p in [*choice.taken, path]], stream_s) <= budget_s:
            choice.taken.append(path)
            choice.why[path] = why
        else:
            choice.past_budget.append(path)
            choice.why[path] = why
    choice.other_turns = sorted(p for p in by_path if p not in choice.why)
    choice.estimate_s = cost([by_path[p] for p in choice.taken], stream_s)
    return choice


def load_costs(path: Path = LAUNCH_COSTS) -> tuple[dict[str, float], dict[str, float]]:
    """({module: own seconds}, {stream: seconds}) from the committed figures."""
    data = json.loads(path.read_text())
    return dict(data["modules"]), dict(data["streams"])


def commit_count(root: Path) -> int:
    """The turn where none is given: how many commits HEAD has (0 outside a git checkout)."""
    done = subprocess.run(["git", "-C", str(root), "rev-list", "--count", "HEAD"], capture_output=True, text=True)
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip().isdigit() else 0


def changed_tests(root: Path, hours: float) -> set[str]:
    """The files under tests/ that commits made within `hours` before HEAD's own commit time changed, and those the work
    tree changes: a stop's whole batch of commits, where HEAD^1 would be its last commit alone. Commit times, not the
    clock's: the same history gives the same answer on any machine, any day."""
    head = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    if head.returncode != 0 or not head.stdout.strip().isdigit():
        return set()
    since = int(head.stdout.strip()) - int(hours * 3600)
    committed = subprocess.run(["git", "-C", str(root), "log", f"--since={since}", "--name-only", "--format=", "--",
                                "tests"], capture_output=True, text=True)
    uncommitted = subprocess.run(["git", "-C", str(root), "diff", "--name-only", "HEAD", "--", "tests"],
                                 capture_output=True, text=True)
    return set(committed.stdout.split()) | set(uncommitted.stdout.split())


class LaunchBudget:
    """The pytest plugin: selects at collection, skips what would overrun while running, reports at the end."""

    def __init__(self, config: pytest.Config, streams_read_by: Mapping[str, Sequence[str]]) -> None:
        self.config = config
        self.budget_s = config.getoption("launch_budget")
        self.streams_read_by = streams_read_by
        self.root = Path(str(config.rootpath))
        self.choice: Choice | None = None
        self.module_s: dict[str, float] = {}
        self.stream_s: dict[str, float] = {}
        self.started: set[str] = set()
        self.skipped: dict[str, str] = {}         # module: why its tests were skipped while running
        self.streams_started: set[str] = set()
        self.began: float | None = None
        self.measured: dict[str, float] = {}      # module: seconds its tests took here
        self.estimated: dict[str, float] = {}     # module: its estimate when it started, the streams it set up in it

    def _streams(self, item: pytest.Item) -> set[str]:
        return {s for f in item.fixturenames if f in self.streams_read_by for s in self.streams_read_by[f]}

    def _module(self, item: pytest.Item) -> str:
        return str(Path(str(item.path)).relative_to(self.root))

    # ---- collection: the selection ----------------------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if self.budget_s is None:
            return
        own, self.stream_s = load_costs(Path(config.getoption("launch_costs")))
        grouped: dict[str, list[pytest.Item]] = {}
        for item in items:
            if MARKER in item.keywords:
                grouped.setdefault(self._module(item), []).append(item)
        modules = [Module(path, own.get(path, UNMEASURED_S), frozenset().union(*(self._streams(i) for i in its)))
                   for path, its in grouped.items()]
        hours = config.getoption("launch_changed_within")
        turn = config.getoption("launch_turn")
        always = [p for p in (config.getoption("launch_always") or "").split(",") if p]
        self.choice = choose(modules, self.stream_s, self.budget_s,
                             turn=commit_count(self.root) if turn is None else turn,
                             changed=changed_tests(self.root, hours) if hours else (), always=always)
        rank = {path: k for k, path in enumerate(self.choice.taken)}
        kept = [i for i in items if MARKER not in i.keywords or self._module(i) in rank]
        left = [i for i in items if i not in kept]
        # Run in the order chosen, not the files' order: what comes first must not be the first skipped at the budget.
        kept.sort(key=lambda i: rank.get(self._module(i), -1) if MARKER in i.keywords else -1)
        if left:
            config.hook.pytest_deselected(items=left)
        items[:] = kept
        self.module_s = {m.path: m.own_s for m in modules}

    # ---- running: never past the budget -----------------------------------------------------------------------

    def _estimate(self, module: str, item: pytest.Item) -> float:
        """What starting this module costs: its tests' seconds, and the streams it reads that no test has set up."""
        unstarted = self._streams(item) - self.streams_started
        return self.module_s.get(module, UNMEASURED_S) + sum(self.stream_s.get(s, UNMEASURED_S) for s in unstarted)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """A module is judged at its first test: started, it runs to its end (its cost was counted whole); one whose
        estimate would carry the tier past its budget is skipped, every test of it."""
        if self.budget_s is None or MARKER not in item.keywords:
            return
        if self.began is None:
            self.began = time.monotonic()
        module = self._module(item)
        if module not in self.started and module not in self.skipped:
            spent = time.monotonic() - self.began
            estimate = self._estimate(module, item)
            if spent + estimate > self.budget_s:
                self.skipped[module] = (f"the launch tier's budget: {spent:.0f} s of {self.budget_s:.0f} s spent, and "
                                        f"this module's estimate ({estimate:.0f} s) would carry it past")
            else:
                self.started.add(module)
                self.estimated[module] = estimate
        if module in self.skipped:
            pytest.skip(self.skipped[module])
        self.streams_started |= self._streams(item)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::")[0]
        self.measured[module] = self.measured.get(module, 0.0) + report.duration

    # ---- the end: what ran, what waits its turn --------------------------------------------------------------

    def pytest_terminal_summary(self, terminalreporter) -> None:
        out = self.config.getoption("launch_costs_out")
        if out:
            Path(out).write_text(json.dumps(dict(sorted(self.measured.items())), indent=1) + "\n")
        if self.choice is None:
            return
        c = self.choice
        write = terminalreporter.write_line
        spent = time.monotonic() - self.began if self.began is not None else 0.0
        write(f"launch tier: {len(c.taken)} modules in a budget of {self.budget_s:.0f} s (estimated {c.estimate_s:.0f} s,"
              f" took {spent:.0f} s); turn {c.turn + 1} of {c.windows}: every launch test runs within {c.windows} "
              f"commits")
        for path in c.taken:
            # What each took beside its estimate: where the tier ran past its budget, the module that ran long.
            took = (f"; took {self.measured.get(path, 0.0):.0f} s of an estimated {self.estimated[path]:.0f}"
                    if path in self.estimated else "")
            write(f"  ran: {path} ({c.why[path]}{took})")
        for path in c.past_budget:
            write(f"  NOT RUN, past the budget: {path} ({c.why[path]})")
        for path, why in self.skipped.items():
            write(f"  SKIPPED while running: {path}: {why}")
        if c.other_turns:
            write(f"  left to other turns: {len(c.other_turns)} modules: {', '.join(Path(p).stem for p in c.other_turns)}")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("launch budget", "the launch tier in a budget (tests/launch_budget.py)")
    group.addoption("--launch-budget", type=float, default=None, metavar="SECONDS",
                    help="take the launch tests that fit this many seconds: the change's, --launch-always, a window")
    group.addoption("--launch-turn", type=int, default=None, metavar="N",
                    help="which window of the other launch modules (mod their count); default: the commit count")
    group.addoption("--launch-changed-within", type=float, default=None, metavar="HOURS",
                    help="test modules that commits within this many hours before HEAD's changed run first")
    group.addoption("--launch-always", default=None, metavar="PATHS", help="comma-separated modules always taken")
    group.addoption("--launch-costs", default=str(LAUNCH_COSTS), metavar="PATH", help="the costs file")
    group.addoption("--launch-costs-out", default=None, metavar="PATH",
                    help="write each module's measured seconds here (to refresh the costs file)")

