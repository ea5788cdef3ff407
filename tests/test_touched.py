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
    # DDP alone, 8 a side: 2 x 8 x (4.0 + 14.8) = 300.8 s; with ZeRO-2, 2 x 8 x (4.0 + 14.8 + 25.0) = 700.8 s.
    assert estimated_seconds(["ddp"], 8) == pytest.approx(300.8)
    assert estimated_seconds(["ddp", "zero2"], 8) == pytest.approx(700.8)


def test_ddp_alone_takes_eight_launches_a_side():
    choice = choose_cells({}, set())
    assert choice.timed == ("ddp",) and choice.launches == AB_LAUNCHES == 8 and not choice.left_out


def test_a_change_to_zero_times_its_stages_in_turn_beside_ddp_and_names_the_rest_left_out():
    # DDP and one stage, 2 cells x 3 metrics = 6: the gate needs 1 / C(2n, n) <= 0.05 / 6 = 0.00833, so n >= 5
    # (1 / 252 = 0.00397; at 4, 1 / 70 = 0.0143). ZeRO-1 at 5 a side: 2 x 5 x (4.0 + 14.8 + 25.1) = 439 s <= 540, at 6
    # 526.8 s <= 540, at 7 614.6 s > 540. A second stage: 9 metrics, still 5 a side: 2 x 5 x (4.0 + 14.8 + 25.1 + 25.0)
    # = 689 s > 540. ZeRO-3 first: 2 x 5 x (4.0 + 14.8 + 31.5) = 503 s, at 6 603.6 s: 5 a side.
    touched = {name: ["harness/strategies/zero.py"] for name in ("zero1", "zero2", "zero3", "autotp")}
    must = {"zero1", "zero2", "zero3"}
    firsts = {}
    for rotation in range(3):
        choice = choose_cells(touched, must, rotation=rotation)
        assert len(choice.timed) == 2 and choice.timed[0] == "ddp"
        firsts[choice.timed[1]] = choice.launches
        # AutoTP only imports zero.py: after the stages whose own module changed, never before them.
        assert list(choice.left_out)[-1] == "autotp" and "budget" in choice.left_out["autotp"]
        assert all("its own code changed, but past" in choice.left_out[name] for name in must - set(choice.timed))
    assert firsts == {"zero1": 6, "zero2": 6, "zero3": 5}
    assert estimated_seconds(("ddp", "zero1"), 6) == pytest.approx(526.8) and 526.8 <= AB_BUDGET_S
    assert estimated_seconds(("ddp", "zero3"), 5) == pytest.approx(503.0)
    assert estimated_seconds(("ddp", "zero3"), 6) == pytest.approx(603.6) and 503.0 <= AB_BUDGET_S < 603.6


def test_the_rotation_gives_each_touched_strategy_its_turn_and_dataparallel_is_left_out_with_its_reason():
    touched = {name: ["harness/strategies/base.py"] for name in STRATEGIES}
    firsts = {choose_cells(touched, set(), rotation=k).timed[1] for k in range(len(STRATEGIES))}
    assert firsts == set(STRATEGIES) - {"ddp", "dataparallel"}
    choice = choose_cells(touched, set())
    assert "CUDA" in choice.left_out["dataparallel"]
    assert launches_a_side(choice.timed) == choice.launches and estimated_seconds(choice.timed, choice.launches) <= AB_BUDGET_S
