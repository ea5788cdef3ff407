"""Compare two sets of results cell by cell and flag regressions: a CI gate.

    python -m harness compare results/base.jsonl results/new.jsonl [--threshold 0.10] [--alpha 0.01]

Cells are matched by their spec identity (`RunSpec.cell_id`: everything but the repeat count). For each
metric, the samples of both sides are compared with a two-sided Mann-Whitney U test (scipy), which
assumes neither normality nor equal variances, on:
- step time: every timed step of every ok launch that the host did not stall (harness.timing: a step
  during which the virtual machine was descheduled measures the host, not the software), lower is better;
- peak memory per rank: one figure per launch (lower is better);
- exposed communication share: one figure per launch (lower is better), judged only with 3 or more
  launches a side: a difference of two shares is noisy, so one launch proves nothing.
A difference is reported when the medians differ by more than `threshold` (relative) AND the test
rejects "same distribution" at level `alpha`. Peak memory is close to deterministic, so with fewer than 3
launches a side (no test has power there) the threshold alone decides, and the p column says "n<3".

The steps of one launch share that launch's conditions (placement, machine load), so the per-step test
sees within-launch noise only; launch-to-launch variation must be covered by the threshold. On the 2-core
development VM two launches of the same gpt-tiny cell differed by 11% in raw median step time, host
stalls included, and by 0.7% (plain loop) and 2.6% (DDP, 2 ranks) over unstalled steps; the 15% default
covers the first. Use `--repeats 3` or more per side and `--threshold` to tighten it on a quiet machine.
Any regression makes the exit status 1.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from statistics import median
from typing import Callable, Sequence

from scipy.stats import mannwhitneyu

from harness.derive.exposed import exposed_communication
from harness.spec import RunResult, Status


class Change(enum.StrEnum):
    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    SAME = "same"


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    samples: Callable[[RunResult], list[float]]
    min_samples: int = 1     # fewer samples on a side: the metric is listed but never judged


def _scalar(key: str) -> Callable[[RunResult], list[float]]:
    def samples(result: RunResult) -> list[float]:
        value = result.measurements.get(key)
        return [float(value)] if value is not None else []
    return samples


def _exposed_share(result: RunResult) -> list[float]:
    value = exposed_communication(result.measurements).exposed_comm_share
    return [float(value)] if value is not None else []


def _unstalled_steps(result: RunResult) -> list[float]:
    stalled = set(result.measurements.get("host_stalled_step_indices") or ())
    return [float(t) for i, t in enumerate(result.measurements.get("step_time_s", [])) if i not in stalled]


METRICS = (
    Metric("step_time_s", "ms", _unstalled_steps),
    Metric("peak_rss_bytes_max", "MiB", _scalar("peak_rss_bytes_max")),
    Metric("peak_allocated_bytes_max", "MiB", _scalar("peak_allocated_bytes_max")),
    Metric("exposed_comm_share", "%", _exposed_share, min_samples=3),
)
SCALE = {"ms": 1e3, "MiB": 1 / (1 << 20), "%": 100.0}


@dataclass(frozen=True)
class Finding:
    label: str
    metric: Metric
    base_median: float
    new_median: float
    relative_change: float
    p_value: float | None          # None: too few samples for a test
    change: Change


def compare_results(base: Sequence[RunResult], new: Sequence[RunResult], threshold: float = 0.15,
                    alpha: float = 0.01) -> tuple[list[Finding], list[str]]:
    """Findings for every metric of every matched cell, and the labels of cells on one side only."""
    def by_cell(results: Sequence[RunResult]) -> dict[str, list[RunResult]]:
        cells: dict[str, list[RunResult]] = {}
        for result in results:
            if result.status is Status.OK:
                cells.setdefault(result.spec.cell_id, []).append(result)
        return cells

    base_cells, new_cells = by_cell(base), by_cell(new)
    unmatched = sorted({launches[0].spec.label for cell, launches in {**base_cells, **new_cells}.items()
                        if cell not in base_cells or cell not in new_cells})
    findings = []
    for cell in sorted(set(base_cells) & set(new_cells), key=lambda c: base_cells[c][0].spec.label):
        for metric in METRICS:
            before = [x for r in base_cells[cell] for x in metric.samples(r)]
            after = [x for r in new_cells[cell] for x in metric.samples(r)]
            if before and after:
                findings.append(_judge(base_cells[cell][0].spec.label, metric, before, after, threshold, alpha))
    return findings, unmatched


def _judge(label: str, metric: Metric, before: list[float], after: list[float], threshold: float,
           alpha: float) -> Finding:
    base_median, new_median = median(before), median(after)
    scale = abs(base_median) if base_median else 1.0
    relative = (new_median - base_median) / scale
    p_value = None
    if min(len(before), len(after)) >= 3:
        p_value = float(mannwhitneyu(before, after, alternative="two-sided").pvalue)
    enough = min(len(before), len(after)) >= metric.min_samples
    significant = enough and abs(relative) > threshold and (p_value is None or p_value < alpha)
    change = Change.SAME if not significant else (Change.REGRESSION if relative > 0 else Change.IMPROVEMENT)
    return Finding(label, metric, base_median, new_median, relative, p_value, change)


def format_findings(findings: Sequence[Finding], unmatched: Sequence[str], show_all: bool = False) -> str:
    header = f"{'cell':<52} {'metric':<26} {'base':>10} {'new':>10} {'change':>8} {'p':>8}  verdict"
    lines = [header, "-" * len(header)]
    for f in findings:
        if f.change is Change.SAME and not show_all:
            continue
        scale = SCALE[f.metric.unit]
        p_text = f"{f.p_value:.1e}" if f.p_value is not None else "n<3"
        lines.append(f"{f.label[:52]:<52} {f.metric.name + ' (' + f.metric.unit + ')':<26} "
                     f"{f.base_median * scale:>10.2f} {f.new_median * scale:>10.2f} {f.relative_change:>+8.1%} "
                     f"{p_text:>8}  {f.change.value}")
    regressions = sum(f.change is Change.REGRESSION for f in findings)
    improvements = sum(f.change is Change.IMPROVEMENT for f in findings)
    lines.append(f"{len(findings)} comparisons: {regressions} regressions, {improvements} improvements")
    for label in unmatched:
        lines.append(f"only on one side (not compared): {label}")
    return "\n".join(lines)
