"""The regression gate's judgement: is a metric of a cell worse in one set of launches than in another?

    python -m harness compare results/base.jsonl results/new.jsonl     # harness/compare.py formats this

Launches, not steps, are the unit of replication: the steps of one launch share its placement, its
rendezvous, its host and that minute's load from other users, so they are not independent samples of the
software's speed (two launches of one DDP cell on the 2-core VM differed by 25% in median step time, and
a rank test over their steps called that a regression at p = 3.8e-9). Every metric is therefore reduced to ONE value per launch, and only
those values are compared:
- step time: the launch's median over its timed steps the host did not stall (`host_stalled_step_indices`,
  harness/rank/timing.py: a stalled step measures the hypervisor, not the software); a launch whose every timed
  step was stalled has no value, and says so;
- peak memory: `peak_rss_bytes_max` (every device) and `peak_allocated_bytes_max` (GPU rows);
- exposed communication share: `exposed_comm_share`, a difference of two times over the step time, which
  can be 0 or negative, so its margin is absolute (share points), not relative.
Every metric here is lower-is-better.

The rule: with base values b_1..b_n and new values a_1..a_m and the metric's threshold t, the metric
REGRESSED when the new launches lie beyond the base launches shifted by t: the one-sided exact Mann-Whitney
test (Mann & Whitney 1947) of the a_j against b_i * (1 + t) (relative margin; b_i + t for an absolute one),
on U = the number of the n * m pairs with a_j beyond the shifted b_i (`pairs_beyond`), p = P(U >= U_obs) when
the launch values are exchangeable (`tail_probability`: the share of the C(n + m, n) orderings with at
least that many such pairs). IMPROVED is the same test with the sides swapped; anything else is SAME. At U =
n * m every new launch is beyond every base launch by more than t (`separation`: min(a) > max(b) * (1 + t)),
and p is its least, 1 / C(n + m, n) (3 vs 3: 1/20 = 0.05; 4 vs 4: 1/70; 5 vs 5: 1/252; 7 vs 7: 1/3432).
Smaller U are called too where p is small enough: at 7 vs 7, 44 of the 49 pairs give p = 19/3432, so one
launch slowed as a whole by another user's load, which spoils a few pairs, no longer hides a real change
(it always did under "every new beyond every base", the rule before). The threshold keeps its meaning: the
null hypothesis is new = base * (1 + t), so a change within t is not called however many launches there
are. False-positive probability of one metric: at most p for software that did not change beyond t, and
the thresholds below, set from measured launch-to-launch variation, also cover what exchangeability misses
(the load of a shared machine drifts between a base run and a new one).

The family: one chance for the whole comparison. `compare` fails if ANY metric of any cell regressed, so
the rate that matters is the chance that a comparison of unchanged software names at least one regression.
Judged one by one at alpha, k independent metrics false-alarm with probability 1 - (1 - 1/C(n + m, n))^k
(the smoke matrix's 5 metrics at 3 vs 3: 22.6%). The family is every metric of every compared cell that has
values on both sides (everything the comparison could call), k of them, fixed by what was compared before
any value is looked at (a metric with too few launches to be judged still counts; compare fewer cells, or
judge fewer metrics with `gate(..., metrics=...)` / `compare --metric`, for a smaller family), and Holm's
step-down (Holm 1979) holds the chance of any false regression in it to alpha whatever the dependence
between metrics: sort the p-values, reject the j-th smallest while each up to it is <= alpha / (k - j + 1).
Improvements are judged the same way, as a second family of the same k one-sided tests, so the
chance of naming any false improvement is also at most alpha. tests/test_gate.py checks both by simulation.

What a family needs. A metric is judged only when 1 / C(n + m, n) <= alpha / k, Holm's first step: then
the rule firing is a regression whatever the other metrics did, and the rule not firing is SAME. A metric
with fewer launches is NOT_JUDGED, with the counts and what it needs (`launches_needed_a_side(alpha / k)`:
an even split for alpha 0.05 needs 3 a side for 1 metric, 4 for 2 or 3, 5 for up to 12, 6 for up to 46, 7
for up to 171), unless Holm's step-down reaches it after other rejections. A metric whose launches fired
the rule but whose chance is too large is NOT_JUDGED too, and says so: it is not evidence at this family
size, nor is it "same". So is a metric recorded on one side only, and step time where launches had every
timed step stalled (the count of such launches is named). A cell with no ok launch on a side, or on one
side only, is listed as not compared, with why. NOT_JUDGED and not compared do not fail the gate (too few
launches is no evidence of a regression, and a gate that failed on it would fail every single-launch
run), but both are counted in the closing line, which also names alpha, k and the launches a side that
judge every metric of the family. A metric that neither side records (GPU memory on CPU, exposed share of
the plain loop) is not a metric of that cell and is not listed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from math import comb
from statistics import median
from typing import Any, Callable, Mapping, Sequence

from harness.derive.cells import condition_labels, launch_record
from harness.derive.identity import cell_identity, describe_differences, row_conditions, spec_id
from harness.derive.mann_whitney import orderings_by_pairs, tail_probability
from harness.derive.rows import Row
from harness.derive.throughput import Basis
from harness.spec import DeviceKind

# A launch as the gate sees it: its derived record (harness.derive.cells.launch_record), so the gate
# judges the same per-launch figures the report shows, computed from the raw row.
Launch = Mapping[str, Any]


class Verdict(enum.StrEnum):
    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    SAME = "same"
    NOT_JUDGED = "not judged"


class Margin(enum.StrEnum):
    RELATIVE = "relative"    # threshold is a fraction of the base value
    ABSOLUTE = "absolute"    # threshold is in the metric's own unit (a share: 0.05 = 5 points)


def unstalled_median_step_time_s(launch: Launch) -> float | None:
    """The launch's median step time over the timed steps the host did not stall; None if it stalled all."""
    return launch.get("step_time_unstalled_median_s")


def _recorded_steps(launch: Launch) -> bool:
    return bool(launch.get("timed_steps_recorded"))


def _scalar(key: str) -> Callable[[Launch], float | None]:
    def value(launch: Launch) -> float | None:
        raw = launch.get(key)
        return float(raw) if raw is not None and raw == raw else None
    return value


def _has(key: str) -> Callable[[Launch], bool]:
    return lambda launch: launch.get(key) is not None and launch.get(key) == launch.get(key)


@dataclass(frozen=True, kw_only=True)
class GateMetric:
    name: str                                        # what the output calls it (a row field, or derived)
    unit: str                                        # how the output shows it
    scale: float                                     # stored value * scale = shown value
    margin: Margin
    thresholds: Mapping[DeviceKind, float]           # defaults by the cell's device (below)
    per_launch: Callable[[Launch], float | None]     # the launch's one value
    recorded: Callable[[Launch], bool]               # did the launch record the raw figure at all
    missing_because: str                             # why a launch that recorded it has no value


# Default thresholds by device kind. CPU: from launch-to-launch variation measured on the 2-core
# development VM with scripts/measure_gate_noise.py (docs/methodology.md, "The regression gate", has the
# figures): 8 runs of the smoke matrix at 3 launches a side, back to back. Runs made alone separated by at
# most 12% in step time (DDP at 2 ranks; the plain loop 2%), so 15% keeps them quiet (0 of 12 ordered
# pairs) and still catches a 30% slowdown of the plain loop, whose 3 launches lie within 15% of each other;
# runs made beside another process's load separate by up to 125% and are flagged (a slower machine is not
# told from slower software). Peak RSS moved by at most 0.6%, the exposed share by 7.8 points.
# CUDA: not measured by this project yet (no GPU at hand when these were set); step time keeps 15%, the
# rest share the CPU figures. Re-measure before trusting them on a GPU.
STEP_TIME_THRESHOLDS = {DeviceKind.CPU: 0.15, DeviceKind.CUDA: 0.15}
MEMORY_THRESHOLDS = {DeviceKind.CPU: 0.02, DeviceKind.CUDA: 0.02}
EXPOSED_SHARE_THRESHOLDS_POINTS = {DeviceKind.CPU: 0.10, DeviceKind.CUDA: 0.10}

# The fastest unstalled step of a launch, judged where named (the A/B tier names it, harness/ab.py). Its
# threshold is the one the A/B tier's A/A runs support (docs/methodology.md, "Same-job A/B of timed figures").
FASTEST_STEP_THRESHOLDS = {DeviceKind.CPU: 0.05, DeviceKind.CUDA: 0.05}

METRICS = (
    GateMetric(name="step_time_unstalled_median_s", unit="ms", scale=1e3, margin=Margin.RELATIVE,
               thresholds=STEP_TIME_THRESHOLDS, per_launch=unstalled_median_step_time_s, recorded=_recorded_steps,
               missing_because="every timed step host-stalled"),
    GateMetric(name="step_time_unstalled_fastest_s", unit="ms", scale=1e3, margin=Margin.RELATIVE,
               thresholds=FASTEST_STEP_THRESHOLDS, per_launch=_scalar("step_time_unstalled_fastest_s"),
               recorded=_recorded_steps, missing_because="every timed step host-stalled"),
    GateMetric(name="peak_rss_bytes_max", unit="MiB", scale=1 / (1 << 20), margin=Margin.RELATIVE,
               thresholds=MEMORY_THRESHOLDS, per_launch=_scalar("peak_rss_bytes_max"),
               recorded=_has("peak_rss_bytes_max"), missing_because="not recorded"),
    GateMetric(name="peak_allocated_bytes_max", unit="MiB", scale=1 / (1 << 20), margin=Margin.RELATIVE,
               thresholds=MEMORY_THRESHOLDS, per_launch=_scalar("peak_allocated_bytes_max"),
               recorded=_has("peak_allocated_bytes_max"), missing_because="not recorded"),
    GateMetric(name="exposed_comm_share", unit="%", scale=100.0, margin=Margin.ABSOLUTE,
               thresholds=EXPOSED_SHARE_THRESHOLDS_POINTS, per_launch=_scalar("exposed_comm_share"),
               recorded=_has("exposed_comm_share"), missing_because="not recorded"),
)
METRIC_NAMES = tuple(m.name for m in METRICS)
# What `compare` judges when no metric is named: the fastest step is a second reading of step time, for a
# tier that names it, not a fifth metric of every comparison's family.
DEFAULT_METRIC_NAMES = tuple(name for name in METRIC_NAMES if name != "step_time_unstalled_fastest_s")
DEFAULT_ALPHA = 0.05


def pairs_beyond(low: Sequence[float], high: Sequence[float], margin: Margin, threshold: float) -> int:
    """Mann-Whitney's U against a shifted side: the (low, high) pairs in which the high side's value lies
    beyond the low side's by more than `threshold` (relative: h > l * (1 + t); absolute: h > l + t)."""
    if margin is Margin.ABSOLUTE:
        return sum(h > l + threshold for l in low for h in high)
    return sum(h > l * (1.0 + threshold) for l in low for h in high)


def p_values(base: Sequence[float], new: Sequence[float], metric: "GateMetric", threshold: float) -> tuple[float, float]:
    """(p of a regression beyond the threshold, p of an improvement beyond it): the exact one-sided
    Mann-Whitney test of the new launches against the base launches shifted by the threshold, each way."""
    up = pairs_beyond(base, new, metric.margin, threshold)
    down = pairs_beyond(new, base, metric.margin, threshold)
    return tail_probability(len(base), len(new), up), tail_probability(len(new), len(base), down)


def chance_of_firing(n_base: int, n_new: int) -> float:
    """The rule's false-positive probability at threshold 0 for exchangeable launches: 1 / C(n + m, n)."""
    return 1.0 / comb(n_base + n_new, n_base)


def holm(p_values: Sequence[float], alpha: float) -> list[bool]:
    """Holm's step-down (Holm 1979, "A simple sequentially rejective multiple test procedure"): which
    hypotheses to reject so that the chance of rejecting any true one is at most alpha, for any dependence
    between the tests. Sorted ascending, the j-th smallest p (j = 1..k) is rejected while every p up to it
    is <= alpha / (k - j + 1)."""
    k = len(p_values)
    rejected = [False] * k
    for j, i in enumerate(sorted(range(k), key=p_values.__getitem__)):
        if p_values[i] > alpha / (k - j):
            break
        rejected[i] = True
    return rejected


def launches_needed_a_side(alpha: float) -> int:
    """The smallest k with 1 / C(2k, k) <= alpha: how many launches a side an even split needs."""
    k = 1
    while chance_of_firing(k, k) > alpha:
        k += 1
    return k


def separation(base: Sequence[float], new: Sequence[float], margin: Margin) -> float | None:
    """How far apart the two sets of launches lie: > 0 when every new value is above every base value
    (min(new) / max(base) - 1, or min(new) - max(base) for an absolute margin), < 0 when every new value is
    below every base value (minus the same figure with the sides swapped), None when they overlap."""
    def above(low: Sequence[float], high: Sequence[float]) -> float | None:
        if min(high) <= max(low):
            return None
        if margin is Margin.ABSOLUTE:
            return min(high) - max(low)
        return min(high) / max(low) - 1.0 if max(low) > 0 else float("inf")
    up = above(base, new)
    if up is not None:
        return up
    down = above(new, base)
    return -down if down is not None else None


@dataclass(frozen=True)
class Judgement:
    label: str                    # the cell's spec label
    metric: GateMetric
    threshold: float
    base: tuple[float, ...]       # one value per judged launch
    new: tuple[float, ...]
    verdict: Verdict
    reason: str = ""              # NOT_JUDGED: why, in words; a call on overlapping launches: its pairs and p

    @property
    def separation(self) -> float | None:
        return separation(self.base, self.new, self.metric.margin) if self.base and self.new else None

    @property
    def shift(self) -> float | None:
        """The median over every (base, new) pair of new / base - 1 (new - base for an absolute margin): the
        Hodges-Lehmann estimate that goes with the Mann-Whitney test, shown where the launches overlap."""
        if not (self.base and self.new):
            return None
        if self.metric.margin is Margin.ABSOLUTE:
            return median(a - b for b in self.base for a in self.new)
        return median(a / b - 1.0 for b in self.base for a in self.new if b > 0)


def judge(base: Sequence[float], new: Sequence[float], metric: GateMetric, threshold: float) -> Verdict:
    """The rule on per-launch values (enough of them: the caller checks the minimum)."""
    gap = separation(base, new, metric.margin)
    if gap is not None and abs(gap) > threshold:
        return Verdict.REGRESSION if gap > 0 else Verdict.IMPROVEMENT
    return Verdict.SAME


@dataclass(frozen=True)
class GateResult:
    judgements: list[Judgement]
    not_compared: list[tuple[str, str]]    # (cell label, why): no ok launch on a side
    alpha: float = DEFAULT_ALPHA           # the chance of any false regression in the comparison, at most
    family: int = 0                        # metrics with values on both sides: Holm's k

    @property
    def launches_needed_a_side(self) -> int:
        """Launches a side that judge every metric of this family (1 / C(2N, N) <= alpha / k)."""
        return launches_needed_a_side(self.alpha / max(self.family, 1))

    def count(self, verdict: Verdict) -> int:
        return sum(j.verdict is verdict for j in self.judgements)

    @property
    def regressed(self) -> bool:
        return self.count(Verdict.REGRESSION) > 0


def check_thresholds(overrides: Mapping[str, float] | None) -> dict[str, float]:
    """`overrides` of the default thresholds, by metric name or "*" for every metric, checked."""
    overrides = dict(overrides or {})
    unknown = set(overrides) - set(METRIC_NAMES) - {"*"}
    if unknown:
        raise ValueError(f"no metric {sorted(unknown)[0]!r} to set a threshold for; known: {', '.join(METRIC_NAMES)}")
    bad = [value for value in overrides.values() if not (math.isfinite(value) and value >= 0)]
    if bad:   # nan would never be exceeded, so it would silence the gate
        raise ValueError(f"a threshold must be a finite number >= 0, got {bad[0]}")
    return overrides


def check_metrics(names: Sequence[str] | None) -> tuple[GateMetric, ...]:
    """The metrics a comparison judges: those named (DEFAULT_METRIC_NAMES when None), checked. Fewer metrics
    make a smaller family, which fewer launches a side can judge (the module's docstring)."""
    if not names:
        return tuple(m for m in METRICS if m.name in DEFAULT_METRIC_NAMES)
    unknown = [name for name in names if name not in METRIC_NAMES]
    if unknown:
        raise ValueError(f"no metric {unknown[0]!r} to judge; known: {', '.join(METRIC_NAMES)}")
    return tuple(m for m in METRICS if m.name in names)


def threshold_for(metric: GateMetric, device: DeviceKind, overrides: Mapping[str, float]) -> float:
    return overrides.get(metric.name, overrides.get("*", metric.thresholds[device]))


def gate(base: Sequence[Row], new: Sequence[Row], thresholds: Mapping[str, float] | None = None,
         alpha: float = DEFAULT_ALPHA, metrics: Sequence[str] | None = None) -> GateResult:
    """Judge every metric (or those named in `metrics`) of every cell that has ok launches in both `base`
    and `new` (raw rows; cells matched by identity, harness.derive.identity: the spec but its repeat count,
    and the link rate, placement and host type it was measured under); `thresholds` overrides by metric
    name. The family is the judged metrics alone."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    overrides = check_thresholds(thresholds)
    judged = check_metrics(metrics)
    raw = {"base": [_as_row(row) for row in base], "new": [_as_row(row) for row in new]}
    sides = {side: _by_cell(rows) for side, rows in raw.items()}
    # A cell is its spec under its conditions (harness.derive.identity): launches at another link rate,
    # placement or host type are never matched, and the label says which conditions a line is.
    shown = condition_labels(raw["base"] + raw["new"])
    labels = {cell: shown[cell]["label"] for cells in sides.values() for cell in cells}
    elsewhere = {side: _conditions_by_spec(rows) for side, rows in raw.items()}
    first_row = {cell_identity(row): row for row in reversed(raw["base"] + raw["new"])}
    values, not_compared = [], []
    for cell in sorted(labels, key=labels.__getitem__):
        rows = {side: cells.get(cell, []) for side, cells in sides.items()}
        ok = {side: [r for r in launches if r["status"] == "ok"] for side, launches in rows.items()}
        missing = [f"{_describe_missing(rows[side])} on the {side} side"
                   + _other_conditions(first_row[cell], elsewhere[side]) for side in sides if not ok[side]]
        if missing:
            not_compared.append((labels[cell], "; ".join(missing)))
            continue
        device = DeviceKind(ok["base"][0]["device"])   # part of the cell's identity: the same on both sides
        for metric in judged:
            found = _metric_values(labels[cell], metric, ok["base"], ok["new"],
                                   threshold_for(metric, device, overrides))
            if found is not None:
                values.append(found)
    return GateResult(judge_metrics(values, alpha), not_compared, alpha, _family_size(values))


def _as_row(row: Any) -> Row:
    return row.to_dict() if hasattr(row, "to_dict") else row      # a RunResult in hand is a row too


def _by_cell(rows: Sequence[Row]) -> dict[str, list[Launch]]:
    """Each row's derived launch record, by cell (its identity, recomputed from the row). The step-time
    metric uses the unstalled median whatever the basis, so the basis given here only fixes which
    throughput the record also carries."""
    cells: dict[str, list[Launch]] = {}
    for row in rows:
        cells.setdefault(cell_identity(row), []).append(launch_record(row, Basis.UNSTALLED))
    return cells


def _conditions_by_spec(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """spec -> {cell: its conditions} of one side's rows."""
    found: dict[str, dict[str, Any]] = {}
    for row in rows:
        found.setdefault(spec_id(row), {})[cell_identity(row)] = row_conditions(row)
    return found


def _other_conditions(row: Row, side: Mapping[str, dict[str, Any]]) -> str:
    """Where a side has the spec of `row`'s cell under other conditions only, which ones, so that the reader
    sees why its launches were not matched."""
    cell = cell_identity(row)
    others = [conditions for other, conditions in side.get(spec_id(row), {}).items() if other != cell]
    if not others:
        return ""
    return (f" (it has this spec measured under other conditions, never compared across them: "
            f"{describe_differences(row_conditions(row), others[0])})")


def _describe_missing(rows: list[Launch]) -> str:
    if not rows:
        return "no launch"
    statuses = ", ".join(sorted({r["status"] for r in rows}))
    return f"no ok launch ({len(rows)} {statuses})"


@dataclass(frozen=True)
class MetricValues:
    """One metric of one compared cell before any judgement: one value per launch that has one."""
    label: str
    metric: GateMetric
    threshold: float
    base: tuple[float, ...]
    new: tuple[float, ...]
    unrecorded_side: str = ""       # "base" or "new" when that side did not record the metric at all
    lost: tuple[str, ...] = ()      # launches that recorded the metric but have no value, and why

    @property
    def in_family(self) -> bool:
        return bool(self.base) and bool(self.new) and not self.unrecorded_side


def _family_size(values: Sequence[MetricValues]) -> int:
    return sum(v.in_family for v in values)


def judge_metrics(values: Sequence[MetricValues], alpha: float) -> list[Judgement]:
    """Every metric's verdict, the family (the metrics with values on both sides) held to alpha by Holm's
    step-down in each direction (the module's docstring says why)."""
    family = [i for i, v in enumerate(values) if v.in_family]
    k = len(family)
    needed = launches_needed_a_side(alpha / max(k, 1))
    rule = {i: judge(values[i].base, values[i].new, values[i].metric, values[i].threshold) for i in family}
    chance = {i: chance_of_firing(len(values[i].base), len(values[i].new)) for i in family}
    tails = {i: dict(zip((Verdict.REGRESSION, Verdict.IMPROVEMENT),
                         p_values(values[i].base, values[i].new, values[i].metric, values[i].threshold)))
             for i in family}
    called: dict[int, Verdict] = {}
    for direction in (Verdict.REGRESSION, Verdict.IMPROVEMENT):
        rejected = holm([tails[i][direction] for i in family], alpha)
        called.update((i, direction) for i, r in zip(family, rejected) if r)
    judgements = []
    for i, v in enumerate(values):
        counts = f"{len(v.base)} vs {len(v.new)} launches"
        lost = "".join(f"; {text}" for text in v.lost)
        if v.unrecorded_side:
            verdict, reason = Verdict.NOT_JUDGED, f"not recorded on the {v.unrecorded_side} side"
        elif not v.in_family:
            verdict, reason = Verdict.NOT_JUDGED, f"{counts} (needs {needed} a side){lost}"
        elif i in called:
            verdict, reason = called[i], ""
            if rule[i] is not called[i]:      # called on launches that overlap: say on what
                low, high = (v.base, v.new) if verdict is Verdict.REGRESSION else (v.new, v.base)
                pairs = pairs_beyond(low, high, v.metric.margin, v.threshold)
                reason = (f"{pairs} of {len(low) * len(high)} pairs beyond the threshold, p = "
                          f"{tails[i][verdict]:.2g}")
        elif chance[i] <= alpha / k:
            verdict, reason = Verdict.SAME, ""   # had the rule fired, Holm's first step would have rejected it
        else:
            fired = " apart beyond the threshold, not evidence" if rule[i] is not Verdict.SAME else ""
            verdict, reason = Verdict.NOT_JUDGED, (f"{counts}{fired} (chance {chance[i]:.2g} > alpha {alpha:g} / "
                                                   f"{k} metrics; needs {needed} a side){lost}")
        judgements.append(Judgement(v.label, v.metric, v.threshold, v.base, v.new, verdict, reason))
    return judgements


def _metric_values(label: str, metric: GateMetric, base_ok: list[Launch], new_ok: list[Launch],
                   threshold: float) -> MetricValues | None:
    recorded = {"base": [r for r in base_ok if metric.recorded(r)], "new": [r for r in new_ok if metric.recorded(r)]}
    if not recorded["base"] and not recorded["new"]:
        return None    # not a metric of this cell (GPU memory on CPU, exposed share of the plain loop)
    values = {side: tuple(v for v in map(metric.per_launch, rows) if v is not None) for side, rows in recorded.items()}
    unrecorded = [side for side, rows in recorded.items() if not rows]
    lost = tuple(f"{len(recorded[side]) - len(values[side])} {side} launch(es): {metric.missing_because}"
                 for side in recorded if len(recorded[side]) > len(values[side]))
    return MetricValues(label, metric, threshold, values["base"], values["new"],
                        unrecorded[0] if unrecorded else "", lost)
