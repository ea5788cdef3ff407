"""The regression gate on rows built from a real one: per-launch values, the rule, what is not judged.

Every row here is the committed reference row (results/reference/ci-cpu/smoke.jsonl) with its step times,
stalls and memory replaced, so the outcome is fixed by the values written below, never by timing noise.
"""

import dataclasses
import itertools
import random
from math import comb, sqrt
from pathlib import Path

import pytest

from harness.cli import main
from harness.derive.gate import (METRICS, STEP_TIME_THRESHOLDS, MetricValues, Verdict, chance_of_firing, gate, holm,
                                 tail_probability,
                                 judge, judge_metrics, launches_needed_a_side)
from harness.record import append_row, read_results
from harness.spec import DeviceKind, RunResult, Status

REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference" / "ci-cpu" / "smoke.jsonl"
STEP_TIME = METRICS[0]
MIB = 1 << 20

# The within-launch shape of 5 timed steps (RunSpec's default count) relative to the launch's median, with
# the second step stalled by the host: 4 unstalled steps spread -25%..+40%, as steps of one launch spread
# on the loaded 2-core VM (docs/methodology.md, "The regression gate"). Their median is exactly the launch's.
STEP_SHAPE = (0.75, None, 0.95, 1.05, 1.40)
STALL_S = 1.2


def _reference(strategy: str) -> RunResult:
    return next(r for r in read_results([REFERENCE]) if r.spec.strategy == strategy)


def _launch(template: RunResult, repeat: int, step_ms: float | None = None, rss_mib: float | None = None,
            exposed: float | None = None, all_stalled: bool = False) -> RunResult:
    """`template` with one launch's values: its unstalled median step time, peak RSS and exposed share."""
    m = dict(template.measurements)
    if step_ms is not None:
        steps = [STALL_S if f is None or all_stalled else step_ms / 1e3 * f for f in STEP_SHAPE]
        stalled = list(range(len(steps))) if all_stalled else [i for i, f in enumerate(STEP_SHAPE) if f is None]
        m.update(step_time_s=steps, host_stalled_step_indices=stalled, host_stalled_steps=len(stalled),
                 step_time_median_s=sorted(steps)[len(steps) // 2])
    if rss_mib is not None:
        m.update(peak_rss_bytes_max=rss_mib * MIB, peak_rss_bytes_by_rank=[rss_mib * MIB])
    if exposed is not None:
        m["exposed_comm_share"] = exposed
    spec = template.spec.replace(timed_steps=len(STEP_SHAPE), repeats=4)
    return dataclasses.replace(template, spec=spec, measurements=m, repeat=repeat,
                               run_id=f"{template.run_id[:8]}-{repeat}-{step_ms}-{rss_mib}-{exposed}")


def _write(path: Path, rows: list[RunResult]) -> Path:
    for row in rows:
        append_row(path, row)
    return path


# Four launches a side: the plain loop's two metrics (step time, peak RSS) are a family of 2, which needs
# 1 / C(n + m, n) <= 0.05 / 2 = 0.025 (harness/derive/gate.py): 1 / C(8, 4) = 1/70 = 0.0143 is enough,
# 1 / C(6, 3) = 1/20 is not.
def _plain(step_ms=(40.0, 41.0, 42.0, 41.5), rss_mib=(324.0, 324.4, 324.7, 324.2), **kwargs) -> list[RunResult]:
    template = _reference("plain")
    return [_launch(template, i, s, r, **kwargs) for i, (s, r) in enumerate(zip(step_ms, rss_mib))]


def _verdicts(result) -> dict[str, Verdict]:
    return {j.metric.name: j.verdict for j in result.judgements}


# ---- the rule's false-positive probability, by enumeration ----------------------------------------------


def test_three_vs_three_fires_by_chance_once_in_twenty_orderings():
    # Unchanged software, exchangeable launches: every ordering of the 6 values is equally likely. Count
    # by brute force the orderings in which all 3 new values lie above all 3 base values: 3! * 3! = 36
    # of 6! = 720, i.e. 1/20 = 1 / C(6, 3) (C(6, 3) = 6*5*4 / 3*2*1 = 20).
    orderings = list(itertools.permutations(range(6)))
    fires = sum(min(order[3:]) > max(order[:3]) for order in orderings)
    assert (fires, len(orderings)) == (36, 720)
    # The gate's own rule (threshold 0) on the same orderings fires on exactly those.
    fired = sum(judge([v + 1.0 for v in order[:3]], [v + 1.0 for v in order[3:]], STEP_TIME, 0.0)
                is Verdict.REGRESSION for order in orderings)
    assert fired / len(orderings) == 1 / 20
    # A margin can only remove outcomes: at 10%, 1.0-6.0 spaced by 1, fewer orderings clear it.
    assert sum(judge([v + 1.0 for v in o[:3]], [v + 1.0 for v in o[3:]], STEP_TIME, 0.10)
               is Verdict.REGRESSION for o in orderings) <= 36


def test_alpha_sets_the_launches_needed_a_side():
    # 1 / C(4, 2) = 1/6 > 0.05, 1 / C(6, 3) = 1/20 <= 0.05; for 0.01: 1 / C(8, 4) = 1/70 > 0.01,
    # 1 / C(10, 5) = 1/252 <= 0.01.
    assert (comb(4, 2), comb(6, 3), comb(8, 4), comb(10, 5)) == (6, 20, 70, 252)
    assert launches_needed_a_side(0.05) == 3
    assert launches_needed_a_side(0.01) == 5


# ---- one chance for the whole comparison: the family of metrics ---------------------------------------


def test_holm_steps_down_where_bonferroni_stops():
    # k = 4 at alpha 0.05, sorted p 0.01, 0.015, 0.02, 0.04 against 0.05/4 = 0.0125, 0.05/3 = 0.0167,
    # 0.05/2 = 0.025, 0.05/1: each clears its step, so all four go (Bonferroni, 0.0125 for each, rejects
    # only 0.01). With 0.03 in place of 0.02 the third step fails (0.03 > 0.025) and stops there, though
    # 0.04 <= 0.05.
    assert holm([0.04, 0.01, 0.02, 0.015], 0.05) == [True, True, True, True]
    assert holm([0.04, 0.01, 0.03, 0.015], 0.05) == [False, True, False, True]
    assert holm([], 0.05) == []


def test_the_family_size_sets_the_launches_needed_a_side():
    # An even split judges every metric of a family of k when 1 / C(2N, N) <= 0.05 / k, with
    # C(6, 3) = 20, C(8, 4) = 70, C(10, 5) = 252, C(12, 6) = 924, C(14, 7) = 3432:
    #   k = 1:   1/20 = 0.05       <= 0.05                          -> 3
    #   k = 3:   1/70 = 0.0143     <= 0.0167;  k = 4: 0.0143 > 0.0125  -> 4, then 5
    #   k = 12:  1/252 = 0.00397   <= 0.00417; k = 13: > 0.00385       -> 5, then 6
    #   k = 46:  1/924 = 0.001082  <= 0.001087; k = 47: > 0.001064     -> 6, then 7
    #   k = 171: 1/3432 = 0.0002914 <= 0.0002924; k = 172: > 0.0002907 -> 7, then 8
    assert (comb(6, 3), comb(8, 4), comb(10, 5), comb(12, 6), comb(14, 7)) == (20, 70, 252, 924, 3432)
    needed = {k: launches_needed_a_side(0.05 / k) for k in (1, 2, 3, 4, 12, 13, 46, 47, 171, 172)}
    assert needed == {1: 3, 2: 4, 3: 4, 4: 5, 12: 5, 13: 6, 46: 6, 47: 7, 171: 7, 172: 8}


def _smoke(launches: int, plain_slower: float = 1.0) -> list[RunResult]:
    """The smoke matrix's two cells, `launches` each: the plain loop (step time, peak RSS) and DDP at 2
    ranks (those and the exposed share), a family of 5 metrics."""
    step_ms = tuple(plain_slower * s for s in (40.0, 41.0, 42.0, 41.5, 40.5))[:launches]
    ddp = [_launch(_reference("ddp"), i, 30.0 + i, 400.0 + i, 0.05 + 0.01 * i) for i in range(launches)]
    return _plain(step_ms=step_ms, rss_mib=(324.0,) * launches) + ddp


def test_the_smoke_matrix_at_three_launches_a_side_cannot_fail_the_gate_and_says_what_it_needs(tmp_path, capsys):
    # The plain loop 1.3 times slower: 40 * 1.3 = 52 ms against 42 ms, 23.8% apart, beyond 15%. Alone that
    # would be a regression (1/20 <= 0.05), but 5 metrics each judged at 0.05 false-alarm together in
    # 1 - 0.95^5 = 22.6% of comparisons of unchanged software. In a family of 5 each needs
    # 1 / C(n + m, n) <= 0.05 / 5 = 0.01: 3 vs 3 gives 1/20, 5 vs 5 gives 1/252.
    base = _write(tmp_path / "base.jsonl", _smoke(3))
    new = _write(tmp_path / "new.jsonl", _smoke(3, plain_slower=1.3))
    assert main(["compare", str(base), str(new)]) == 6            # nothing judged: not a pass
    captured = capsys.readouterr()
    assert captured.err.strip() == ("parbench: nothing judged: 5 metrics with too few launches (had 3 v 3; 5 a side "
                                    "judge this family of 5), 0 cells not compared (no ok launch, or not in both "
                                    "files); exit 6 (--allow-unjudged: exit 0)")
    lines = captured.out.splitlines()
    step = next(line for line in lines if "plain" in line and "step_time" in line)
    assert step.endswith("not judged: 3 vs 3 launches apart beyond the threshold, not evidence (chance 0.05 > "
                         "alpha 0.05 / 5 metrics; needs 5 a side)")
    assert lines[-2] == "0 metrics judged: 0 regressions, 0 improvements, 0 same; 5 not judged; 0 cells not compared"
    assert lines[-1] == ("chance of any false regression <= 0.05 over a family of 5 metrics (Holm): "
                         "5 launches a side judge each")
    base = _write(tmp_path / "base5.jsonl", _smoke(5))
    new = _write(tmp_path / "new5.jsonl", _smoke(5, plain_slower=1.3))
    assert main(["compare", str(base), str(new)]) == 1
    lines = capsys.readouterr().out.splitlines()
    flagged = [line for line in lines if line.endswith("regression")]
    assert len(flagged) == 1 and "plain" in flagged[0] and "step_time" in flagged[0] and "+23.8%" in flagged[0]
    assert lines[-2] == "5 metrics judged: 1 regressions, 0 improvements, 4 same; 0 not judged; 0 cells not compared"


# Simulated comparisons of unchanged software: every launch value of every metric drawn independently from
# one continuous distribution (uniform on [1, 2)), judged at threshold 0, where the rule fires most often.
# The seeded generator makes each figure below the same on every run; the margin, 4 binomial standard
# errors of alpha at the number of comparisons drawn, says how far a fair draw could stray above alpha.
ALPHA = 0.05


def _margin(comparisons: int) -> float:
    return 4 * sqrt(ALPHA * (1 - ALPHA) / comparisons)


def _simulate(shapes: list[tuple[int, int]], comparisons: int, seed: int) -> dict[str, float]:
    """Shares of `comparisons` in which the gate named any regression, any improvement, judged every metric
    of the family, and in which judging each metric alone at alpha (the rule before issue 33) would have
    named a regression. `shapes`: (base, new) launches of each metric."""
    rng = random.Random(seed)
    counts = dict.fromkeys(("regression", "improvement", "all judged", "each alone"), 0)
    for _ in range(comparisons):
        values = [MetricValues(f"cell{i}", STEP_TIME, 0.0, tuple(1 + rng.random() for _ in range(n)),
                               tuple(1 + rng.random() for _ in range(m))) for i, (n, m) in enumerate(shapes)]
        verdicts = [j.verdict for j in judge_metrics(values, ALPHA)]
        counts["regression"] += Verdict.REGRESSION in verdicts
        counts["improvement"] += Verdict.IMPROVEMENT in verdicts
        counts["all judged"] += Verdict.NOT_JUDGED not in verdicts
        counts["each alone"] += any(judge(v.base, v.new, STEP_TIME, 0.0) is Verdict.REGRESSION
                                    and chance_of_firing(len(v.base), len(v.new)) <= ALPHA for v in values)
    return {name: count / comparisons for name, count in counts.items()}


def test_the_smoke_family_false_alarms_at_most_alpha_where_each_metric_alone_would_in_23_percent():
    # 5 metrics at 3 vs 3. Each alone: 1 - (1 - 1/20)^5 = 0.2262, within 4 standard errors
    # (4 * sqrt(0.2262 * 0.7738 / 20,000) = 0.0118) of the simulated share: the simulation sees the bug.
    rates = _simulate([(3, 3)] * 5, 20_000, seed=4)
    assert abs(rates["each alone"] - (1 - 0.95 ** 5)) < 0.0118
    assert rates["each alone"] > ALPHA + _margin(20_000)
    assert rates["regression"] <= ALPHA + _margin(20_000)
    assert rates["improvement"] <= ALPHA + _margin(20_000)


def test_a_family_judged_in_full_false_alarms_close_to_but_not_above_alpha():
    # 12 metrics at 5 vs 5: 1/252 <= 0.05 / 12, so every metric is judged, and the chance of any of the 12
    # independent metrics firing is 1 - (1 - 1/252)^12 = 0.0466, the closest to alpha an even split allows.
    rates = _simulate([(5, 5)] * 12, 5_000, seed=5)
    assert rates["all judged"] == 1.0
    assert abs(rates["regression"] - (1 - (251 / 252) ** 12)) < 4 * sqrt(0.0466 * 0.9534 / 5_000)
    assert rates["regression"] <= ALPHA + _margin(5_000)
    assert rates["improvement"] <= ALPHA + _margin(5_000)


def test_a_full_matrix_sized_family_false_alarms_at_most_alpha():
    # 100 metrics, as the full matrix has: 50 at 7 vs 7 (1/3432 <= 0.05 / 100, judged) and 50 at 5 vs 5
    # (1/252 > 0.0005: not judged unless Holm stepped down 88 times). Any false regression:
    # 1 - (1 - 1/3432)^50 = 0.0145. Each alone at alpha would fire in 1 - (251/252)^50 (3431/3432)^50 = 0.192.
    rates = _simulate([(7, 7)] * 50 + [(5, 5)] * 50, 1_000, seed=6)
    assert rates["regression"] <= ALPHA + _margin(1_000)
    assert rates["improvement"] <= ALPHA + _margin(1_000)
    assert rates["each alone"] > ALPHA + _margin(1_000)


@pytest.mark.parametrize("shapes", [[(5, 5)] * 5, [(7, 7)] * 100], ids=["smoke-5-a-side", "full-7-a-side"])
def test_a_real_30_percent_slowdown_of_one_metric_is_caught_in_every_comparison(shapes):
    # Launch values uniform on [0.95, 1.05) of the base level; one metric's new launches 1.3 times that.
    # The closest launches then lie at least 1.3 * 0.95 / 1.05 - 1 = 17.6% apart, beyond the 15% step-time
    # default, and 1/252 <= 0.05 / 5 (1/3432 <= 0.05 / 100): Holm's first step rejects. The unchanged
    # metrics' launches never lie 15% apart (1.05 / 0.95 - 1 = 10.5% at most).
    rng = random.Random(7)
    threshold = STEP_TIME_THRESHOLDS[DeviceKind.CPU]
    draw = lambda count, level: tuple(level * (0.95 + 0.1 * rng.random()) for _ in range(count))  # noqa: E731
    for _ in range(200):
        values = [MetricValues(f"cell{i}", STEP_TIME, threshold, draw(n, 1.0), draw(m, 1.3 if i == 0 else 1.0))
                  for i, (n, m) in enumerate(shapes)]
        verdicts = [j.verdict for j in judge_metrics(values, ALPHA)]
        assert verdicts == [Verdict.REGRESSION] + [Verdict.SAME] * (len(shapes) - 1)


# ---- what the gate must catch at 4 launches a side, a family of 2 metrics ------------------------------


def test_four_vs_four_with_a_planted_30_percent_slower_step_is_a_regression(tmp_path, capsys):
    # Launch medians 40, 41, 42, 41.5 ms before; 1.3 times that after: 52, 53.3, 54.6, 53.95 ms. The closest
    # launches lie 52 / 42 - 1 = 23.8% apart, beyond a 15% threshold. The 16 unstalled steps a side overlap
    # (0.75 * 52 = 39 ms < 1.40 * 42 = 58.8 ms), so a per-step rank test does not reach 0.01.
    base = _write(tmp_path / "base.jsonl", _plain())
    new = _write(tmp_path / "new.jsonl", _plain(step_ms=(52.0, 53.3, 54.6, 53.95)))
    assert main(["compare", str(base), str(new), "--threshold", "0.15"]) == 1
    flagged = [line for line in capsys.readouterr().out.splitlines() if line.endswith("regression")]
    assert len(flagged) == 1 and "step_time" in flagged[0] and "+23.8%" in flagged[0]


def test_four_vs_four_with_30_percent_more_peak_memory_is_a_regression(tmp_path, capsys):
    # 324.0, 324.4, 324.7, 324.2 MiB before, 1.3 times that after: 421.2 / 324.7 - 1 = 29.7% apart, at the
    # default thresholds.
    base = _write(tmp_path / "base.jsonl", _plain())
    new = _write(tmp_path / "new.jsonl", _plain(rss_mib=tuple(1.3 * x for x in (324.0, 324.4, 324.7, 324.2))))
    assert main(["compare", str(base), str(new)]) == 1
    flagged = [line for line in capsys.readouterr().out.splitlines() if line.endswith("regression")]
    assert len(flagged) == 1 and "peak_rss_bytes_max" in flagged[0] and "+29.7%" in flagged[0]


def test_a_cell_whose_every_step_was_stalled_is_named_and_counted(tmp_path, capsys):
    base = _write(tmp_path / "base.jsonl", _plain())
    new = _write(tmp_path / "new.jsonl", _plain(all_stalled=True))
    assert main(["compare", str(base), str(new)]) == 0
    out = capsys.readouterr().out
    named = [line for line in out.splitlines() if "step_time" in line]
    assert len(named) == 1 and "not judged: 4 vs 0 launches" in named[0]
    assert "4 new launch(es): every timed step host-stalled" in named[0]
    # Peak RSS alone is the family: 1 metric, which 3 launches a side would judge (1/20 <= 0.05).
    assert out.splitlines()[-2].endswith("1 not judged; 0 cells not compared")
    assert out.splitlines()[-1] == ("chance of any false regression <= 0.05 over a family of 1 metrics (Holm): "
                                    "3 launches a side judge each")


# ---- the rule itself ------------------------------------------------------------------------------------


def test_medians_apart_but_launches_interleaved_is_not_a_regression():
    # The brief's DDP case: a run and its repeat differ by 25% in median while their launches interleave
    # (49 ms new < 50 ms base). Judging medians would call this a regression; launches say nothing moved.
    result = gate(_plain(step_ms=(40.0, 41.0, 50.0, 45.0)), _plain(step_ms=(49.0, 51.25, 53.0, 52.0)), {"*": 0.15})
    assert _verdicts(result)["step_time_unstalled_median_s"] is Verdict.SAME


def test_the_separation_must_clear_the_threshold():
    # 46 / 42 - 1 = 9.5%: below a 15% threshold, above a 5% one.
    base, new = _plain(), _plain(step_ms=(46.0, 47.0, 48.0, 47.5))
    assert _verdicts(gate(base, new, {"*": 0.15}))["step_time_unstalled_median_s"] is Verdict.SAME
    assert _verdicts(gate(base, new, {"*": 0.05}))["step_time_unstalled_median_s"] is Verdict.REGRESSION


def test_stalled_steps_are_set_aside_within_each_launch():
    # The same launches, but in the new ones the host also stalled step 2 for 1.2 s. Over the unstalled
    # steps (0.75, 1.05, 1.40 times the launch's level) the medians are 1.05 times: 42, 43.05, 44.1,
    # 43.575 ms, interleaved with 40, 41, 42, 41.5. Counting the stalled steps, they would be 1.40 times,
    # 56, 57.4, 58.8 and 58.1 ms: 56 / 42 - 1 = 33% apart, a regression at 10%.
    base = _plain()
    stalled = []
    for row in _plain():
        m = dict(row.measurements)
        m["step_time_s"] = [STALL_S if i == 2 else t for i, t in enumerate(m["step_time_s"])]
        m["host_stalled_step_indices"] = [1, 2]
        stalled.append(dataclasses.replace(row, measurements=m))
    assert _verdicts(gate(base, stalled, {"*": 0.10}))["step_time_unstalled_median_s"] is Verdict.SAME


def test_an_improvement_is_named_and_passes_the_gate(tmp_path, capsys):
    # The closest launches, 40 ms before and 30 ms after, lie 40 / 30 - 1 = 33.3% apart, the other way.
    base = _write(tmp_path / "base.jsonl", _plain())
    new = _write(tmp_path / "new.jsonl", _plain(step_ms=(28.0, 29.0, 30.0, 29.5)))
    assert main(["compare", str(base), str(new), "--threshold", "0.15"]) == 0
    flagged = [line for line in capsys.readouterr().out.splitlines() if line.endswith("improvement")]
    assert len(flagged) == 1 and "-33.3%" in flagged[0]


def test_exposed_share_is_judged_in_share_points_not_relative():
    # Shares -5%, 4%, 7%, 0% before and 20%, 22%, 25%, 21% after: 20 - 7 = 13 points apart. Relative to 7%
    # that is +186%, which any relative threshold would flag; in points it clears 10 and not 15. (DDP's
    # three metrics are a family of 3: 1 / C(8, 4) = 1/70 <= 0.05 / 3.)
    template = _reference("ddp")
    base = [_launch(template, i, exposed=x) for i, x in enumerate((-0.05, 0.04, 0.07, 0.0))]
    new = [_launch(template, i, exposed=x) for i, x in enumerate((0.20, 0.22, 0.25, 0.21))]
    assert _verdicts(gate(base, new, {"exposed_comm_share": 0.10}))["exposed_comm_share"] is Verdict.REGRESSION
    assert _verdicts(gate(base, new, {"exposed_comm_share": 0.15}))["exposed_comm_share"] is Verdict.SAME


def test_default_thresholds_follow_the_cells_device(monkeypatch):
    # The two devices' step-time defaults happen to agree today (15%); set the CPU's apart so that the
    # lookup by the cell's device shows. 52 / 42 - 1 = 23.8% apart: beyond 15%, within 30%.
    monkeypatch.setitem(STEP_TIME_THRESHOLDS, DeviceKind.CPU, 0.30)
    assert STEP_TIME_THRESHOLDS[DeviceKind.CUDA] < 0.238 < STEP_TIME_THRESHOLDS[DeviceKind.CPU]
    on_gpu = lambda rows: [dataclasses.replace(r, spec=r.spec.replace(device="cuda")) for r in rows]  # noqa: E731
    base, new = _plain(), _plain(step_ms=(52.0, 53.3, 54.6, 53.95))
    assert _verdicts(gate(base, new))["step_time_unstalled_median_s"] is Verdict.SAME
    assert _verdicts(gate(on_gpu(base), on_gpu(new)))["step_time_unstalled_median_s"] is Verdict.REGRESSION


# ---- named, never dropped -------------------------------------------------------------------------------


def test_too_few_launches_are_named_with_what_they_need_and_do_not_fail(tmp_path, capsys):
    # One launch against four, twice as slow: 1 / C(5, 1) = 0.2 > 0.05 / 2, not evidence.
    base = _write(tmp_path / "base.jsonl", _plain()[:1])
    new = _write(tmp_path / "new.jsonl", _plain(step_ms=(80.0, 82.0, 84.0, 83.0)))
    assert main(["compare", str(base), str(new)]) == 6
    lines = capsys.readouterr().out.splitlines()
    assert sum("not judged: 1 vs 4 launches apart beyond the threshold, not evidence (chance 0.2 > alpha 0.05 / 2 "
               "metrics; needs 4 a side)" in l for l in lines) == 1
    assert sum("not judged: 1 vs 4 launches (chance 0.2 > alpha 0.05 / 2 metrics; needs 4 a side)" in l
               for l in lines) == 1
    assert lines[-2] == "0 metrics judged: 0 regressions, 0 improvements, 0 same; 2 not judged; 0 cells not compared"


def test_alpha_001_judges_five_launches_a_side_and_not_four():
    # A family of 2 at alpha 0.01: 1 / C(10, 5) = 1/252 <= 0.005 < 1 / C(8, 4) = 1/70.
    base = _plain(step_ms=(40.0, 41.0, 42.0, 40.5, 41.5), rss_mib=(324.0,) * 5)
    new = _plain(step_ms=(60.0, 61.0, 62.0, 60.5, 61.5), rss_mib=(324.0,) * 5)
    five = gate(base, new, {"*": 0.15}, alpha=0.01)
    four = gate(base[:4], new[:4], {"*": 0.15}, alpha=0.01)
    assert _verdicts(five)["step_time_unstalled_median_s"] is Verdict.REGRESSION
    assert _verdicts(four)["step_time_unstalled_median_s"] is Verdict.NOT_JUDGED


def test_a_metric_recorded_on_one_side_only_is_named():
    template = _reference("ddp")
    base = [_launch(template, i, exposed=x) for i, x in enumerate((0.01, 0.02, 0.03, 0.04))]
    new = [_launch(template, i, exposed=x) for i, x in enumerate((0.01, 0.02, 0.03, 0.04))]
    new = [dataclasses.replace(r, measurements={**r.measurements, "exposed_comm_share": None}) for r in new]
    judgement = next(j for j in gate(base, new).judgements if j.metric.name == "exposed_comm_share")
    assert (judgement.verdict, judgement.reason) == (Verdict.NOT_JUDGED, "not recorded on the new side")


def test_a_metric_neither_side_records_is_not_a_metric_of_the_cell():
    # The plain loop has no communication; the CPU has no allocator peak. Neither is listed.
    names = {j.metric.name for j in gate(_plain(), _plain()).judgements}
    assert names == {"step_time_unstalled_median_s", "peak_rss_bytes_max"}


def test_a_cell_without_an_ok_launch_or_on_one_side_is_not_compared(tmp_path, capsys):
    failed = [dataclasses.replace(r, status=Status.FAILED, message="rank 1 exited 1") for r in _plain()]
    result = gate(_plain(), failed)
    assert result.judgements == [] and result.not_compared == [
        ("gpt-tiny/plain/ws1/gb16/mb4/fp32/cpu", "no ok launch (4 failed) on the new side")]
    ddp = [_launch(_reference("ddp"), i, 30.0) for i in range(4)]
    base = _write(tmp_path / "base.jsonl", _plain() + ddp)
    new = _write(tmp_path / "new.jsonl", _plain())
    assert main(["compare", str(base), str(new)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "not compared: no launch on the new side" in lines[-3] and lines[-2].endswith("1 cells not compared")


def test_a_bad_threshold_is_one_line_naming_the_metrics(tmp_path, capsys):
    base = _write(tmp_path / "base.jsonl", _plain())
    for bad in (["--threshold", "step_time=0.1"], ["--threshold", "-0.1"], ["--threshold", "fast"],
                ["--threshold", "nan"], ["--threshold", "peak_rss_bytes_max=inf"], ["--alpha", "1.5"]):
        assert main(["compare", str(base), str(base), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("parbench: error:")
    main(["compare", str(base), str(base), "--threshold", "step_time=0.1"])
    assert "step_time_unstalled_median_s" in capsys.readouterr().err


def test_judging_chosen_metrics_makes_a_smaller_family_that_fewer_launches_judge(tmp_path, capsys):
    # The plain loop 1.3 times slower at 4 launches a side: 40 * 1.3 = 52 ms against 42 ms, 23.8% apart.
    # All 5 metrics of the smoke matrix are a family of 5: each needs 1 / C(n + m, n) <= 0.05 / 5 = 0.01,
    # and 1 / C(8, 4) = 1/70 = 0.0143 is not. Step time alone is a family of 2 (one per cell): 0.05 / 2 =
    # 0.025 >= 1/70, so 4 a side judge it.
    base = _write(tmp_path / "base.jsonl", _smoke(4))
    new = _write(tmp_path / "new.jsonl", _smoke(4, plain_slower=1.3))
    assert main(["compare", str(base), str(new), "--allow-unjudged"]) == 0
    assert capsys.readouterr().out.splitlines()[-2].endswith("5 not judged; 0 cells not compared")
    assert main(["compare", str(base), str(new), "--metric", "step_time_unstalled_median_s"]) == 1
    lines = capsys.readouterr().out.splitlines()
    flagged = [line for line in lines if line.endswith("regression")]
    assert len(flagged) == 1 and "plain" in flagged[0] and "+23.8%" in flagged[0]
    assert not any("peak_rss" in line or "exposed" in line for line in lines)
    assert lines[-1] == ("chance of any false regression <= 0.05 over a family of 2 metrics (Holm): "
                         "4 launches a side judge each")


def test_an_unknown_metric_to_judge_is_one_line_naming_the_known_ones(tmp_path, capsys):
    base = _write(tmp_path / "base.jsonl", _plain())
    assert main(["compare", str(base), str(base), "--metric", "step_time_s"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("parbench: error: --metric:")
    assert "'step_time_s'" in err and "step_time_unstalled_median_s" in err and "peak_rss_bytes_max" in err


def test_the_exact_mann_whitney_tail_is_the_count_of_orderings_written_out_by_hand():
    # 3 vs 3: the 20 orderings of base (b) and new (a) values by how many (b, a) pairs have a above b, as
    # Mann & Whitney's (1947) table gives: U = 0..9 occur 1, 1, 2, 3, 3, 3, 3, 2, 1, 1 times.
    assert [tail_probability(3, 3, u) * 20 for u in range(10)] == pytest.approx([20, 19, 18, 16, 13, 10, 7, 4, 2, 1])
    # 7 vs 7, U >= 45: at most 4 of the 49 pairs inverted. Orderings with k inversions are the partitions of
    # k into at most 7 parts of at most 7: k = 0..4 give 1, 1, 2, 3, 5, so 12 of C(14, 7) = 3432.
    assert tail_probability(7, 7, 45) == pytest.approx(12 / 3432)
    assert tail_probability(7, 7, 49) == pytest.approx(chance_of_firing(7, 7))


def test_launches_that_overlap_are_a_regression_when_enough_pairs_lie_beyond_the_threshold():
    # One base launch slowed as a whole (38.1 ms) among six at 30-31.5 ms; new launches 39.0-40.95 ms. At a 5%
    # threshold 38.1 * 1.05 = 40.0 ms: 4 new launches (39.0, 39.26, 39.52, 39.65) lie within it, every other
    # pair beyond: 45 of 49 pairs, p = 12/3432 = 0.0035 <= 0.05. The all-beyond rule sees 39.0 / 38.1 - 1 = 2.4%.
    base = (30.0, 31.0, 38.1, 31.5, 30.2, 30.8, 30.4)
    new = (39.0, 40.3, 39.65, 40.95, 39.26, 40.04, 39.52)
    [j] = judge_metrics([MetricValues("cell", STEP_TIME, 0.05, base, new)], ALPHA)
    assert j.separation == pytest.approx(39.0 / 38.1 - 1) and j.verdict is Verdict.REGRESSION
    assert j.reason == "45 of 49 pairs beyond the threshold, p = 0.0035"
    # Swapped, the same launches are an improvement. At 10% (38.1 * 1.1 = 41.9 ms, above every new launch)
    # 42 of 49 pairs lie beyond: 7 inversions, whose orderings number 1+1+2+3+5+7+11+15 = 45, p = 45/3432 =
    # 0.0131: a regression alone at 0.05, not in a family of 6 (0.05 / 6 = 0.0083). At 30%, the slowdown
    # itself, 18 pairs lie beyond (6+1+0+0+5+2+4, base by base): the same.
    [swapped] = judge_metrics([MetricValues("cell", STEP_TIME, 0.05, new, base)], ALPHA)
    assert swapped.verdict is Verdict.IMPROVEMENT
    [alone] = judge_metrics([MetricValues("cell", STEP_TIME, 0.10, base, new)], ALPHA)
    assert alone.verdict is Verdict.REGRESSION and alone.reason == "42 of 49 pairs beyond the threshold, p = 0.013"
    family = judge_metrics([MetricValues(f"cell{i}", STEP_TIME, 0.10, base, new if i == 0 else base)
                            for i in range(6)], ALPHA)
    assert [j.verdict for j in family] == [Verdict.SAME] * 6
    [wide] = judge_metrics([MetricValues("cell", STEP_TIME, 0.30, base, new)], ALPHA)
    assert wide.verdict is Verdict.SAME


def test_the_ab_tiers_family_false_alarms_at_most_alpha_though_overlapping_launches_can_be_called():
    # The A/B tier's shape: 6 metrics at 8 vs 8 (harness/ab.py). The exact test calls U >= 55 of 64 pairs
    # alone at 0.05 / 6, so it rejects more often than the all-beyond rule (1/12870 a metric), yet Holm keeps
    # any false regression of the family at or below alpha: seeded, 4.3% of 5,000 comparisons here.
    rates = _simulate([(8, 8)] * 6, 5_000, seed=7)
    assert rates["all judged"] == 1.0
    assert rates["regression"] <= ALPHA + _margin(5_000)
    assert rates["improvement"] <= ALPHA + _margin(5_000)
    assert rates["regression"] > 0.02     # the test does call overlapping launches: not the all-beyond rule's ~0


def test_a_one_launch_file_against_itself_judges_nothing_and_says_so_with_its_own_status(tmp_path, capsys):
    rows = _write(tmp_path / "rows.jsonl", _smoke(1))
    assert main(["compare", str(rows), str(rows)]) == 6
    err = capsys.readouterr().err
    assert "nothing judged: 5 metrics with too few launches (had 1 v 1; 5 a side judge this family of 5)" in err
    assert main(["compare", str(rows), str(rows), "--allow-unjudged"]) == 0
