"""Which strategies a change touches (harness/touched.py), and which of them the A/B tier times within its budget
(harness/ab.py, choose_cells): worked out here from the project's own imports and the tier's measured launch times."""

import shutil
import subprocess
from pathlib import Path

import pytest

from harness.ab import AB_BUDGET_S, AB_LAUNCHES, choose_cells, estimated_seconds, launches_a_side
from harness.strategies import STRATEGIES
from harness.touched import strategy_files, touched_strategies

ROOT = Path(__file__).resolve().parents[1]


def test_a_strategy_runs_its_module_and_what_it_imports_but_not_the_other_strategies():
    files = strategy_files(ROOT, STRATEGIES)
    assert "harness/strategies/zero.py" in files["zero2"] and "harness/strategies/deepspeed_common.py" in files["zero2"]
    assert "harness/strategies/base.py" in files["zero2"] and "workloads/gpt.py" in files["zero2"]
    # AutoTP builds on ZeRO's engine; DDP and FSDP2 import nothing of DeepSpeed's.
    assert "harness/strategies/zero.py" in files["autotp"]
    assert "harness/strategies/zero.py" not in files["ddp"] | files["fsdp2"] | files["horovod"]
    # The registry (harness/strategies/__init__.py, importing every strategy) counts as a file, not as their imports.
    assert "harness/strategies/ddp.py" not in files["zero2"] and "harness/strategies/__init__.py" in files["zero2"]
    # The rank's loop imports the strategies, not the other way: a change to it is DDP's to time.
    assert "harness/rank/worker.py" not in files["ddp"]


@pytest.fixture
def repo(tmp_path):
    """A repository with a copy of the project's harness/ and workloads/, committed (git: tests marked `launch`)."""
    for folder in ("harness", "workloads"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], check=True)
    return tmp_path


@pytest.mark.launch
def test_a_change_to_zero_touches_the_three_stages_and_autotp_and_nothing_else(repo):
    with (repo / "harness" / "strategies" / "zero.py").open("a") as f:
        f.write("# a change\n")
    assert touched_strategies(repo, "HEAD", STRATEGIES) == {
        name: ["harness/strategies/zero.py"] for name in ("zero1", "zero2", "zero3", "autotp")}


@pytest.mark.launch
def test_a_change_to_the_rank_loop_touches_no_strategy_and_one_to_base_touches_all(repo):
    with (repo / "harness" / "rank" / "worker.py").open("a") as f:
        f.write("# a change\n")
    assert touched_strategies(repo, "HEAD", STRATEGIES) == {}
    with (repo / "harness" / "strategies" / "base.py").open("a") as f:
        f.write("# a change\n")
    # The project's own strategies (another test may have registered one of its own, which the copy does not hold).
    built_in = {name: cls for name, cls in STRATEGIES.items() if cls.__module__.startswith("harness.")}
    assert set(touched_strategies(repo, "HEAD", built_in)) == set(built_in)


def test_the_estimate_is_launches_times_both_sides_times_harness_start_and_each_cell():
    # DDP alone, 8 a side: 2 x 8 x (1.8 + 5.2) = 112 s; with ZeRO-2, 2 x 8 x (1.8 + 5.2 + 10.6) = 281.6 s.
    assert estimated_seconds(["ddp"], 8) == pytest.approx(112.0)
    assert estimated_seconds(["ddp", "zero2"], 8) == pytest.approx(281.6)


def test_ddp_alone_takes_eight_launches_a_side():
    choice = choose_cells({}, set())
    assert choice.timed == ("ddp",) and choice.launches == AB_LAUNCHES == 8 and not choice.left_out


def test_a_change_to_zero_times_every_stage_at_five_launches_and_names_autotp_left_out():
    # 4 cells x 3 metrics = 12: the gate needs 1 / C(2n, n) <= 0.05 / 12 = 0.00417, so n >= 5 (1 / 252 = 0.00397);
    # at 5 a side: 2 x 5 x (1.8 + 5.2 + 10.7 + 10.6 + 13.0) = 413 s <= 420; at 6, 495.6 s > 420.
    touched = {name: ["harness/strategies/zero.py"] for name in ("zero1", "zero2", "zero3", "autotp")}
    choice = choose_cells(touched, {"zero1", "zero2", "zero3"}, rotation=1)
    assert set(choice.timed) == {"ddp", "zero1", "zero2", "zero3"} and choice.launches == 5
    # AutoTP only imports zero.py, so it comes after the stages whose own module changed, and does not fit.
    assert list(choice.left_out) == ["autotp"] and "budget" in choice.left_out["autotp"]
    assert estimated_seconds(choice.timed, 5) == pytest.approx(413.0)
    assert estimated_seconds(choice.timed, 5) <= AB_BUDGET_S < estimated_seconds(choice.timed, 6)


def test_the_rotation_gives_each_touched_strategy_its_turn_and_dataparallel_is_left_out_with_its_reason():
    touched = {name: ["harness/strategies/base.py"] for name in STRATEGIES}
    firsts = {choose_cells(touched, set(), rotation=k).timed[1] for k in range(len(STRATEGIES))}
    assert firsts == set(STRATEGIES) - {"ddp", "dataparallel"}
    choice = choose_cells(touched, set())
    assert "CUDA" in choice.left_out["dataparallel"]
    assert launches_a_side(choice.timed) == choice.launches and estimated_seconds(choice.timed, choice.launches) <= AB_BUDGET_S
