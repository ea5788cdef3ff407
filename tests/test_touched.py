"""Which strategies a change touches (harness/touched.py), and which of them the A/B tier times within its budget
(harness/ab.py, choose_cells): worked out here from the project's own imports and the tier's measured launch times."""

import shutil
import subprocess
from pathlib import Path

import pytest

from harness.ab import (AB_BUDGET_S, AB_LAUNCHES, AB_MUST_TIME_BUDGET_S, choose_cells, estimated_seconds,
                        launches_a_side, planned_seconds)
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
def test_a_change_to_zero_touches_the_three_stages_autotp_deepspeed_moe_and_ulysses_and_nothing_else(repo):
    # DeepSpeed-MoE and Ulysses are ZeRO strategies (harness/strategies/deepspeed_moe.py and ulysses.py subclass it).
    with (repo / "harness" / "strategies" / "zero.py").open("a") as f:
        f.write("# a change\n")
    assert touched_strategies(repo, "HEAD", STRATEGIES) == {
        name: ["harness/strategies/zero.py"] for name in ("zero1", "zero2", "zero3", "autotp", "deepspeed-moe",
                                                          "ulysses")}


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


def test_a_change_to_zero_times_all_three_stages_at_the_gates_least_launches_in_a_raised_budget():
    # The three stages whose own module changed, 3 cells x 3 metrics = 9: the gate needs 1 / C(2n, n) <= 0.05 / 9 =
    # 0.00556, so n >= 5 (1 / 252 = 0.00397; at 4, 1 / 70 = 0.0143). Planned at 1.15 times the estimate:
    # 1.15 x 2 x 5 x (4.0 + 25.1 + 25.0 + 31.5) = 1.15 x 856 = 984.4 s <= 1,000, at 6 1,181.3 s. DDP beside them, 12
    # metrics, still 5 a side: 1.15 x 2 x 5 x (4.0 + 14.8 + 25.1 + 25.0 + 31.5) = 1,154.6 s > 1,000, left out. AutoTP,
    # which only imports zero.py, is no stage's: touched, and past the 984.4 s budget beside them. Never turned.
    touched = {name: ["harness/strategies/zero.py"] for name in ("zero1", "zero2", "zero3", "autotp")}
    must = {"zero1", "zero2", "zero3"}
    for rotation in range(4):
        choice = choose_cells(touched, must, rotation=rotation)
        assert choice.timed == ("zero1", "zero2", "zero3") and choice.launches == 5
        assert choice.budget_s == pytest.approx(984.4)
        assert set(choice.left_out) == {"ddp", "autotp"}
        assert "past the 1000-s budget beside zero1, zero2, zero3" in choice.left_out["ddp"]
        assert choice.left_out["autotp"] == "touched, but past the tier's 984-s budget with the cells above"
    assert planned_seconds(("zero1", "zero2", "zero3"), 5) == pytest.approx(984.4)
    assert planned_seconds(("zero1", "zero2", "zero3"), 6) == pytest.approx(1181.28)
    with_ddp = planned_seconds(("ddp", "zero1", "zero2", "zero3"), 5)
    assert with_ddp == pytest.approx(1154.6) and with_ddp > AB_MUST_TIME_BUDGET_S


def test_one_strategy_s_own_change_is_timed_beside_ddp_in_the_usual_budget():
    # FSDP2 alone would need 4 a side (3 metrics: 1 / 70 <= 0.05 / 3): 1.15 x 2 x 4 x (4.0 + 20.9) = 229.1 s, under
    # the usual 620 s, which is then the budget. Beside DDP, 6 metrics, 5 a side at least: 1.15 x 2 x n x (4.0 + 14.8 +
    # 20.9) = 91.31 n s: 547.9 at 6 <= 620 < 639.2 at 7, so 6 a side.
    choice = choose_cells({"fsdp2": ["harness/strategies/fsdp2.py"]}, {"fsdp2"})
    assert choice.timed == ("ddp", "fsdp2") and choice.launches == 6 and choice.budget_s == AB_BUDGET_S == 620
    assert planned_seconds(("ddp", "fsdp2"), 6) == pytest.approx(547.86)
    assert planned_seconds(("ddp", "fsdp2"), 7) == pytest.approx(639.17)


def test_a_pair_of_one_family_is_timed_with_ddp_in_the_budget_they_need():
    # tp.py is tp's own module and FSDP2+TP's family module: 1.15 x 2 x 5 x (4.0 + 32.3 + 34.9) = 818.8 s; with DDP
    # (9 metrics, 5 a side) 1.15 x 2 x 5 x (4.0 + 14.8 + 32.3 + 34.9) = 989 s <= 1,000: all three, in 989 s.
    touched = {name: ["harness/strategies/tp.py"] for name in ("tp", "fsdp2-tp")}
    choice = choose_cells(touched, set(touched))
    assert choice.timed == ("ddp", "tp", "fsdp2-tp") and choice.launches == 5
    assert choice.budget_s == pytest.approx(989.0) and not choice.left_out


def test_the_rotation_gives_each_touched_strategy_its_turn_and_dataparallel_is_left_out_with_its_reason():
    touched = {name: ["harness/strategies/base.py"] for name in STRATEGIES}
    firsts = {choose_cells(touched, set(), rotation=k).timed[1] for k in range(len(STRATEGIES))}
    assert firsts == set(STRATEGIES) - {"ddp", "dataparallel"}
    choice = choose_cells(touched, set())
    assert "CUDA" in choice.left_out["dataparallel"]
    assert launches_a_side(choice.timed) == choice.launches and planned_seconds(choice.timed, choice.launches) <= AB_BUDGET_S
    # The slowest beside DDP, FSDP2+TP, at 5 a side: 1.15 x 2 x 5 x (4.0 + 14.8 + 34.9) = 617.55 s <= 620.
    slowest = planned_seconds(("ddp", "fsdp2-tp"), 5)
    assert slowest == pytest.approx(617.55) and slowest <= AB_BUDGET_S
