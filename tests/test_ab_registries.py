"""The A/B tier across two registries and what a cell runs (harness/ab.py select_cells and measure, harness/touched.py):
a strategy new on one side, one gone, a registry changed in its entries alone, a change to a launcher, a workload or a
family's shared module.

The git tests (marked `launch`: they start git) commit changes to a copy of the project's harness/ and workloads/ in a
temporary repository, and launch through a stand-in that appends rows; one runs `python -m harness ab` for real on a
copy of the whole checkout with a strategy added.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from harness.ab import (AB_BUDGET_S, Outcome, Side, choose_cells, estimated_seconds, measure, planned_budget,
                       select_cells)
from harness.record import append_row, read_results, read_rows
from harness.spec import Status
from harness.strategies import STRATEGIES
from harness.touched import FAMILY_MODULES, must_time, touched_strategies

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "results" / "reference" / "ci-cpu" / "smoke.jsonl"
DEEPSPEED = ("zero1", "zero2", "zero3", "pipeline", "autotp")
# DeepSpeed's launcher starts DeepSpeed-MoE too, whose cell skips gpt-tiny (the A/B tier names it, times none of it).
LAUNCHED_BY_DEEPSPEED = (*DEEPSPEED, "deepspeed-moe", "ulysses")
BUILT_IN = {name: strategy for name, strategy in STRATEGIES.items() if type(strategy).__module__.startswith("harness.")}


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True)
    return done.stdout.strip()


def _commit(repo: Path, path: str, edit: Callable[[str], str]) -> str:
    file = repo / path
    text = file.read_text()
    assert edit(text) != text, f"the edit changes nothing in {path}"
    file.write_text(edit(text))
    _git(repo, "commit", "-q", "-a", "-m", f"change {path}")
    return _git(repo, "rev-parse", "HEAD")


def _add_ddp_copy(text: str) -> str:
    return text.replace('    "ddp": DDP(),\n', '    "ddp": DDP(),\n    "ddp-copy": DDP(),\n')


def _append_comment(text: str) -> str:
    return text + "# a change\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A repository holding a copy of the project's harness/ and workloads/, committed once: the base."""
    repo = tmp_path / "project"
    for folder in ("harness", "workloads"):
        shutil.copytree(ROOT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__"))
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    return repo


# ---- a strategy on one side only ---------------------------------------------------------------------------------


@pytest.mark.launch
def test_a_registry_entry_added_alone_touches_no_strategy_and_the_new_one_is_named_new(project):
    base = _git(project, "rev-parse", "HEAD")
    head = _commit(project, "harness/strategies/__init__.py", _add_ddp_copy)
    assert touched_strategies(project, base, BUILT_IN, workload="gpt-tiny") == {}
    choice = select_cells(project, base, head)
    assert choice.timed == ("ddp",) and choice.new == ("ddp-copy",) and choice.gone == ()
    assert "new: ddp-copy (nothing to compare: one launch on the new side alone, to prove it starts)" in \
        choice.describe()


@pytest.mark.launch
def test_a_registry_changed_beyond_its_entries_counts_for_every_strategy(project):
    base = _git(project, "rev-parse", "HEAD")
    _commit(project, "harness/strategies/__init__.py",
            lambda text: text.replace("raise SpecError(f\"unknown strategy", "raise SpecError(f\"no strategy"))
    assert set(touched_strategies(project, base, BUILT_IN)) == set(BUILT_IN)


@pytest.mark.launch
def test_a_renamed_strategy_is_named_gone_and_its_new_name_new_and_neither_is_timed(project):
    base = _git(project, "rev-parse", "HEAD")
    head = _commit(project, "harness/strategies/__init__.py", lambda text: text.replace('"ps-async":', '"ps-async2":'))
    choice = select_cells(project, base, head)
    assert choice.new == ("ps-async2",) and choice.gone == ("ps-async",)
    assert "ps-async" not in choice.timed and "ps-async2" not in choice.timed
    assert "gone: ps-async (in the base's registry, not in this one's: removed or renamed, not timed)" in \
        choice.describe()


class RowLaunch:
    """A stand-in launch: appends the committed smoke DDP row once for each strategy its `--strategy` names, as
    that strategy, recording the commit of the side and `status` for the strategies in `failing`; records each
    launch's side, checkout and strategies."""

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.failing = failing
        self.launches: list[tuple[str, Path, tuple[str, ...]]] = []
        self.template = next(r for r in read_results([REFERENCE]) if r.spec.strategy == "ddp")

    def __call__(self, matrix: str, folder: Path, options=(), deadline=None):
        strategies = tuple(options[list(options).index("--strategy") + 1].split(","))

        def launch(side: Side, index: int) -> None:
            self.launches.append((side.name, side.checkout, strategies))
            for name in strategies:
                status = Status.FAILED if name in self.failing else Status.OK
                row = dataclasses.replace(self.template, spec=dataclasses.replace(self.template.spec, strategy=name),
                                          environment={**self.template.environment, "git_sha": side.commit},
                                          status=status, run_id=f"{side.name}-{index}-{name}")
                append_row(side.results, row)
        return launch


@pytest.mark.launch
def test_the_tier_times_ddp_on_both_sides_and_launches_a_new_strategy_once_on_the_new_side(project, tmp_path):
    _commit(project, "harness/strategies/__init__.py", _add_ddp_copy)
    launch, lines = RowLaunch(), []
    result, = measure(project, tmp_path / "ab", launch=launch, say=lines.append)
    assert result.outcome is Outcome.PASS
    # The new side's one launch of ddp-copy first, from this checkout; then DDP alone on each side, in turns.
    assert launch.launches[0] == ("new-only", project, ("ddp-copy",))
    pairs = {(name, strategies) for name, _, strategies in launch.launches[1:]}
    assert pairs == {("base", ("ddp",)), ("new", ("ddp",))}
    assert [name for name, _, _ in launch.launches[1:]] == ["base", "new"] * result.launches
    assert [row["spec"]["strategy"] for row in read_rows([tmp_path / "ab" / "new-strategies.jsonl"])] == ["ddp-copy"]
    assert any("new: ddp-copy (nothing to compare" in line for line in lines)
    assert lines[-1].startswith("A/B tier: ") and lines[-1].endswith("; its launches' budget 620 s a run")


@pytest.mark.launch
def test_a_new_strategy_that_does_not_run_fails_the_tier_before_any_pair(project, tmp_path):
    _commit(project, "harness/strategies/__init__.py", _add_ddp_copy)
    launch = RowLaunch(failing=("ddp-copy",))
    result, = measure(project, tmp_path / "ab", launch=launch, say=lambda line: None)
    assert result.outcome is Outcome.FAILED and result.exit_status == 1 and len(launch.launches) == 1
    assert result.reason.startswith("a strategy new on this side did not run: new-only launch: gpt-tiny/ddp-copy/ws2")


@pytest.mark.launch
def test_strategies_named_by_hand_reach_each_side_only_where_it_has_them(project, tmp_path):
    _commit(project, "harness/strategies/__init__.py", _add_ddp_copy)
    launch = RowLaunch()
    measure(project, tmp_path / "ab", strategies=["ddp-copy", "ddp"], min_launches=4, launch=launch, say=lambda l: None)
    assert launch.launches[0] == ("new-only", project, ("ddp-copy",))
    assert {strategies for _, _, strategies in launch.launches[1:]} == {("ddp",)}


# ---- what a cell runs: its launcher, its workload, its family's shared module ---------------------------------------


@pytest.mark.launch
def test_a_change_to_deepspeeds_launcher_touches_the_strategies_it_starts(project):
    base = _git(project, "rev-parse", "HEAD")
    _commit(project, "harness/launch/launcher/deepspeed.py", _append_comment)
    assert touched_strategies(project, base, BUILT_IN) == {name: ["harness/launch/launcher/deepspeed.py"]
                                                           for name in LAUNCHED_BY_DEEPSPEED}


@pytest.mark.launch
def test_a_change_to_the_llama_touches_no_gpt_tiny_cell_and_one_to_the_gpt_touches_every_strategy(project):
    base = _git(project, "rev-parse", "HEAD")
    _commit(project, "workloads/llama.py", _append_comment)
    assert touched_strategies(project, base, BUILT_IN, workload="gpt-tiny") == {}
    assert set(touched_strategies(project, base, BUILT_IN, workload="llama-tiny")) == set(BUILT_IN)
    _commit(project, "workloads/gpt.py", _append_comment)
    assert set(touched_strategies(project, base, BUILT_IN, workload="gpt-tiny")) == set(BUILT_IN)


@pytest.mark.launch
def test_a_change_to_deepspeed_common_times_zero_1_2_3_and_names_the_others(project):
    base = _git(project, "rev-parse", "HEAD")
    head = _commit(project, "harness/strategies/deepspeed_common.py", _append_comment)
    choice = select_cells(project, base, head)
    assert choice.timed == ("zero1", "zero2", "zero3") and choice.launches == 5
    assert set(choice.left_out) == {"pipeline", "autotp", "ulysses", "ddp", "deepspeed-moe"}
    assert all(choice.left_out[name].startswith("its own code changed, but past the 1000-s budget")
               for name in ("pipeline", "autotp", "ulysses"))
    # DeepSpeed-MoE runs deepspeed_common.py too, but its cell skips gpt-tiny: named with the reason, not timed.
    assert choice.left_out["deepspeed-moe"].startswith("its cell skips gpt-tiny (expert parallelism shards")


@pytest.mark.launch
def test_a_change_to_expert_parallelism_times_ddp_and_names_why_the_expert_strategies_are_not_timed(project):
    # ep, horovod-ep and deepspeed-moe lay out an MoE model's experts: their gpt-tiny cell ends skipped on both sides,
    # so the gate would judge nothing of them (CI failed on the skipped rows); named with the reason, never launched.
    base = _git(project, "rev-parse", "HEAD")
    head = _commit(project, "harness/strategies/expert_parallel.py", _append_comment)
    assert set(touched_strategies(project, base, BUILT_IN, workload="gpt-tiny")) == {"ep", "horovod-ep",
                                                                                     "deepspeed-moe"}
    choice = select_cells(project, base, head)
    assert choice.timed == ("ddp",) and choice.new == ()
    because = "its cell skips gpt-tiny (expert parallelism shards an MoE model's experts: gpt-tiny has none)"
    assert {name: why.split(": nothing")[0] for name, why in choice.left_out.items()} == {
        "ep": because, "horovod-ep": because, "deepspeed-moe": because}
    assert f"not timed: ep ({because}: nothing to time here" in choice.describe()


@pytest.mark.launch
def test_a_new_strategy_whose_cell_skips_gpt_tiny_is_named_and_not_launched_to_prove_nothing(project):
    # The base lacks ep (its entry taken out); this side registers it, as the commit that added it did.
    entry = '    "ep": ExpertParallel(),\n'
    base = _commit(project, "harness/strategies/__init__.py", lambda text: text.replace(entry, ""))
    head = _commit(project, "harness/strategies/__init__.py",
                   lambda text: text.replace('    "horovod-ep"', entry + '    "horovod-ep"'))
    choice = select_cells(project, base, head)
    assert choice.timed == ("ddp",) and choice.new == ()
    assert choice.left_out["ep"].startswith("new; its cell skips gpt-tiny (expert parallelism shards")
    assert "horovod-ep" not in choice.left_out      # in both registries, and untouched: nothing to say of it


@pytest.mark.launch
def test_the_budget_ci_leaves_the_tier_is_the_change_s(project):
    # .ci/run asks before its launch tier (`harness ab --print-budget`): nothing to measure against on a root commit;
    # 620 s for a change to base.py (DDP and one touched strategy in turn); 984.4 s where deepspeed_common.py changed.
    assert planned_budget(project) == 0.0
    _commit(project, "harness/strategies/base.py", _append_comment)
    assert planned_budget(project) == AB_BUDGET_S == 620.0
    _commit(project, "harness/strategies/deepspeed_common.py", _append_comment)
    assert planned_budget(project) == pytest.approx(984.4)
    # Capped at 900 s (what a slower make test leaves), ZeRO-3 does not fit beside ZeRO-1/2 (984.4 s), and the next
    # in the registry that does is taken: the pipeline, 9 metrics at 5 a side, 1.15 x 2 x 5 x (4.0 + 25.1 + 25.0 +
    # 22.7) = 883.2 s. At 100 s not even DDP at 3 a side fits (1.15 x 2 x 3 x 18.8 = 129.7 s): the tier would judge
    # nothing, and asks for nothing.
    assert planned_budget(project, cap_s=900) == pytest.approx(883.2)
    assert planned_budget(project, cap_s=100) == 0.0


def test_the_strategies_a_family_module_reaches_are_timed_in_the_registry_s_order_whatever_the_commit():
    # deepspeed_common.py reaches ZeRO-1/2/3, the pipeline and AutoTP, all must-time, taken in the registry's order
    # while they fit 1,000 s at the gate's least launches, planned at 1.15 times the estimate: ZeRO-1/2/3, 9 metrics at
    # 5 a side, 1.15 x 2 x 5 x (4.0 + 25.1 + 25.0 + 31.5) = 984.4 s; the pipeline after them (12 metrics, still 5),
    # 1.15 x 2 x 5 x (85.6 + 22.7) = 1,245.5 s, and AutoTP, 1.15 x 2 x 5 x (85.6 + 30.9) = 1,339.8 s, do not fit, nor
    # DDP (1,154.6 s), nor tp, touched only through base.py. The same for every head commit: never turned.
    assert "harness/strategies/deepspeed_common.py" in FAMILY_MODULES
    touched = {name: ["harness/strategies/deepspeed_common.py"] for name in DEEPSPEED}
    must = must_time(ROOT, touched, STRATEGIES)
    assert set(must) == set(DEEPSPEED)
    assert estimated_seconds(["zero1", "zero2", "zero3"], 5) == pytest.approx(856.0)
    for rotation in range(len(DEEPSPEED)):
        choice = choose_cells({**touched, "tp": ["harness/strategies/base.py"]}, must, rotation=rotation)
        assert choice.timed == ("zero1", "zero2", "zero3") and choice.budget_s == pytest.approx(984.4)
        assert set(choice.left_out) == {"pipeline", "autotp", "ddp", "tp"}
        assert all(choice.left_out[name].startswith("its own code changed, but past the 1000-s budget")
                   for name in ("pipeline", "autotp"))


def test_a_strategy_touched_only_through_a_common_module_is_not_must_time():
    touched = {name: ["harness/strategies/base.py"] for name in DEEPSPEED}
    assert must_time(ROOT, touched, STRATEGIES) == {}


# ---- a real run: `python -m harness ab` on a branch that registers a copy of DDP ----------------------------------


@pytest.fixture
def whole_project(tmp_path: Path) -> Path:
    """A repository holding this checkout's files as they are (committed or not, git's ignored files left out),
    committed once: the base."""
    repo = tmp_path / "whole"
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True, text=True).stdout
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    return repo


@pytest.mark.launch
def test_harness_ab_on_a_branch_that_adds_a_copy_of_ddp_passes_timing_ddp_on_both_sides(whole_project, tmp_path):
    # Step-time thresholds of 100%: the test is of which cells run where, not of this machine's load.
    _commit(whole_project, "harness/strategies/__init__.py", _add_ddp_copy)
    out = tmp_path / "ab"
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "harness", "ab", "--out", str(out), "--launches", "3",
                           "--threshold", "step_time_unstalled_median_s=1", "--threshold",
                           "step_time_unstalled_fastest_s=1", "--threshold", "peak_rss_bytes_max=1"],
                          cwd=whole_project, env={**os.environ, "PYTHONPATH": str(whole_project)},
                          capture_output=True, text=True, timeout=420)
    print(f"harness ab on a branch adding ddp-copy: {time.monotonic() - began:.0f} s wall")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "new: ddp-copy (nothing to compare" in done.stdout and "A/B run 1/1: pass:" in done.stdout
    assert {row["spec"]["strategy"] for row in read_rows([out / "base.jsonl"])} == {"ddp"}
    assert {row["spec"]["strategy"] for row in read_rows([out / "new.jsonl"])} == {"ddp"}
    assert [row["spec"]["strategy"] for row in read_rows([out / "new-strategies.jsonl"])] == ["ddp-copy"]
