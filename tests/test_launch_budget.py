"""The launch tier's budget (tests/launch_budget.py): what a CI run takes, worked out by hand, and that the turns
cover every launch module."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import launch_budget
from launch_budget import Module, choose, cost, load_costs, windows

# Four modules, worked by hand below: a and b read stream S (200 s), c and d read none.
A, B = Module("tests/test_a.py", 100, frozenset({"S"})), Module("tests/test_b.py", 50, frozenset({"S"}))
C, D = Module("tests/test_c.py", 300), Module("tests/test_d.py", 400)
STREAMS = {"S": 200}


def test_a_stream_two_modules_read_is_paid_once():
    assert cost([A], STREAMS) == 100 + 200
    assert cost([A, B], STREAMS) == 100 + 50 + 200      # not 550
    assert cost([A, C], STREAMS) == 100 + 200 + 300
    assert cost([], STREAMS) == 0


def test_the_cycle_is_cut_into_consecutive_windows_that_fit():
    # The cycle: modules reading no stream first (c, d by path), then those reading S (a, b). At 500 s:
    # c (300) | c+d = 700 > 500, so d (400) | d+a = 400+100+200 = 700, so a (300) | a+b = 100+50+200 = 350: [a, b].
    cut = windows([A, B, C, D], STREAMS, 500)
    assert [[m.path for m in w] for w in cut] == [["tests/test_c.py"], ["tests/test_d.py"],
                                                   ["tests/test_a.py", "tests/test_b.py"]]


def test_the_turns_take_every_module_within_as_many_commits_as_windows():
    modules = [A, B, C, D]
    turns = [choose(modules, STREAMS, 500, turn=t) for t in range(3)]
    assert {p for c in turns for p in c.taken} == {m.path for m in modules}
    assert [c.taken for c in turns] == [["tests/test_c.py"], ["tests/test_d.py"], ["tests/test_a.py", "tests/test_b.py"]]
    assert choose(modules, STREAMS, 500, turn=4).taken == ["tests/test_d.py"]      # 4 mod 3


def test_the_changed_modules_go_first_and_what_does_not_fit_is_named():
    # Turn 0's window is c; b changed: b (50 + 200) first, then c (300) would make 550 > 500: named, not run.
    choice = choose([A, B, C, D], STREAMS, 500, turn=0, changed=["tests/test_b.py", "tests/other.txt"])
    assert choice.taken == ["tests/test_b.py"]
    assert choice.past_budget == ["tests/test_c.py"]
    assert choice.why["tests/test_b.py"] == "changed by this stop's commits"
    assert choice.estimate_s == 250
    assert choice.other_turns == ["tests/test_a.py", "tests/test_d.py"]


def test_always_comes_first_so_that_no_change_crowds_it_out():
    # b always (50 + S's 200 = 250), then the changed a (100 more: S is paid, 350) and c (300 more: 650 > 500, named).
    # The windows cut c, d, a to the 250 s b leaves, S paid: [c], [d], [a]; turn 2's is a, already taken.
    choice = choose([A, B, C, D], STREAMS, 500, turn=2, changed=["tests/test_c.py", "tests/test_a.py"],
                    always=["tests/test_b.py"])
    assert choice.taken == ["tests/test_b.py", "tests/test_a.py"]
    assert choice.past_budget == ["tests/test_c.py"]
    assert choice.estimate_s == 350 and choice.windows == 3


CONFTEST = """
from launch_budget import LaunchBudget, add_options

def pytest_addoption(parser):
    add_options(parser)

def pytest_configure(config):
    config.addinivalue_line("markers", "launch: starts a process")
    config.pluginmanager.register(LaunchBudget(config, {}), "launch-budget")
"""

MODULE = """
import pytest

@pytest.mark.launch
@pytest.mark.parametrize("k", range({n}))
def test_launches(k):
    pass

def test_unit():
    pass
"""


class Clock:
    """Each reading `step` seconds after the one before."""

    def __init__(self, step: float = 100.0) -> None:
        self.now, self.step = 0.0, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def suite(pytester, monkeypatch):
    monkeypatch.setattr(launch_budget, "time", Clock())
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x=MODULE.replace("{n}", "3"), test_y=MODULE.replace("{n}", "2"))
    costs = pytester.path / "costs.json"
    costs.write_text(json.dumps({"modules": {"test_x.py": 240, "test_y.py": 900}, "streams": {}}))
    return costs


def test_a_budgeted_run_takes_its_window_and_keeps_every_unit_test(pytester, suite):
    # At 1000 s: x (240) and y (900) do not fit together, so windows [x], [y]; turn 0 takes x.
    result = pytester.runpytest("--launch-budget", "1000", "--launch-turn", "0", "--launch-costs", str(suite), "-rs")
    result.assert_outcomes(passed=3 + 2, deselected=2)
    result.stdout.fnmatch_lines(["launch tier: 1 modules in a budget of 1000 s (estimated 240 s*turn 1 of 2*",
                                 "  ran: test_x.py (window 1 of 2; took 0 s of an estimated 240)", "  left to other turns: 1 modules: test_y"])


def test_a_module_whose_estimate_would_pass_the_budget_is_skipped_whole_saying_so(pytester, suite):
    # The plugin reads the clock at a module's first test alone (twice at the first: the start, then the time spent).
    # Turn 0 takes x (240 s) in 1000 s: its first test finds 100 s spent, 100 + 240 <= 1000, and all 3 run.
    result = pytester.runpytest("--launch-budget", "1000", "--launch-turn", "0", "--launch-costs", str(suite), "-rs")
    result.assert_outcomes(passed=3 + 2, deselected=2)
    # Turn 1 takes y (900 s): its first test finds 100 s spent, 100 + 900 = 1000 <= 1000, runs. Planted later: with
    # 800 s, y is not taken at all (900 > 800) and is named.
    result = pytester.runpytest("--launch-budget", "1000", "--launch-turn", "1", "--launch-costs", str(suite), "-rs")
    result.assert_outcomes(passed=2 + 2, deselected=3)
    result = pytester.runpytest("--launch-budget", "800", "--launch-turn", "1", "--launch-costs", str(suite), "-rs")
    result.assert_outcomes(passed=2, deselected=5)
    result.stdout.fnmatch_lines(["  NOT RUN, past the budget: test_y.py (window 2 of 2)"])


def test_a_module_started_late_is_skipped_rather_than_overrun(pytester, suite, monkeypatch):
    # Both fit 1200 s by estimate (x 240 + y 900 = 1140), one window. The clock reads 400 s apart: x's first test
    # finds 400 s spent (400 + 240 <= 1200: runs); y's first finds 800 s spent: 800 + 900 > 1200, and y's 2 tests
    # are skipped, saying why.
    monkeypatch.setattr(launch_budget, "time", Clock(400))
    result = pytester.runpytest("--launch-budget", "1200", "--launch-turn", "0", "--launch-costs", str(suite), "-rs")
    result.assert_outcomes(passed=3 + 2, skipped=2)
    result.stdout.fnmatch_lines(["  SKIPPED while running: test_y.py: the launch tier's budget: 800 s of 1200 s spent, and "
                                 "this module's estimate (900 s) would carry it past"])


def test_without_a_budget_nothing_is_deselected(pytester, suite):
    pytester.runpytest("--launch-costs", str(suite)).assert_outcomes(passed=3 + 2 + 2)


def test_every_launch_module_has_a_turn_in_ci_s_budget():
    # .ci/run's own budget and always-taken modules, read from it: a module grown past what a window can hold beside
    # them would never run in CI, and this fails naming it. The budget checked is what CI gives it where make test
    # takes 1.2 times its own budget, as it did in CI on 2026-11-29 (432 s of 360), and the A/B tier its usual 620 s
    # of launches: 1800 - 1.2 x 360 - (620 + 30 + 15 + 45 + 15 + 60 + 45) = 538 s. (The fault-tolerance matrix's 791 s
    # beside the always-taken modules did not fit such a window as one module: it is two.)
    budget = ci_launch_budget(ab_launches_s=float(ci_value("AB_DEFAULT_S")))
    assert budget == pytest.approx(1800 - 1.2 * 360 - (620 + 30 + 15 + 45 + 15 + 60 + 45))
    always = re.search(r"--launch-always (\S+)", CI).group(1).split(",")
    own, streams = load_costs()
    reads = json.loads(launch_budget.LAUNCH_COSTS.read_text())["reads"]
    modules = [Module(path, seconds, frozenset(reads.get(path, ()))) for path, seconds in own.items()]
    turns = [choose(modules, streams, budget, turn=t, always=always) for t in range(len(modules))]
    never = {m.path for m in modules} - {path for choice in turns for path in choice.taken}
    assert not never, f"never taken at {budget:.0f} s beside {always}: {sorted(never)}"


def test_the_a_b_tier_s_cap_leaves_the_launch_tier_its_always_taken_modules():
    # A change to a strategy's own code may raise the A/B tier's budget (harness/ab.py, AB_MUST_TIME_BUDGET_S), capped
    # by .ci/run at what the 30 minutes leave beside the launch tier's floor: the floor must hold the modules whose
    # streams the exact tier reads (their estimates, tests/launch_costs.json) and pytest's start, and at the cap the
    # launch tier's budget is that floor, however long make test took.
    always = re.search(r"--launch-always (\S+)", CI).group(1).split(",")
    own, streams = load_costs()
    reads = json.loads(launch_budget.LAUNCH_COSTS.read_text())["reads"]
    needed = sum(own[path] for path in always) + sum(streams[name] for name in {n for p in always for n in reads[p]})
    floor = float(ci_value("LAUNCH_FLOOR_S"))
    assert needed + 15 <= floor, (needed, floor)            # pytest's start and collection: 10-15 s here
    for make_test in (300.0, 360.0, 432.0, 600.0):
        cap = ci_ab_cap(make_test)
        assert ci_launch_budget(ab_launches_s=cap, make_test_s=make_test) == pytest.approx(floor)


CI = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()


def ci_value(name: str) -> str:
    return re.search(rf"^{name}=(\d+)$", CI, re.M).group(1)


def ci_sum(name: str) -> float:
    """The value of `NAME=$((A + B + ...))` in .ci/run, its terms numbers."""
    return sum(float(term) for term in re.search(rf"^{name}=\$\(\(([\d +]+)\)\)", CI, re.M).group(1).split("+"))


def ci_ab_cap(make_test_s: float) -> float:
    """The A/B tier's cap .ci/run works out after make test took `make_test_s` (the tools' few seconds left out)."""
    assert re.search(r"^ab_cap_s=\$\(\(BUDGET_S - \(SECONDS - started\) - LAUNCH_FLOOR_S - AB_TIER_START_S - "
                     r"OTHER_TIERS_S\)\)$", CI, re.M)
    return (float(ci_value("BUDGET_S")) - make_test_s - float(ci_value("LAUNCH_FLOOR_S"))
            - float(ci_value("AB_TIER_START_S")) - ci_sum("OTHER_TIERS_S"))


def ci_launch_budget(ab_launches_s: float, make_test_s: float | None = None) -> float:
    """The launch tier's budget .ci/run works out where make test took `make_test_s` (default 1.2 times its own
    budget) and the A/B tier's launches take `ab_launches_s`: its cap, or the 30 minutes less make test and the later
    tiers' budgets and slack."""
    if make_test_s is None:
        make_test_s = 1.2 * float(re.search(r'^tier "make test" (\d+)$', CI, re.M).group(1))
    assert re.search(r"^AB_TIER_S=\$\(\(ab_launches_s \+ AB_TIER_START_S\)\)$", CI, re.M)
    assert re.search(r"^AFTER_LAUNCH_S=\$\(\(AB_TIER_S \+ OTHER_TIERS_S\)\)$", CI, re.M)
    after = ab_launches_s + float(ci_value("AB_TIER_START_S")) + ci_sum("OTHER_TIERS_S")
    return min(float(ci_value("LAUNCH_BUDGET_S")), float(ci_value("BUDGET_S")) - make_test_s - after)
