"""`python -m harness project --validate ROWS --comm COMM`: every measured multi-rank cell predicted from
data that excludes it, and the errors.

    scripts/validate-projection.sh results/validation 50mbit 100mbit 200mbit      # measures, then validates

Rows are grouped by network setting: the emulated link rate a row records (environment.emulated_network,
harness.emulate), or "not emulated". Within a setting, a cell of strategy S at world size N is predicted by
harness.project.projection exactly as it projects measured rows, from:

- the **calibration**: the `harness comm` rows of that setting (collectives among 2 ranks, one per node),
  fitted by harness.project.fit, as a one-level network of that link;
- S's **world-size-1 cell**, whose step gives the compute (the projection's rule where such a cell exists);
- S's **other multi-rank cell** of the setting (world size M != N, the nearest): its counted schedule,
  carried from M to N by S's own expected traffic, and its f = (step - compute) / priced comm at M;
- **shared cores**: the emulated nodes are namespaces of one machine, so N ranks of T threads share its C
  cores: compute at M and at N is multiplied by max(1, ranks x T / C) (time-slicing), from the row's
  recorded cores and threads. A real cluster's nodes have their own cores; this term is the emulation's.

A cell launched several times (`harness run --repeats`) is one held-out cell: its measured step is the
median over its launches of each launch's median step, and the rows it is predicted from are all the
launches of the source cells, which harness.project.projection reduces to medians the same way. On
time-sliced cores one launch of these cells differs from the next by about 2% (median) and up to 26%
(results/reference/emulated-reno; up to 115% in an earlier run), and a prediction carries its own cell's
noise and its source cell's.

The cell's own step time is used only to measure the error. The ranking check is Kendall's tau
(scipy.stats.kendalltau, tau-b) between predicted and measured step times of the strategies at each
setting and world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from harness.derive.rows import is_ok, measurements, spec
from harness.project.facts import REGISTRY_FACTS
from harness.project.fit import Calibration, fit_calibration
from harness.project.projection import Scaling, StrategyFacts, bases_from_rows, project, unstalled_median_step_s
from harness.record import COMMBENCH_KIND
from harness.spec import SpecError

NOT_EMULATED = "not emulated"
# Issue 20's bar for the emulated cluster: median and p90 absolute error of predicted step time, and the
# smallest Kendall tau of the strategies' ranking at any setting and world size.
MEDIAN_ERROR_BAR, P90_ERROR_BAR, TAU_BAR = 0.10, 0.20, 0.8


def setting_of(row: Mapping[str, Any]) -> str:
    """The network setting a row (cell or comm) was measured on: its emulated link rate, or NOT_EMULATED."""
    network = (row.get("environment") or {}).get("emulated_network") or {}
    rate = network.get("link_rate_bits_per_s")
    return f"{rate / 1e6:g} Mbit/s" if rate else NOT_EMULATED


def _rate(setting: str) -> float:
    return float(setting.split()[0]) if setting != NOT_EMULATED else math.inf


def shared_cores_factor(row: Mapping[str, Any], world_size: int) -> float:
    """max(1, N x threads per rank / the machine's cores) for an emulated row; 1 for a real one."""
    network = (row.get("environment") or {}).get("emulated_network") or {}
    cores = network.get("shared_machine_cores")
    if not cores:
        return 1.0
    threads = int(spec(row).get("threads_per_rank") or measurements(row).get("threads_per_rank") or 1)
    return max(1.0, world_size * threads / cores)


@dataclass(frozen=True)
class Checked:
    """One held-out cell: what was measured and what was predicted without it."""

    setting: str
    strategy: str
    label: str
    world_size: int
    source_world_size: int            # the strategy's other cell, whose schedule and overlap were used
    scaling: Scaling
    measured_s: float
    predicted_s: float
    compute_s: float
    exposed_s: float
    exposed_fraction: float
    launches: int = 1                 # launches of the held-out cell whose median step is `measured_s`

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_s / self.measured_s - 1.0


@dataclass(frozen=True)
class Validation:
    cells: tuple[Checked, ...]
    taus: dict[tuple[str, int], float]        # (setting, world size): Kendall's tau of the strategies' ranking
    left_out: tuple[str, ...]

    @property
    def median_abs_error(self) -> float:
        return float(np.median([abs(c.error) for c in self.cells]))

    @property
    def p90_abs_error(self) -> float:
        return float(np.percentile([abs(c.error) for c in self.cells], 90))

    @property
    def passes(self) -> bool:
        return (self.median_abs_error <= MEDIAN_ERROR_BAR and self.p90_abs_error <= P90_ERROR_BAR
                and all(tau >= TAU_BAR for tau in self.taus.values()))


def calibrations_by_setting(comm_records: Iterable[Mapping[str, Any]]) -> dict[str, Calibration]:
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for record in comm_records:
        if record.get("kind") == COMMBENCH_KIND:
            grouped.setdefault(setting_of(record), []).append(record)
    return {setting: fit_calibration(records) for setting, records in grouped.items()}


def _strategy_key(row: Mapping[str, Any]) -> tuple:
    s = spec(row)
    return (s["workload"], s["strategy"], tuple(sorted((s.get("options") or {}).items())), s["precision"],
            s["micro_batch"])


def _basis_key(basis: Basis) -> tuple:
    return (basis.workload, basis.strategy, tuple(sorted(basis.options.items())), basis.precision, basis.micro_batch)


def validate(rows: Sequence[Mapping[str, Any]], comm_records: Sequence[Mapping[str, Any]],
             facts: StrategyFacts = REGISTRY_FACTS) -> Validation:
    """Every ok multi-rank cell of `rows` predicted without it: from its setting's comm rows, its strategy's
    world-size-1 cell, and its strategy's other multi-rank cells of the setting."""
    calibrations = calibrations_by_setting(comm_records)
    by_setting: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_setting.setdefault(setting_of(row), []).append(row)
    checked: list[Checked] = []
    left_out: list[str] = []
    for setting, members in sorted(by_setting.items(), key=lambda kv: _rate(kv[0])):
        calibration = calibrations.get(setting)
        if calibration is None:
            left_out.append(f"{setting}: no `harness comm` rows of this setting to calibrate on")
            continue
        multi = [r for r in members if is_ok(r) and spec(r)["world_size"] >= 2]
        launches: dict[tuple, list[Mapping[str, Any]]] = {}
        for row in multi:
            launches.setdefault((_strategy_key(row), spec(row)["world_size"], spec(row)["global_batch"]), []).append(row)
        for (key, world_size, _), cell in launches.items():
            row = cell[0]
            what = f"{setting}: {spec(row)['strategy']} at world size {world_size}"
            others = [r for r in multi if _strategy_key(r) == key and spec(r)["world_size"] != world_size]
            steps = [t for t in (unstalled_median_step_s(measurements(r)) for r in cell) if t is not None]
            measured = float(np.median(steps)) if steps else None
            ones = [r for r in members if is_ok(r) and spec(r)["world_size"] == 1
                    and _strategy_key(r) == _strategy_key(row)]
            if not ones or not others or measured is None:
                left_out.append(f"{what}: " + ("no ok world-size-1 cell" if not ones
                                               else "no other multi-rank cell to take its schedule from"
                                               if not others else "no unstalled step"))
                continue
            try:
                checked.append(replace(_check(setting, row, others, ones, calibration, facts, measured),
                                       launches=len(steps)))
            except SpecError as error:
                left_out.append(f"{what}: {error}")
    if not checked:
        raise SpecError("nothing to validate: no ok multi-rank cell with a world-size-1 cell, another multi-rank "
                        "cell and comm rows of its setting; " + ("; ".join(left_out) or "no cell rows in the files"))
    return Validation(cells=tuple(checked), taus=_taus(checked), left_out=tuple(left_out))


def _check(setting: str, row: Mapping[str, Any], others: Sequence[Mapping[str, Any]],
           ones: Sequence[Mapping[str, Any]], calibration: Calibration, facts: StrategyFacts,
           measured: float) -> Checked:
    """The module docstring's prediction of `row` from `others` (its strategy at another world size M) and
    `ones` (its strategy at world size 1), as harness.project.projection projects measured rows."""
    nearest = min(spec(r)["world_size"] for r in others)
    source = [r for r in others if spec(r)["world_size"] == nearest]
    [basis], skipped = bases_from_rows([*ones, *source], facts, calibration, compute_factor=shared_cores_factor)
    if skipped:
        raise SpecError(skipped[0])
    n = int(spec(row)["world_size"])
    scaling = Scaling.STRONG if spec(row)["global_batch"] == basis.global_batch else Scaling.WEAK
    if scaling is Scaling.WEAK and spec(row)["global_batch"] / n != basis.per_device_batch:
        raise SpecError(f"global batch {spec(row)['global_batch']} is neither world size {basis.world_size}'s "
                        f"({basis.global_batch}) nor {n} x its per-device batch")
    # project() scales compute_s by the per-device share at N; the shared cores stretch it at N.
    at_n = replace(basis, compute_s=basis.compute_s * shared_cores_factor(row, n))
    [point], _ = project(at_n, [n], calibration, facts, [scaling])
    return Checked(setting=setting, strategy=spec(row)["strategy"], label=basis.label, world_size=n,
                   source_world_size=int(basis.world_size), scaling=scaling, measured_s=measured,
                   predicted_s=point.step_s, compute_s=point.compute_s, exposed_s=point.exposed_s,
                   exposed_fraction=basis.exposed_fraction)


def _taus(checked: Sequence[Checked]) -> dict[tuple[str, int], float]:
    from scipy.stats import kendalltau

    groups: dict[tuple[str, int], list[Checked]] = {}
    for cell in checked:
        groups.setdefault((cell.setting, cell.world_size), []).append(cell)
    taus = {}
    for key, cells in groups.items():
        if len(cells) >= 2:
            taus[key] = float(kendalltau([c.measured_s for c in cells], [c.predicted_s for c in cells]).statistic)
    return taus


def format_validation(result: Validation) -> str:
    header = (f"{'setting':<14} {'strategy':<9} {'N':>2} {'from':>4} {'scaling':<7} {'launches':>8} "
              f"{'measured ms':>11} {'predicted ms':>12} {'error':>7}   {'compute ms':>10} {'beyond ms':>10} {'f':>5}")
    lines = ["parbench: projection validation: each multi-rank cell predicted without it, from its setting's comm "
             "rows, its strategy's world-size-1 step and its strategy's cell at world size `from`", header,
             "-" * len(header)]
    for c in result.cells:
        lines.append(f"{c.setting:<14} {c.strategy:<9} {c.world_size:>2} {c.source_world_size:>4} {c.scaling.value:<7} {c.launches:>8} "
                     f"{c.measured_s * 1e3:>11.1f} {c.predicted_s * 1e3:>12.1f} {c.error:>+7.1%}   "
                     f"{c.compute_s * 1e3:>10.1f} {c.exposed_s * 1e3:>10.1f} {c.exposed_fraction:>5.2f}")
    lines.append("")
    lines.append(f"{len(result.cells)} cells: median |error| {result.median_abs_error:.1%} (bar {MEDIAN_ERROR_BAR:.0%}), "
                 f"p90 |error| {result.p90_abs_error:.1%} (bar {P90_ERROR_BAR:.0%})")
    for (setting, n), tau in sorted(result.taus.items(), key=lambda kv: (_rate(kv[0][0]), kv[0][1])):
        lines.append(f"ranking at {setting}, world size {n}: Kendall tau {tau:+.2f} (bar {TAU_BAR})")
    lines.append(f"verdict: {'within' if result.passes else 'outside'} the bars")
    lines += [f"left out: {note}" for note in result.left_out]
    return "\n".join(lines)


def markdown_table(result: Validation) -> str:
    """Per setting: each strategy's error at 2 / 4 ranks, the median and p90 |error| and the ranking's
    tau at 2 / 4 ranks (the table docs/clusters.md shows, kept true by a test)."""
    strategies = list(dict.fromkeys(c.strategy for c in result.cells))
    settings = sorted({c.setting for c in result.cells}, key=_rate)
    sizes = sorted({c.world_size for c in result.cells})
    per_size = " / ".join(str(n) for n in sizes)
    lines = [f"| link | {' | '.join(strategies)} | median | p90 | tau ({per_size} ranks) |",
             "|" + " --- |" * (len(strategies) + 4)]
    for setting in settings:
        cells = [c for c in result.cells if c.setting == setting]
        errors = {(c.strategy, c.world_size): c.error for c in cells}
        shown = [" / ".join(f"{errors[s, n]:+.0%}" if (s, n) in errors else "-" for n in sizes) for s in strategies]
        magnitudes = [abs(c.error) for c in cells]
        taus = " / ".join(f"{result.taus[setting, n]:+.2f}" if (setting, n) in result.taus else "-" for n in sizes)
        lines.append(f"| {setting} | {' | '.join(shown)} | {np.median(magnitudes):.1%} | "
                     f"{np.percentile(magnitudes, 90):.1%} | {taus} |")
    return "\n".join(lines)
