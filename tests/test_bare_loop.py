"""The bare loop (harness.strategies.bare, harness.rank.bare_loop) and the harness's own cost it bounds
(harness.derive.harness_overhead): the plain loop's mean step over the bare loop's, held to 3% in the report.

Launched: the plain loop and the bare loop on gpt-tiny in fp32 at world size 1 (2 launches, a few seconds each), and
the plain loop again with every step made 3 times longer (`slow-step`, harness.rank.faults) beside a second bare loop
in the same stream, which, reading no fault, does not take it. The verdicts' wording is judged on hand-made figures.
"""

from __future__ import annotations

import copy
import math
from statistics import fmean

import pytest

from harness.derive.cells import cell_table
from harness.derive.harness_overhead import OVERHEAD_LIMIT, harness_overhead
from harness.derive.identity import cell_identity
from harness.derive.parity import Verdict, judge
from harness.matrix import Machine, Selection, build_matrix
from harness.rank.faults import FAULT_ENV
from harness.report.verdicts import verdicts
from harness.spec import DeviceKind
from launch_streams import Stream, run_streams

AT_1 = ("--workload", "gpt-tiny", "--world-sizes", "1", "--strategy")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    streams = [Stream("plain-and-bare", (*AT_1, "plain,bare")),
               Stream("plain-slowed", (*AT_1, "plain,bare"),
                      {FAULT_ENV: "slow-step:factor=3:rank=all:step=0:strategy=plain"})]
    found = run_streams(tmp_path_factory.mktemp("bare"), streams)
    honest = {row.spec.strategy: row.to_dict() for row in found["plain-and-bare"]}
    slowed = {row.spec.strategy: row.to_dict() for row in found["plain-slowed"]}
    return honest["plain"], honest["bare"], slowed


def test_the_wide_matrix_has_the_bare_loop_beside_the_plain_loop_at_world_size_1():
    specs = build_matrix("wide", Machine(device=DeviceKind.CPU, devices_per_node=2), Selection())
    for workload in ("gpt-tiny", "resnet20-cifar"):
        assert {(s.strategy, s.world_size) for s in specs if s.workload == workload} >= {("plain", 1), ("bare", 1)}
    assert not [s for s in build_matrix("ci", Machine(device=DeviceKind.CPU, devices_per_node=2)) if s.strategy == "bare"]


@pytest.mark.launch
def test_the_bare_loop_trains_exactly_as_the_plain_loop_with_nothing_instrumented(launched):
    plain, bare, _ = launched
    assert bare["status"] == "ok", bare["message"]
    m = bare["measurements"]
    # The same arithmetic bit for bit on this CPU: the same weights, data and step.
    assert m["loss_per_step"] == plain["measurements"]["loss_per_step"]
    assert m["loop_steps"] == bare["spec"]["timed_steps"] and m["loop_time_s"] > 0
    # One clock around its steps, and none of the worker's instruments: no per-step times, counts, census or norms.
    for measured in ("step_time_s", "comm_per_step_by_rank", "model_state_census_bytes_by_rank",
                     "gradient_norm_first_step", "saved_activation_bytes_by_rank"):
        assert measured not in m, measured
    assert m["parameters"] == plain["measurements"]["parameters"]
    assert m["strategy_config"] == plain["measurements"]["strategy_config"]
    parity = judge([plain, bare])[1]
    assert parity.verdict is Verdict.MATCH and "judged on losses alone" in parity.note


@pytest.mark.launch
def test_the_harness_overhead_is_the_plain_mean_step_over_the_bare_loops(launched):
    plain, bare, slowed = launched
    # By hand from the rows: the mean of plain's timed steps over the bare loop's time per step (3 timed steps here).
    assert bare["measurements"]["loop_steps"] == 3
    expected = fmean(plain["measurements"]["step_time_s"]) / (bare["measurements"]["loop_time_s"] / 3) - 1
    cells = cell_table([plain, bare]).set_index("strategy")
    assert cells.loc["plain", "harness_overhead_share"] == pytest.approx(expected, rel=1e-12)
    assert cells.loc["bare", "harness_overhead_share"] == pytest.approx(expected, rel=1e-12)
    # A plain loop 3 times slower is 200% over the bare loop's step, measured against a bare loop launched beside it.
    # Not a timing test: launch-to-launch spread on a 2-core VM under load reached 20% (a 1.3x plant once read 11%);
    # this holds unless the bare launch runs 2.6 times slower than the plain one, and the planted cost shows far
    # over the limit. Without the plant (the bare loop reading the fault too, or the sleep dropped) it reads near 0.
    assert slowed["bare"]["status"] == "ok", slowed["bare"]["message"]
    assert "step_time_s" not in slowed["bare"]["measurements"]
    slowed_cells = cell_table([slowed["plain"], slowed["bare"]]).set_index("strategy")
    assert slowed_cells.loc["plain", "harness_overhead_share"] > 0.15 > OVERHEAD_LIMIT


def _rows(plain_means_s: list[float], bare_means_s: list[float]) -> list[dict]:
    """Hand-made ok rows: plain launches whose 10 timed steps each take the given time, bare launches whose loop of
    10 steps takes 10 times it."""
    template = {"status": "ok", "message": "", "measurements": {"loss_per_step": [1.0] * 13},
                "spec": {"workload": "gpt-tiny", "world_size": 1, "global_batch": 16, "micro_batch": 4,
                         "precision": "fp32", "seed": 0, "device": "cpu", "warmup_steps": 3, "timed_steps": 10,
                         "nnodes": 1, "options": {}}}
    rows = []
    for index, (strategy, mean) in enumerate([("plain", m) for m in plain_means_s] + [("bare", m) for m in bare_means_s]):
        row = copy.deepcopy(template)
        row["spec"]["strategy"], row["run_id"], row["repeat"] = strategy, f"{strategy}-{index}", index
        row["measurements"].update({"step_time_s": [mean] * 10} if strategy == "plain"
                                   else {"loop_time_s": mean * 10, "loop_steps": 10})
        rows.append(row)
    return rows


def _harness_line(rows: list[dict]) -> str:
    found = [line for group in verdicts(cell_table(rows)).groups for line in group.lines if "Harness overhead" in line]
    assert len(found) == 1, found
    return found[0]


def test_the_overhead_of_several_launches_is_the_ratio_of_each_sides_median():
    figures = harness_overhead(*[[r for r in _rows([0.0105, 0.0103, 0.0110], [0.0100, 0.0102, 0.0099])
                                  if r["spec"]["strategy"] == side] for side in ("plain", "bare")])
    assert figures["harness_overhead_share"] == pytest.approx(0.0105 / 0.0100 - 1)      # medians 10.5 and 10.0 ms
    assert (figures["harness_plain_step_low_s"], figures["harness_bare_step_high_s"]) == (0.0103, 0.0102)


def test_an_overhead_whose_interval_lies_under_the_limit_is_within_it():
    # 5 launches a side, plain 10.2 ms and bare 10.0 ms each: every ratio is 1.02, so the interval is +2.0% to +2.0%.
    line = _harness_line(_rows([0.0102] * 5, [0.0100] * 5))
    assert "Harness overhead: +2.0%" in line and "within the 3% limit (96.8% interval +2.0% to +2.0%)" in line


def test_a_planted_10_percent_cost_at_the_launches_asked_for_is_over_the_limit():
    # Issue 61: a cost was called only where every plain launch was 3% slower than every bare one. Plain 11.0-11.2 ms,
    # bare 10.0-10.2 ms, 5 a side: the 25 ratios' 3rd smallest is 11.05 / 10.2 (11.0/10.2 = 1.0784, 11.0/10.15 =
    # 1.0837, 11.05/10.2 = 1.0833 sorted: 1.0784, 1.0833, 1.0837...), over 1.03.
    plain, bare = [0.0110, 0.01105, 0.0111, 0.01115, 0.0112], [0.0100, 0.01005, 0.0101, 0.01015, 0.0102]
    line = _harness_line(_rows(plain, bare))
    low = sorted(p / b for p in plain for b in bare)[2] - 1
    assert low == pytest.approx(0.011 / 0.01015 - 1)
    assert f"OVER the 3% limit (96.8% interval {low:+.1%} to" in line


def test_overlapping_launches_are_inconclusive_not_a_verdict_either_way():
    # Medians 10.35 and 9.85 ms: +5.1%, but the launches overlap: the ratios' 3rd smallest is 10.03 / 9.99 = +0.4%
    # (10.0 / 9.99, 10.0 / 9.9, 10.03 / 9.99: 1.0010, 1.0101, 1.0040 sorted 1.0010, 1.0040, 1.0101...), under 3%, and the
    # 23rd is over it: neither within nor over.
    line = _harness_line(_rows([0.0100, 0.0103, 0.01035, 0.0104, 0.0105], [0.0097, 0.0098, 0.00985, 0.0099, 0.00999]))
    assert "+5.1%" in line and "inconclusive: its 96.8% interval" in line and "reaches both sides of the 3% limit" in line
    # Three launches a side give no 95% interval at all (one of the C(6, 3) = 20 orderings is already 5%).
    three = _harness_line(_rows([0.0090, 0.0110, 0.0120], [0.0095, 0.0100, 0.0115]))
    assert "+10.0%" in three and "inconclusive: 3 plain and 3 bare launches give no 95% interval" in three
    single = _harness_line(_rows([0.0110], [0.0100]))
    assert "inconclusive: 1 plain and 1 bare launches" in single and "--repeats 5" in single


def test_the_overhead_interval_covers_the_true_cost_as_often_as_it_says():
    # Launch-to-launch noise simulated as log-normal (sigma 3% a launch), seeded: the verdict is "over" for a true
    # cost of 0 at most 2.5% of the time (one tail of a 96.8% interval), and for a true 10% cost at 5 launches a side
    # most of the time, where "every plain launch 3% over every bare one" needed all 25 pairs apart.
    import random

    from harness.derive.harness_overhead import Verdict, overhead_interval, overhead_verdict

    rng = random.Random(61)

    def verdict(cost: float) -> Verdict:
        plain = [10.0 * (1 + cost) * math.exp(rng.gauss(0, 0.03)) for _ in range(5)]
        bare = [10.0 * math.exp(rng.gauss(0, 0.03)) for _ in range(5)]
        low, high, confidence = overhead_interval(plain, bare)
        return overhead_verdict({"harness_overhead_low": low, "harness_overhead_high": high,
                                 "harness_overhead_confidence": confidence})[0]

    trials = 2000
    false_costs = sum(verdict(0.0) is Verdict.OVER for _ in range(trials)) / trials
    found = sum(verdict(0.10) is Verdict.OVER for _ in range(trials)) / trials
    assert false_costs <= 0.025 and found > 0.5, (false_costs, found)


def test_the_plain_loop_is_paired_with_the_bare_loop_of_its_own_cell_alone():
    # A bare cell of other steps (8 warm-up + 5 timed, 13 in all, as the plain loop's 3 + 10) is another cell: no
    # figure for it, and the plain loop's is its own bare loop's.
    rows = _rows([0.0100], [0.0100])
    other = copy.deepcopy(rows[-1])
    other["spec"].update(warmup_steps=8, timed_steps=5)
    other["run_id"] = "bare-other"
    other["measurements"].update(loop_time_s=0.0050 * 5, loop_steps=5)
    cells = cell_table(rows + [other]).set_index("cell_id")["harness_overhead_share"]
    assert cells[cell_identity(rows[0])] == cells[cell_identity(rows[1])] == 0.0      # 10 ms and 10 ms
    assert cells[cell_identity(other)] != cells[cell_identity(other)]                 # NaN: no plain loop of its own


def test_the_bare_loop_is_not_among_the_strategies_the_verdicts_rank():
    rows = _rows([0.0110], [0.0050])      # the bare loop "faster" than anything: not an answer to which to choose
    fastest = verdicts(cell_table(rows)).groups[0].fastest
    assert fastest.first.name == "plain" and fastest.second is None
