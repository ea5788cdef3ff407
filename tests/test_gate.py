"""The regression gate on rows built from a real one: per-launch values, the rule, what is not judged.

Every row here is the committed reference row (results/reference/ci-cpu/smoke.jsonl) with its step times,
stalls and memory replaced, so the outcome is fixed by the values written below, never by timing noise.
"""

import dataclasses
import itertools
from math import comb
from pathlib import Path

import pytest

from harness.cli import main
from harness.derive.gate import METRICS, STEP_TIME_THRESHOLDS, Verdict, gate, judge, launches_needed_a_side
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
    spec = template.spec.replace(timed_steps=len(STEP_SHAPE), repeats=3)
    return dataclasses.replace(template, spec=spec, measurements=m, repeat=repeat,
                               run_id=f"{template.run_id[:8]}-{repeat}-{step_ms}-{rss_mib}-{exposed}")


def _write(path: Path, rows: list[RunResult]) -> Path:
    for row in rows:
        append_row(path, row)
    return path


def _plain(step_ms=(40.0, 41.0, 42.0), rss_mib=(324.0, 324.4, 324.7), **kwargs) -> list[RunResult]:
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


# ---- what the gate must catch at 3 launches a side (each fails on b2b0cbe's compare) --------------------


def test_three_vs_three_with_a_planted_30_percent_slower_step_is_a_regression(tmp_path, capsys):
    # Launch medians 40, 41, 42 ms before; 52, 53.3, 54.6 ms after. The closest launches lie
    # 52 / 42 - 1 = 23.8% apart, beyond a 15% threshold. The 12 unstalled steps a side overlap
    # (0.75 * 52 = 39 ms < 1.40 * 42 = 58.8 ms), so a per-step rank test does not reach 0.01.
    base = _write(tmp_path / "base.jsonl", _plain())
    new = _write(tmp_path / "new.jsonl", _plain(step_ms=(52.0, 53.3, 54.6)))
    assert main(["compare", str(base), str(new), "--threshold", "0.15"]) == 1
    flagged = [line for line in capsys.readouterr().out.splitlines() if line.endswith("regression")]
    assert len(flagged) == 1 and "step_time" in flagged[0] and "+23.8%" in flagged[0]


def test_three_vs_three_with_30_percent_more_peak_memory_is_a_regression(tmp_path, capsys):
    # 324.0, 324.4, 324.7 MiB before, 1.3 times that after: 421.2 / 324.7 - 1 = 29.7% apart, at the
    # default thresholds. A rank test of 3 values against 3 cannot go below p = 2/20 = 0.1.
    base = _write(tmp_path / "base.jsonl", _plain())
    new = _write(tmp_path / "new.jsonl", _plain(rss_mib=(324.0 * 1.3, 324.4 * 1.3, 324.7 * 1.3)))
    assert main(["compare", str(base), str(new)]) == 1
    flagged = [line for line in capsys.readouterr().out.splitlines() if line.endswith("regression")]
    assert len(flagged) == 1 and "peak_rss_bytes_max" in flagged[0] and "+29.7%" in flagged[0]


def test_a_cell_whose_every_step_was_stalled_is_named_and_counted(tmp_path, capsys):
    base = _write(tmp_path / "base.jsonl", _plain())
    new = _write(tmp_path / "new.jsonl", _plain(all_stalled=True))
    assert main(["compare", str(base), str(new)]) == 0
    out = capsys.readouterr().out
    named = [line for line in out.splitlines() if "step_time" in line]
    assert len(named) == 1 and "not judged: 3 vs 0 launches" in named[0]
    assert "3 new launch(es): every timed step host-stalled" in named[0]
    assert out.splitlines()[-1].endswith("1 not judged; 0 cells not compared")


# ---- the rule itself ------------------------------------------------------------------------------------


def test_medians_apart_but_launches_interleaved_is_not_a_regression():
    # The brief's DDP case: a run and its repeat differ by 25% in median while their launches interleave
    # (49 ms new < 50 ms base). Judging medians would call this a regression; launches say nothing moved.
    result = gate(_plain(step_ms=(40.0, 41.0, 50.0)), _plain(step_ms=(49.0, 51.25, 53.0)), {"*": 0.15})
    assert _verdicts(result)["step_time_unstalled_median_s"] is Verdict.SAME


def test_the_separation_must_clear_the_threshold():
    # 46 / 42 - 1 = 9.5%: below a 15% threshold, above a 5% one.
    base, new = _plain(), _plain(step_ms=(46.0, 47.0, 48.0))
    assert _verdicts(gate(base, new, {"*": 0.15}))["step_time_unstalled_median_s"] is Verdict.SAME
    assert _verdicts(gate(base, new, {"*": 0.05}))["step_time_unstalled_median_s"] is Verdict.REGRESSION


def test_stalled_steps_are_set_aside_within_each_launch():
    # The same launches, but in the new ones the host also stalled step 2 for 1.2 s. Over the unstalled
    # steps (0.75, 1.05, 1.40 times the launch's level) the medians are 1.05 times: 42, 43.05, 44.1 ms,
    # interleaved with 40, 41, 42. Counting the stalled steps, they would be 1.40 times, 56, 57.4 and
    # 58.8 ms: 56 / 42 - 1 = 33% apart, a regression at 10%.
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
    new = _write(tmp_path / "new.jsonl", _plain(step_ms=(28.0, 29.0, 30.0)))
    assert main(["compare", str(base), str(new), "--threshold", "0.15"]) == 0
    flagged = [line for line in capsys.readouterr().out.splitlines() if line.endswith("improvement")]
    assert len(flagged) == 1 and "-33.3%" in flagged[0]


def test_exposed_share_is_judged_in_share_points_not_relative():
    # Shares -5%, 4%, 7% before and 20%, 22%, 25% after: 20 - 7 = 13 points apart. Relative to 7% that is
    # +186%, which any relative threshold would flag; in points it clears 10 and not 15.
    template = _reference("ddp")
    base = [_launch(template, i, exposed=x) for i, x in enumerate((-0.05, 0.04, 0.07))]
    new = [_launch(template, i, exposed=x) for i, x in enumerate((0.20, 0.22, 0.25))]
    assert _verdicts(gate(base, new, {"exposed_comm_share": 0.10}))["exposed_comm_share"] is Verdict.REGRESSION
    assert _verdicts(gate(base, new, {"exposed_comm_share": 0.15}))["exposed_comm_share"] is Verdict.SAME


def test_default_thresholds_follow_the_cells_device(monkeypatch):
    # The two devices' step-time defaults happen to agree today (15%); set the CPU's apart so that the
    # lookup by the cell's device shows. 52 / 42 - 1 = 23.8% apart: beyond 15%, within 30%.
    monkeypatch.setitem(STEP_TIME_THRESHOLDS, DeviceKind.CPU, 0.30)
    assert STEP_TIME_THRESHOLDS[DeviceKind.CUDA] < 0.238 < STEP_TIME_THRESHOLDS[DeviceKind.CPU]
    on_gpu = lambda rows: [dataclasses.replace(r, spec=r.spec.replace(device="cuda")) for r in rows]  # noqa: E731
    base, new = _plain(), _plain(step_ms=(52.0, 53.3, 54.6))
    assert _verdicts(gate(base, new))["step_time_unstalled_median_s"] is Verdict.SAME
    assert _verdicts(gate(on_gpu(base), on_gpu(new)))["step_time_unstalled_median_s"] is Verdict.REGRESSION


# ---- named, never dropped -------------------------------------------------------------------------------


def test_too_few_launches_are_named_with_what_they_need_and_do_not_fail(tmp_path, capsys):
    # One launch against three, twice as slow: 1 / C(4, 1) = 0.25 > 0.05, not evidence.
    base = _write(tmp_path / "base.jsonl", _plain()[:1])
    new = _write(tmp_path / "new.jsonl", _plain(step_ms=(80.0, 82.0, 84.0)))
    assert main(["compare", str(base), str(new)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum("not judged: 1 vs 3 launches (chance 0.25 > alpha 0.05; needs 3 a side)" in l for l in lines) == 2
    assert lines[-1] == "0 metrics judged: 0 regressions, 0 improvements, 0 same; 2 not judged; 0 cells not compared"


def test_alpha_001_judges_five_launches_a_side_and_not_four():
    base = _plain(step_ms=(40.0, 41.0, 42.0, 40.5, 41.5), rss_mib=(324.0,) * 5)
    new = _plain(step_ms=(60.0, 61.0, 62.0, 60.5, 61.5), rss_mib=(324.0,) * 5)
    five = gate(base, new, {"*": 0.15}, alpha=0.01)
    four = gate(base[:4], new[:4], {"*": 0.15}, alpha=0.01)
    assert _verdicts(five)["step_time_unstalled_median_s"] is Verdict.REGRESSION
    assert _verdicts(four)["step_time_unstalled_median_s"] is Verdict.NOT_JUDGED


def test_a_metric_recorded_on_one_side_only_is_named():
    template = _reference("ddp")
    base = [_launch(template, i, exposed=x) for i, x in enumerate((0.01, 0.02, 0.03))]
    new = [_launch(template, i, exposed=x) for i, x in enumerate((0.01, 0.02, 0.03))]
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
        ("gpt-tiny/plain/ws1/gb16/mb4/fp32/cpu", "no ok launch (3 failed) on the new side")]
    ddp = [_launch(_reference("ddp"), i, 30.0) for i in range(3)]
    base = _write(tmp_path / "base.jsonl", _plain() + ddp)
    new = _write(tmp_path / "new.jsonl", _plain())
    assert main(["compare", str(base), str(new)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "not compared: no launch on the new side" in lines[-2] and lines[-1].endswith("1 cells not compared")


def test_a_bad_threshold_is_one_line_naming_the_metrics(tmp_path, capsys):
    base = _write(tmp_path / "base.jsonl", _plain())
    for bad in (["--threshold", "step_time=0.1"], ["--threshold", "-0.1"], ["--threshold", "fast"],
                ["--threshold", "nan"], ["--threshold", "peak_rss_bytes_max=inf"], ["--alpha", "1.5"]):
        assert main(["compare", str(base), str(base), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("parbench: error:")
    main(["compare", str(base), str(base), "--threshold", "step_time=0.1"])
    assert "step_time_unstalled_median_s" in capsys.readouterr().err
