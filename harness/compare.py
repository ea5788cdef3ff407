"""The regression gate on the command line: two results files in, one line per judged metric, exit 1 on a
regression.

    python -m harness compare results/base.jsonl results/new.jsonl [--threshold 0.2] \
        [--threshold peak_rss_bytes_max=0.1] [--alpha 0.05] [--metric step_time_unstalled_median_s] [--all]

The judgement (one value per launch, the rule, its false-positive probability, the minimum launches and
the thresholds) lives in harness/derive/gate.py; this module only reads the files and formats. Each line
shows a metric's per-launch values on both sides as median [min-max], the change of the medians, the
separation of the two sets of launches (how far the closest launches of the two sides lie apart; "overlap"
when they interleave) against the threshold, and the verdict. Regressions, improvements and everything not
judged are always listed; `--all` lists unchanged metrics too. The last line says what the verdicts are
worth together: the chance of any false regression in the comparison, the family it is held over and the
launches a side that let every metric of it be judged. `--metric` (repeatable) judges only the metrics named:
a smaller family, which fewer launches a side can judge.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Mapping, Sequence

from harness.derive.gate import DEFAULT_ALPHA, GateResult, Judgement, Margin, Verdict, gate
from harness.record import read_rows


def compare_files(base: Path, new: Path, thresholds: Mapping[str, float] | None = None,
                  alpha: float = DEFAULT_ALPHA, metrics: Sequence[str] | None = None) -> GateResult:
    """Gate the rows of `new` against those of `base` (on the metrics named, or every one)."""
    return gate(read_rows([base]), read_rows([new]), thresholds, alpha, metrics)


def _values(judgement: Judgement, values: tuple[float, ...]) -> str:
    scale = judgement.metric.scale
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0] * scale:.4g}"
    return f"{median(values) * scale:.4g} [{min(values) * scale:.4g}-{max(values) * scale:.4g}]"


def _relative(judgement: Judgement, value: float | None) -> str:
    if value is None:
        return "overlap"
    if judgement.metric.margin is Margin.ABSOLUTE:
        return f"{value * judgement.metric.scale:+.1f} pt"
    return f"{value:+.1%}"


def _change(judgement: Judgement) -> str:
    if not judgement.base or not judgement.new:
        return "-"
    before, after = median(judgement.base), median(judgement.new)
    if judgement.metric.margin is Margin.ABSOLUTE:
        return f"{(after - before) * judgement.metric.scale:+.1f} pt"
    return f"{after / before - 1:+.1%}" if before else "-"


def format_result(result: GateResult, show_all: bool = False) -> str:
    # Wide enough for every label whole: its tail says the conditions ("@50Mbit/s") that tell cells apart.
    width = max([48] + [len(j.label) for j in result.judgements] + [len(label) for label, _ in result.not_compared])
    header = (f"{'cell':<{width}} {'metric':<34} {'launches':>8} {'base':>24} {'new':>24} {'change':>9} "
              f"{'separation':>11} {'threshold':>10}  verdict")
    lines = [header, "-" * len(header)]
    for j in result.judgements:
        if j.verdict is Verdict.SAME and not show_all:
            continue
        threshold = (f"{j.threshold * j.metric.scale:.1f} pt" if j.metric.margin is Margin.ABSOLUTE
                     else f"{j.threshold:.0%}")
        verdict = j.verdict.value + (f": {j.reason}" if j.reason else "")
        lines.append(f"{j.label:<{width}} {j.metric.name + ' (' + j.metric.unit + ')':<34} "
                     f"{len(j.base):>3} v {len(j.new):<3}{_values(j, j.base):>24} {_values(j, j.new):>24} "
                     f"{_change(j):>9} {_relative(j, j.separation):>11} {threshold:>10}  {verdict}")
    for label, why in result.not_compared:
        lines.append(f"{label:<{width}} not compared: {why}")
    judged = len(result.judgements) - result.count(Verdict.NOT_JUDGED)
    lines.append(f"{judged} metrics judged: {result.count(Verdict.REGRESSION)} regressions, "
                 f"{result.count(Verdict.IMPROVEMENT)} improvements, {result.count(Verdict.SAME)} same; "
                 f"{result.count(Verdict.NOT_JUDGED)} not judged; {len(result.not_compared)} cells not compared")
    lines.append(f"chance of any false regression <= {result.alpha:g} over a family of {result.family} metrics "
                 f"(Holm): {result.launches_needed_a_side} launches a side judge each")
    return "\n".join(lines)
