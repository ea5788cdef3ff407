"""The same-job A/B tier (harness/ab.py): launches taken in turns, as many as the gate's family needs, the
verdict, which rows it refuses, and which base commit it measures against.

The tier's logic is tested with stub launches that append rows built from the committed reference rows
(results/reference/ci-cpu/smoke.jsonl) with the values written below, so every outcome is fixed by those
values, never by timing noise. The git tests run git in temporary repositories (marked `launch`: they
start processes); one launches the real smoke matrix from a checkout of HEAD.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness import ab
from harness.ab import (AB_LAUNCHES, FASTEST_STEP_THRESHOLD, OWNER_FILE, WORKTREE_PREFIX, BudgetSpent, Outcome, Side,
                        TierResult, Unavailable, check_new_rows, checkout_of, head_commit, matrix_launch, measure,
                        prune_stale_checkouts, resolve_base, run_tier, tally)
from harness.cli import main
from harness.derive.gate import gate
from harness.record import append_row, read_results, read_rows
from harness.spec import RunResult, SpecError, Status

REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference" / "ci-cpu" / "smoke.jsonl"
MIB = 1 << 20
BASE_SHA, NEW_SHA = "b" * 40, "a" * 40


def _row(strategy: str, step_ms: float, rss_mib: float, sha: str, status: Status = Status.OK) -> RunResult:
    """The reference row of `strategy` as one launch of the given values: every timed step `step_ms` (so
    its unstalled median is exactly that), peak RSS `rss_mib`, run by commit `sha`."""
    template = next(r for r in read_results([REFERENCE]) if r.spec.strategy == strategy)
    m = dict(template.measurements)
    steps = [step_ms / 1e3] * template.spec.timed_steps
    m.update(step_time_s=steps, host_stalled_step_indices=[], host_stalled_steps=0, step_time_median_s=step_ms / 1e3,
             peak_rss_bytes_max=rss_mib * MIB, peak_rss_bytes_by_rank=[rss_mib * MIB] * template.spec.world_size)
    environment = {**template.environment, "git_sha": sha}
    return dataclasses.replace(template, measurements=m, environment=environment, status=status,
                               run_id=f"{strategy}-{sha[:4]}-{step_ms}-{rss_mib}-{status.value}")


class StubLaunch:
    """A launch that appends the smoke matrix's two rows (plain loop, DDP at 2 ranks) with values from
    `values(side, index)`, and records the order of launches."""

    def __init__(self, values):
        self.values = values
        self.order: list[str] = []

    def __call__(self, side: Side, index: int) -> None:
        self.order.append(f"{side.name}{index}")
        for strategy, (step_ms, rss_mib, *rest) in self.values(side, index).items():
            sha = rest[0] if rest else side.commit
            status = rest[1] if len(rest) > 1 else Status.OK
            append_row(side.results, _row(strategy, step_ms, rss_mib, sha, status))


def _sides(tmp_path: Path) -> tuple[Side, Side]:
    return (Side("base", tmp_path, BASE_SHA, tmp_path / "base.jsonl"),
            Side("new", tmp_path, NEW_SHA, tmp_path / "new.jsonl"))


# Launch-to-launch variation both sides share: the k-th launches of base and new see the same "load".
PLAIN_MS = (40.0, 41.0, 42.0, 41.5, 40.5, 41.2, 40.8, 41.4)
DDP_MS = (30.0, 31.0, 30.5, 31.5, 30.2, 30.8, 30.4, 30.6)


def _unchanged(side: Side, index: int) -> dict:
    # New launches a hair slower than base ones: every new launch beyond every base launch at k = 5 would
    # need min(new) > max(base), and here they interleave.
    bump = 1.002 if side.name == "new" else 1.0
    return {"plain": (PLAIN_MS[index - 1] * bump, 325.0), "ddp": (DDP_MS[index - 1] * bump, 330.0)}


def test_launches_alternate_eight_a_side(tmp_path):
    # 2 cells x (median step, fastest step, peak RSS) = a family of 6, which 5 a side could judge (1/252 <=
    # 0.05 / 6); the tier takes 8 (AB_LAUNCHES), in turns.
    base, new = _sides(tmp_path)
    launch = StubLaunch(_unchanged)
    result = run_tier(base, new, launch)
    assert launch.order == [f"{side}{k}" for k in range(1, 9) for side in ("base", "new")]
    assert result.outcome is Outcome.PASS and result.exit_status == 0 and result.launches == 8
    assert result.gate.family == 6 and {j.verdict.value for j in result.gate.judgements} == {"same"}


def test_fewer_launches_a_side_when_asked_but_never_fewer_than_the_family_needs(tmp_path):
    # 2 cells x 3 metrics: each needs 1 / C(2n, n) <= 0.05 / 6 = 0.0083; n = 4 gives 1/70 = 0.0143 (not
    # enough), n = 5 gives 1/252 = 0.0040. So asked for 3, the tier still takes 5.
    base, new = _sides(tmp_path)
    launch = StubLaunch(_unchanged)
    assert run_tier(base, new, launch, min_launches=3).launches == 5 and len(launch.order) == 10


def test_one_base_launch_slowed_as_a_whole_does_not_hide_a_planted_30_percent_slowdown(tmp_path):
    # Base DDP launch 3 at 45.0 ms (30.5 ms slowed 48% by other load), above every new launch (1.3 times the
    # base's 30.0-31.5 ms: 39.0-40.95 ms), so the launches overlap. Its 8 pairs with the new launches lie within
    # any threshold; the other 56 of the 64 lie beyond both the fastest step's 5% and the median's 15%
    # (31.5 * 1.15 = 36.2 ms < 39.0 ms). Orderings of 8 and 8 values with at most 8 of the 64 pairs inverted:
    # the partitions of k = 0..8, 1+1+2+3+5+7+11+15+22 = 67 of C(16, 8) = 12870, p = 0.0052 <= 0.05 / 6.
    def slower(side: Side, index: int) -> dict:
        ddp = DDP_MS[index - 1] * (1.3 if side.name == "new" else 1.0)
        if side.name == "base" and index == 3:
            ddp = 45.0
        return {"plain": (PLAIN_MS[index - 1], 325.0), "ddp": (ddp, 330.0)}

    base, new = _sides(tmp_path)
    result = run_tier(base, new, StubLaunch(slower))
    assert result.outcome is Outcome.REGRESSION and result.exit_status == 1
    called = result.reason.split("; threshold")
    assert result.reason.count("(56 of 64 pairs beyond the threshold, p = 0.0052") == 2
    assert "step_time_unstalled_median_s" in called[0] and "step_time_unstalled_fastest_s" in called[1]


def test_a_planted_30_percent_slower_ddp_step_fails_the_tier(tmp_path):
    # New DDP launches 1.3 times the base's: the closest pair is 30.0 * 1.3 = 39.0 ms against the base's
    # slowest, 31.5 ms: 39.0 / 31.5 - 1 = 23.8% apart, beyond the 15% median and the fastest step's threshold
    # (every step of a stub launch takes the same time, so its median is its fastest).
    def slower(side: Side, index: int) -> dict:
        factor = 1.3 if side.name == "new" else 1.0
        return {"plain": (PLAIN_MS[index - 1], 325.0), "ddp": (DDP_MS[index - 1] * factor, 330.0)}

    base, new = _sides(tmp_path)
    result = run_tier(base, new, StubLaunch(slower))
    assert result.outcome is Outcome.REGRESSION and result.exit_status == 1
    assert result.reason == ("gpt-tiny/ddp/ws2/gb16/mb4/fp32/cpu step_time_unstalled_median_s +23.8% > 15%; "
                             f"gpt-tiny/ddp/ws2/gb16/mb4/fp32/cpu step_time_unstalled_fastest_s +23.8% > "
                             f"{FASTEST_STEP_THRESHOLD:.0%}")


def test_the_step_time_threshold_can_be_overridden(tmp_path):
    # The same 30% slowdown under a 35% threshold: of the 49 (base, new) pairs only 40.95 / 30.0 = 1.365 and
    # 40.95 / 30.2 = 1.356 exceed 1.35 (the next, 40.95 / 30.4 = 1.347): 2 pairs, nowhere near a call.
    def slower(side: Side, index: int) -> dict:
        factor = 1.3 if side.name == "new" else 1.0
        return {"plain": (PLAIN_MS[index - 1], 325.0), "ddp": (DDP_MS[index - 1] * factor, 330.0)}

    base, new = _sides(tmp_path)
    result = run_tier(base, new, StubLaunch(slower), thresholds={"step_time_unstalled_median_s": 0.35,
                                                                  "step_time_unstalled_fastest_s": 0.35})
    assert result.outcome is Outcome.PASS


def test_a_row_that_ran_other_code_fails_the_tier_naming_its_sha(tmp_path):
    # The base side's rows record HEAD's SHA: its launch imported the new code, so nothing was compared.
    base, new = _sides(tmp_path)
    result = run_tier(base, new, StubLaunch(lambda side, index: {"plain": (40.0, 325.0, NEW_SHA)}))
    assert result.outcome is Outcome.FAILED and result.exit_status == 1
    assert f"records git_sha {NEW_SHA}, not the base commit {BASE_SHA[:12]}" in result.reason


def test_a_failed_new_launch_fails_the_tier_and_a_failed_base_launch_skips_it(tmp_path):
    def failing(broken: str):
        def values(side: Side, index: int) -> dict:
            status = Status.FAILED if side.name == broken and index == 2 else Status.OK
            return {"plain": (40.0, 325.0, side.commit, status)}
        return values

    base, new = _sides(tmp_path / "a")
    (tmp_path / "a").mkdir()
    failed = run_tier(base, new, StubLaunch(failing("new")))
    assert failed.outcome is Outcome.FAILED and failed.reason.startswith("new launch: gpt-tiny/plain/ws1")
    assert "ended failed" in failed.reason
    (tmp_path / "b").mkdir()
    base, new = _sides(tmp_path / "b")
    skipped = run_tier(base, new, StubLaunch(failing("base")))
    assert skipped.outcome is Outcome.SKIPPED and skipped.exit_status == 0
    assert skipped.reason.startswith("base launch: gpt-tiny/plain/ws1")


def test_nothing_comparable_stops_after_the_first_pair_and_is_skipped_not_passed(tmp_path):
    # The base side ran the plain loop, the new side DDP: no cell on both sides, a family of 0.
    base, new = _sides(tmp_path)
    launch = StubLaunch(lambda side, index: {"plain" if side.name == "base" else "ddp": (40.0, 325.0)})
    result = run_tier(base, new, launch)
    assert launch.order == ["base1", "new1"]
    assert result.outcome is Outcome.SKIPPED and result.exit_status == 0
    assert result.reason.startswith("nothing conclusive: 0 metrics not judged, 2 cells not compared")


def test_a_launch_that_appends_no_row_fails(tmp_path):
    base, new = _sides(tmp_path)
    result = run_tier(base, new, lambda side, index: None)
    assert result.outcome is Outcome.SKIPPED and result.reason == f"base launch appended no row to {base.results}"


def test_the_tally_counts_outcomes_and_keeps_each_metrics_largest_separation():
    # Two comparisons of the plain loop's step time, 3 launches a side: base 40, 41, 42 ms against new 44,
    # 45, 46 ms lie 44 / 42 - 1 = 4.8% apart; against new 30, 31, 32 ms the base lies above, by
    # 40 / 32 - 1 = 25.0% (signed -25.0%). The tally keeps the larger in absolute value.
    def compared(new_ms: tuple[float, ...]) -> TierResult:
        base = [_row("plain", ms, 325.0, BASE_SHA) for ms in (40.0, 41.0, 42.0)]
        new = [_row("plain", ms, 325.0, NEW_SHA) for ms in new_ms]
        return TierResult(Outcome.PASS, "", 3, gate(base, new, metrics=["step_time_unstalled_median_s"]))

    results = [compared((44.0, 45.0, 46.0)), compared((30.0, 31.0, 32.0)),
               TierResult(Outcome.SKIPPED, "shallow clone", 0, None)]
    assert [j.separation for r in results[:2] for j in r.gate.judgements] == pytest.approx([44 / 42 - 1, -(40 / 32 - 1)])
    assert tally(results) == ("A/B over 3 runs: 2 passed, 0 regressions, 0 failed, 1 skipped; largest |separation|: "
                              "step time 25.0%; closest approach: step time +25.0%")


def test_the_tally_says_how_near_overlapping_sides_came_to_separating():
    # Base 40, 41, 42 ms and new 41.5, 43, 44 ms overlap (41.5 < 42): new above base came within
    # 41.5 / 42 - 1 = -1.2%; base above new within 40 / 44 - 1 = -9.1%. The nearer: -1.2%. A second run,
    # new 38, 40, 45: 38 / 42 - 1 = -9.5% and 40 / 45 - 1 = -11.1%; the nearest over both runs stays -1.2%.
    def compared(new_ms: tuple[float, ...]) -> TierResult:
        base = [_row("plain", ms, 325.0, BASE_SHA) for ms in (40.0, 41.0, 42.0)]
        new = [_row("plain", ms, 325.0, NEW_SHA) for ms in new_ms]
        return TierResult(Outcome.PASS, "", 3, gate(base, new, metrics=["step_time_unstalled_median_s"]))

    results = [compared((41.5, 43.0, 44.0)), compared((38.0, 40.0, 45.0))]
    assert tally(results).endswith("largest |separation|: every pair overlapped; closest approach: step time -1.2%")


# ---- the budget: wall time on a clock the test moves, each stub launch taking the seconds it is given ----------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _launch_taking(clock: FakeClock, seconds) -> StubLaunch:
    """StubLaunch of `_unchanged` whose k-th launch of a side moves `clock` on by seconds[k - 1]."""
    stub = StubLaunch(_unchanged)

    def launch(side: Side, index: int) -> None:
        stub(side, index)
        clock.now += seconds[index - 1]
    launch.order = stub.order
    return launch


def test_the_tier_starts_no_pair_that_would_pass_its_budget_and_skips_where_the_gate_cannot_judge(tmp_path):
    # 30 s a launch, 60 a pair, the first estimated at 50: pairs start at 0, 60 and 120 s; at 180 s the next (60 s
    # as measured) would end at 240 > 200, so the tier stops at 3 a side, short of the 5 its family of 6 needs.
    clock = FakeClock()
    base, new = _sides(tmp_path)
    launch = _launch_taking(clock, [30.0] * 8)
    result = run_tier(base, new, launch, budget_s=200.0, first_pair_s=50.0, clock=clock)
    assert len(launch.order) == 6 and clock.now == 180.0
    assert result.outcome is Outcome.SKIPPED and result.launches == 3
    assert result.reason.startswith("budget spent after 3 launches a side (180 s of 200 s, the next pair about 60 s); "
                                    "the gate needs 5: nothing conclusive: 6 metrics not judged")


def test_the_next_pair_is_taken_as_long_as_the_longest_so_far_so_a_slowing_machine_does_not_overrun(tmp_path):
    # Pairs of 40 s then 120 s: at 160 s the next, as long as the longest (120 s), would end at 280 > 250. Taken as
    # their mean (80 s) it would start and end at 280 s, past the budget.
    clock = FakeClock()
    base, new = _sides(tmp_path)
    launch = _launch_taking(clock, [20.0, 60.0, 60.0, 60.0, 60.0, 60.0, 60.0, 60.0])
    result = run_tier(base, new, launch, budget_s=250.0, first_pair_s=40.0, clock=clock)
    assert launch.order == ["base1", "new1", "base2", "new2"] and clock.now == 160.0 <= 250.0
    assert result.outcome is Outcome.SKIPPED and result.reason.startswith("budget spent after 2 launches a side")


def test_a_budget_that_holds_what_the_gate_needs_but_not_eight_a_side_judges_and_says_why_it_stopped(tmp_path):
    # 10 s a launch: pairs start at 0, 20, ..., 80 s (80 + 20 = 100, within the budget), then stop: 5 a side,
    # what the family of 6 needs, so the gate judges.
    clock = FakeClock()
    base, new = _sides(tmp_path)
    result = run_tier(base, new, _launch_taking(clock, [10.0] * 8), budget_s=100.0, first_pair_s=20.0, clock=clock)
    assert result.outcome is Outcome.PASS and result.launches == 5 and clock.now == 100.0
    assert result.reason.endswith("; budget spent after 5 launches a side (100 s of 100 s, the next pair about 20 s)")


def test_a_launch_stopped_at_the_budget_leaves_its_pair_out_of_the_judgement(tmp_path):
    # Base launch 4 appends its rows, then new launch 4 is stopped at the deadline: the gate sees 3 launches a side.
    stub = StubLaunch(_unchanged)

    def launch(side: Side, index: int) -> None:
        if side.name == "new" and index == 4:
            raise BudgetSpent("new launch 4 stopped at the tier's budget")
        stub(side, index)

    base, new = _sides(tmp_path)
    result = run_tier(base, new, launch)
    assert len(read_rows([base.results])) == 8 and result.launches == 3
    assert {len(j.base) for j in result.gate.judgements} == {len(j.new) for j in result.gate.judgements} == {3}
    assert result.outcome is Outcome.SKIPPED
    assert result.reason.startswith("budget spent after 3 launches a side (new launch 4 stopped at the tier's budget)")


@pytest.mark.launch
def test_a_real_launch_past_its_deadline_is_stopped(tmp_path):
    # The smoke matrix's DDP cell takes about 5 s here; a deadline 1 s away stops `harness run` and its ranks.
    project = Path(__file__).resolve().parents[1]
    side = Side("new", project, head_commit(project), tmp_path / "new.jsonl")
    began = time.monotonic()
    with pytest.raises(BudgetSpent, match="new launch 1 stopped at the tier's budget"):
        matrix_launch("smoke", tmp_path, ("--strategy", "ddp"), deadline=began + 1.0)(side, 1)
    assert time.monotonic() - began < ab.STOP_GRACE_S


@pytest.mark.parametrize("args, words", [
    (["--plant-new", "slow-step:factor=0.5:rank=all:step=0"], ["factor must be >= 1"]),
    (["--plant-new", "explode"], ["KIND:rank=R:step=S"]),
    (["--launches", "2"], ["--launches >= 3"]),
    (["--repeat", "0"], ["--repeat must be >= 1"]),
    (["--threshold", "step_time=0.1"], ["'step_time'", "step_time_unstalled_median_s"]),
    (["--matrix", "nosuch"], ["'nosuch'", "smoke"]),
])
def test_bad_input_is_one_line_before_anything_starts(args, words, capsys, tmp_path):
    assert main(["ab", "--out", str(tmp_path / "ab"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("parbench: error:")
    for word in words:
        assert word in err, err
    assert not (tmp_path / "ab").exists()


def test_a_fault_in_the_environment_is_refused_rather_than_given_to_both_sides(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PARBENCH_FAULT", "slow-step:factor=1.3:rank=all:step=0")
    assert main(["ab", "--out", str(tmp_path / "ab")]) == 2
    assert "plants a fault on the new side only, with --plant-new" in capsys.readouterr().err


# ---- git: the base commit and its checkout (these start git processes) ----------------------------------


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _commit(repo: Path, name: str) -> str:
    (repo / name).write_text(name)
    _git(repo, "add", name)
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", name)
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    return repo


@pytest.mark.launch
def test_the_base_is_heads_first_parent_and_a_merge_base_for_another_ref(repo):
    first = _commit(repo, "one")
    second = _commit(repo, "two")
    assert resolve_base(repo) == first
    _git(repo, "checkout", "-q", "-b", "topic", first)
    _commit(repo, "three")
    assert resolve_base(repo, "main") == first             # a branch against main: where it left main
    _git(repo, "checkout", "-q", "main")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "merge", "-q", "--no-ff", "-m", "merge", "topic")
    assert resolve_base(repo) == second                    # a merge's first parent: main before it


@pytest.mark.launch
def test_a_root_commit_or_a_shallow_clone_skips_with_the_reason_and_a_bad_ref_is_an_error(repo, tmp_path):
    root = _commit(repo, "one")
    with pytest.raises(Unavailable, match=f"HEAD {root[:12]} is a root commit: there is no previous main"):
        resolve_base(repo)
    _commit(repo, "two")
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True)
    with pytest.raises(Unavailable, match="shallow clone: HEAD\\^1 is not in its history"):
        resolve_base(shallow)
    with pytest.raises(SpecError, match="--base 'nosuch' names no commit here"):
        resolve_base(repo, "nosuch")


@pytest.mark.launch
def test_harness_ab_in_a_clone_of_depth_1_exits_with_the_nothing_judged_status(tmp_path):
    # This project, cloned as a CI job might clone it: `harness ab` there has no base to measure against, which is
    # not a pass (exit 6), and says so; --allow-unjudged keeps 0 for those who want it.
    import os
    import sys

    root = Path(__file__).resolve().parents[1]
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{root}", str(shallow)], check=True)
    env = {**os.environ, "PYTHONPATH": str(shallow)}
    done = subprocess.run([sys.executable, "-m", "harness", "ab", "--out", str(tmp_path / "ab")], cwd=shallow, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 6, done.stdout + done.stderr
    assert "shallow clone" in done.stdout and "parbench: nothing judged: shallow clone" in done.stderr
    allowed = subprocess.run([sys.executable, "-m", "harness", "ab", "--out", str(tmp_path / "ab2"), "--allow-unjudged"],
                             cwd=shallow, env=env, capture_output=True, text=True, timeout=120)
    assert allowed.returncode == 0, allowed.stderr


@pytest.mark.launch
def test_the_base_checkout_is_its_commit_and_is_removed_even_on_an_error(repo):
    first = _commit(repo, "one")
    _commit(repo, "two")
    with pytest.raises(RuntimeError):
        with checkout_of(repo, first) as tree:
            assert head_commit(tree) == first and (tree / "one").exists() and not (tree / "two").exists()
            raise RuntimeError("a launch went wrong")
    assert not tree.exists() and _git(repo, "worktree", "list").count("\n") == 0


@pytest.mark.launch
def test_an_interrupt_during_git_worktree_add_leaves_no_worktree_registered(repo, tmp_path, monkeypatch):
    # The signal reaches the tier while git holds the new worktree registered, checked out and locked
    # ("initializing"), which `git worktree prune` keeps: the clean-up must already be armed, and force twice.
    first = _commit(repo, "one")
    _commit(repo, "two")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    real = ab._git

    def interrupted(where: Path, *args: str) -> subprocess.CompletedProcess:
        if args[:2] == ("worktree", "add"):
            real(where, *args)
            real(where, "worktree", "lock", "--reason", "initializing", args[3])
            raise KeyboardInterrupt
        return real(where, *args)

    monkeypatch.setattr(ab, "_git", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with checkout_of(repo, first):
            pass
    assert _git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
    assert list(temporary.iterdir()) == []


@pytest.mark.launch
def test_base_checkouts_earlier_runs_left_are_removed_and_those_that_may_be_in_use_kept(repo, tmp_path, monkeypatch):
    first = _commit(repo, "one")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    ended = subprocess.Popen(["true"])
    ended.wait()

    def left(name: str, age_s: float, owner: int, under: Path = temporary) -> Path:
        folder = under / f"{WORKTREE_PREFIX}{name}"
        folder.mkdir(parents=True)
        (folder / OWNER_FILE).write_text(str(owner))
        _git(repo, "worktree", "add", "-q", "--detach", str(folder / "checkout"), first)
        _git(repo, "worktree", "lock", "--reason", "initializing", str(folder / "checkout"))
        os.utime(folder, (time.time() - age_s,) * 2)
        return folder

    gone = left("gone", 60, os.getpid())                   # its folder deleted, its registration left
    subprocess.run(["rm", "-rf", str(gone)], check=True)
    killed = left("killed", 3 * 3600, ended.pid)           # a run killed hours ago
    long_run = left("long", 3 * 3600, os.getpid())         # an A/A measurement still running
    young = left("young", 60, ended.pid)                   # may be a run that is starting
    elsewhere = left("elsewhere", 3 * 3600, ended.pid, tmp_path / "other")   # not the tier's temporary folder
    with checkout_of(repo, first) as tree:            # each run of the tier prunes before it adds its own
        listed = _git(repo, "worktree", "list", "--porcelain")
    assert f"{gone}/" not in listed and f"{killed}/" not in listed and not killed.exists()
    assert all(f"{folder}/checkout" in listed for folder in (long_run, young, elsewhere)) and f"{tree}" in listed
    assert prune_stale_checkouts(repo) == []


@pytest.mark.launch
def test_a_launch_from_a_checkout_of_head_runs_that_checkouts_code(tmp_path):
    # The smoke matrix's plain cell launched once from a temporary work tree of HEAD's parent: its row records
    # the parent's SHA and a clean tree, read by the harness that ran there (harness.environment reads the
    # checkout its code lives in), not by this checkout's.
    project = Path(__file__).resolve().parents[1]
    try:
        parent = resolve_base(project)
    except Unavailable as why:
        pytest.skip(str(why))
    with checkout_of(project, parent) as tree:
        side = Side("base", tree, parent, tmp_path / "base.jsonl")
        matrix_launch("smoke", tmp_path, ("--strategy", "plain", "--timed-steps", "2"))(side, 1)
        assert check_new_rows(side, 0) == 1
        row, = read_rows([side.results])
        assert row["environment"]["git_sha"] == parent != head_commit(project)
        assert row["environment"]["git_dirty"] is False


@pytest.mark.launch
def test_an_a_a_measurement_plants_the_fault_on_the_new_side_alone_and_tallies_its_runs(repo, tmp_path, monkeypatch):
    _commit(repo, "one")
    head = _commit(repo, "two")
    seen: list[tuple[str, Path, str, dict]] = []

    def factory(matrix: str, folder: Path, options=(), deadline=None):
        stub = StubLaunch(_unchanged)

        def launch(side: Side, index: int) -> None:
            assert side.results.is_absolute()      # a launch starts in its side's checkout
            seen.append((side.name, side.checkout, head_commit(side.checkout), dict(side.env)))
            stub(side, index)
        return launch

    lines: list[str] = []
    plant = "slow-step:factor=1.3:rank=all:step=0:strategy=ddp"
    monkeypatch.chdir(tmp_path)                   # --out relative, as .ci/run gives it
    results = measure(repo, Path("ab"), a_a=True, repeat=2, plant_new=plant, launch=factory, say=lines.append)
    assert [r.outcome for r in results] == [Outcome.PASS, Outcome.PASS] and len(seen) == 2 * 2 * AB_LAUNCHES
    assert {(name, commit, tuple(env.items())) for name, _, commit, env in seen} == {
        ("base", head, ()), ("new", head, (("PARBENCH_FAULT", plant),))}
    base_tree = next(checkout for name, checkout, _, _ in seen if name == "base")
    assert base_tree != repo and not base_tree.exists()
    assert (tmp_path / "ab" / "run2" / "new.jsonl").exists()
    assert lines[-1].startswith("A/B over 2 runs: 2 passed, 0 regressions, 0 failed, 0 skipped;")
    with pytest.raises(Unavailable, match=f"the base HEAD is HEAD {head[:12]} itself: nothing changed"):
        measure(repo, tmp_path / "ab2", base_ref="HEAD", launch=factory)


def test_a_launch_is_tethered_to_ab_where_its_checkout_has_the_tether(tmp_path, monkeypatch):
    # A SIGKILLed `ab` must take its running `harness run` with it (harness.launch.tether); a base from before the
    # tether existed runs the command as it is, since `python -m` there imports the base's own modules.
    started: list[list[str]] = []

    class Done:
        def __init__(self, command, **_):
            started.append(command)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(ab.subprocess, "Popen", Done)
    monkeypatch.setattr(ab, "check_new_rows", lambda side, before: before + 1)
    project = Path(__file__).resolve().parents[1]
    old = tmp_path / "old"
    old.mkdir()
    for checkout in (project, old):
        matrix_launch("smoke", tmp_path, ("--strategy", "plain"))(Side("base", checkout, "x", tmp_path / "b.jsonl"), 1)
    tethered, bare = started
    assert tethered[:3] == [sys.executable, "-m", "harness.launch.tether"] and "--group" in tethered
    assert tethered[tethered.index("--") + 1:] == bare
    assert bare[:4] == [sys.executable, "-m", "harness", "run"]
