"""`python -m harness project --validate ROWS --comm COMM`: every measured multi-rank cell predicted from
data that excludes it, and the errors.

    scripts/validate-projection.sh results/validation 50mbit 100mbit 200mbit      # measures, then validates

Rows are grouped by network setting: the conditions a row was measured under (harness.derive.identity: the
emulated network it records, environment.emulated_network, its placement and host type), named by the link
rate, or "not emulated"; each is calibrated by the comm rows of its own network. Within a setting, a cell of
strategy S at world size N is predicted by
harness.project.projection exactly as it projects measured rows, from:

- the **calibration**: the `harness comm` rows of that setting (collectives among 2 ranks, one per node),
  fitted by harness.project.fit, as a one-level network of that link; where the rows also hold the host's
  own `harness comm` rows (no emulated network), an emulated cell is priced on two levels (`on_nodes`): a
  group whose members share a node (tensor parallelism's pair at 2 nodes x 2 ranks) on the host's loopback,
  which is what the ranks of one emulated node talk over, and any other on the link;
- S's **world-size-1 cell**, whose step gives the compute (the projection's rule where such a cell exists),
  or, for a layout that needs several ranks (fsdp2-tp or autotp at tp 2, a pipeline of 2 stages), the plain
  loop's world-size-1 cell of the same workload, precision and micro-batch;
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

Which cells predict which (`Design`):
- **interpolate**: each multi-rank cell from its strategy's nearest other multi-rank world size of the same
  setting (2 <-> 4 ranks on the committed runs). The two cells of a pair predict each other, so their errors
  are not independent (they correlate at -0.84 on results/reference/emulated-reno), and the source cell's
  measured step already holds most of the answer;
- **larger**: each cell above `max_source_world_size` ranks (default 2) from its strategy's largest cell at or
  below it, in the same setting: 8 ranks on 8 emulated nodes from 2 ranks on 2, an extrapolation;
- **across-settings**: each multi-rank cell from its strategy's cell of the same world size at another
  setting: the schedule, f and compute measured at one link rate, priced on the other's `harness comm` rows
  (what a user does who measures on one network and asks about another).

**The baseline** beside every prediction: copy the source cell's measured step time (the median of its
launches). Whatever error and tau the model reaches, the baseline's say how much of it the source cell
already gave; the model earns only the difference.

**Terms** (`term_errors`): each held-out cell also has its own compute-only pass (harness.derive.exposed), the
same work with no communication, on the same time-sliced cores. The model's compute rule (the per-device
share of the samples, times the shared-cores factor) carries the world-size-1 cell's compute-only pass to N;
against the held-out cell's own pass that gives the compute term's error r_c. The model's compute (from the
world-size-1 *step*) corrected by it, C / (1 + r_c), leaves measured step - C / (1 + r_c) as the step beyond
compute the model should have predicted: against it, that term's error (its communication, f included).
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from harness.derive.beyond_ws1 import one_rank_launches
from harness.derive.identity import conditions_id, distinguishing_suffixes, network_of, network_tag, row_conditions
from harness.derive.rows import is_ok, measurements, options_text, spec
from harness.derive.server_link import dedicated_servers
from harness.derive.staleness import is_asynchronous
from harness.project.facts import REGISTRY_FACTS
from harness.project.collectives import CommModel
from harness.project.fit import Calibration, NodesCalibration, fit_calibration
from harness.project.projection import (Scaling, StrategyFacts, at_degree_one, bases_from_rows, compute_only_seconds,
                                        project, star_servers, unstalled_median_step_s)
from harness.record import COMMBENCH_KIND
from harness.spec import SpecError

NOT_EMULATED = "not emulated"
# Issue 20's bar for the emulated cluster: median and p90 absolute error of predicted step time, and the
# smallest Kendall tau of the strategies' ranking at any setting and world size.
MEDIAN_ERROR_BAR, P90_ERROR_BAR, TAU_BAR = 0.10, 0.20, 0.8
# Issue 33: an extrapolation whose median |error| exceeds this must say which term of the model is wrong.
EXTRAPOLATION_NOTE_BAR = 0.15
DEFAULT_MAX_SOURCE_WORLD_SIZE = 2


class Design(enum.StrEnum):
    """Which measured cells predict which (the module docstring)."""

    INTERPOLATE = "interpolate"
    LARGER = "larger"
    ACROSS_SETTINGS = "across-settings"


def setting_of(row: Mapping[str, Any]) -> str:
    """The network setting a row (cell or comm) was measured on: its emulated link rate, or NOT_EMULATED."""
    network = (row.get("environment") or {}).get("emulated_network") or {}
    rate = network.get("link_rate_bits_per_s")
    return f"{rate / 1e6:g} Mbit/s" if rate else NOT_EMULATED


def _rate(setting: str) -> float:
    return float(setting.split()[0]) if setting != NOT_EMULATED else math.inf


def shared_cores_factor(row: Mapping[str, Any], world_size: int) -> float:
    """max(1, N x threads per rank / the machine's cores) for an emulated row, N the ranks that compute: a
    dedicated parameter server's ranks wait on their links and are left out (their AdamW over P / S is a
    small part of a step: 1-2 ms of gpt-tiny's 50-100 here); 1 for a real row."""
    network = (row.get("environment") or {}).get("emulated_network") or {}
    cores = network.get("shared_machine_cores")
    if not cores:
        return 1.0
    threads = int(spec(row).get("threads_per_rank") or measurements(row).get("threads_per_rank") or 1)
    computing = world_size - dedicated_servers(measurements(row))
    return max(1.0, computing * threads / cores)


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
    source_setting: str = ""          # the setting the source cells were measured on ("" = `setting`)
    baseline_s: float | None = None   # the baseline: the source cell's measured step (median of its launches)
    measured_compute_s: float | None = None   # the held-out cell's own compute-only pass (median of launches)
    rule_compute_s: float | None = None       # the world-size-1 cell's compute-only pass carried to N by the
                                              # model's compute rule (per-device share x shared cores)
    options: str = ""                 # the cell's options (`ps` dedicated or colocated are two layouts)
    workers: int = 0                  # the ranks that run the model (a dedicated parameter server's workers);
                                      # 0: every one of `world_size`

    @property
    def ranks_working(self) -> int:
        """The ranks the model runs on: the world size but for a dedicated parameter server's servers; cells are
        compared (ranked, tabled) at the same number of them."""
        return self.workers or self.world_size

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_s / self.measured_s - 1.0

    @property
    def baseline_error(self) -> float | None:
        """The baseline's: the source cell's measured step / this cell's measured step - 1."""
        return None if self.baseline_s is None else self.baseline_s / self.measured_s - 1.0

    @property
    def source(self) -> str:
        """Where the prediction came from, in words: "2 ranks", or "2 ranks at 100 Mbit/s"."""
        where = f" at {self.source_setting}" if self.source_setting and self.source_setting != self.setting else ""
        return f"{self.source_world_size} ranks{where}"


@dataclass(frozen=True)
class Validation:
    cells: tuple[Checked, ...]
    taus: dict[tuple[str, int], float]        # (setting, world size): Kendall's tau of the strategies' ranking
    left_out: tuple[str, ...]
    design: Design = Design.INTERPOLATE
    baseline_taus: dict[tuple[str, int], float] | None = None   # the same, for the baseline's predictions

    @property
    def median_abs_error(self) -> float:
        return float(np.median([abs(c.error) for c in self.cells]))

    @property
    def p90_abs_error(self) -> float:
        return float(np.percentile([abs(c.error) for c in self.cells], 90))

    @property
    def baseline_errors(self) -> list[float]:
        return [abs(c.baseline_error) for c in self.cells if c.baseline_error is not None]

    @property
    def baseline_median_abs_error(self) -> float | None:
        return float(np.median(self.baseline_errors)) if self.baseline_errors else None

    @property
    def baseline_p90_abs_error(self) -> float | None:
        return float(np.percentile(self.baseline_errors, 90)) if self.baseline_errors else None

    @property
    def passes(self) -> bool:
        return (self.median_abs_error <= MEDIAN_ERROR_BAR and self.p90_abs_error <= P90_ERROR_BAR
                and all(tau >= TAU_BAR for tau in self.taus.values()))


def network_key(record: Mapping[str, Any]) -> str:
    return json.dumps(network_of(record), sort_keys=True)


def time_sliced(record: Mapping[str, Any]) -> bool:
    """Whether a `harness comm` record's ranks outnumbered the cores they ran on (an emulated cluster's
    namespaces share one machine's), so that its times hold their waits for a turn on a core."""
    environment = record.get("environment") or {}
    cores = (environment.get("emulated_network") or {}).get("shared_machine_cores") or environment.get("cpu_count")
    threads = int(record.get("threads_per_rank") or 1)
    return bool(cores) and int(record["world_size"]) * threads > int(cores)


def layout_of(record: Mapping[str, Any]) -> tuple[int, int, int]:
    """(world size, ranks of a group, their stride) a `harness comm` record measured under."""
    world_size = int(record["world_size"])
    return world_size, int(record.get("group_size") or world_size), int(record.get("group_stride") or 1)


def calibrations_by_network(comm_records: Iterable[Mapping[str, Any]]) -> dict[str, Calibration]:
    """A calibration per network the comm rows ran on (harness.derive.identity: its rate, shaping, TCP), from
    the rows whose ranks each had a core: those that waited on shared cores price only their own layout
    (`layouts_by_network`)."""
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for record in comm_records:
        if record.get("kind") == COMMBENCH_KIND and not time_sliced(record):
            grouped.setdefault(network_key(record), []).append(record)
    return {network: fit_calibration(records) for network, records in grouped.items()}


def layouts_by_network(comm_records: Iterable[Mapping[str, Any]]) -> dict[str, dict[tuple[int, int, int], Calibration]]:
    """Per network, a calibration per layout (`layout_of`) of the comm rows whose ranks outnumbered the cores:
    what a group of that layout costs in a step whose other ranks share its cores (NodesCalibration.layouts)."""
    grouped: dict[str, dict[tuple[int, int, int], list[Mapping[str, Any]]]] = {}
    for record in comm_records:
        if record.get("kind") == COMMBENCH_KIND and time_sliced(record):
            grouped.setdefault(network_key(record), {}).setdefault(layout_of(record), []).append(record)
    return {network: {layout: fit_calibration(records) for layout, records in layouts.items()}
            for network, layouts in grouped.items()}


def _settings(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """The rows by the conditions they were measured under (harness.derive.identity), each named by its
    link rate, with the conditions that tell it from another setting of the same rate where there is one."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(conditions_id(row), []).append(row)
    firsts = [members[0] for members in groups.values()]
    suffixes = distinguishing_suffixes([(setting_of(row), row_conditions(row)) for row in firsts])
    return {setting_of(row) + suffix[len(network_tag(row_conditions(row))):]: members
            for row, suffix, members in zip(firsts, suffixes, groups.values())}


def _strategy_key(row: Mapping[str, Any]) -> tuple:
    s = spec(row)
    return (s["workload"], s["strategy"], tuple(sorted((s.get("options") or {}).items())), s["precision"],
            s["micro_batch"])


def validate(rows: Sequence[Mapping[str, Any]], comm_records: Sequence[Mapping[str, Any]],
             facts: StrategyFacts = REGISTRY_FACTS, design: Design = Design.INTERPOLATE,
             max_source_world_size: int = DEFAULT_MAX_SOURCE_WORLD_SIZE) -> Validation:
    """Every ok multi-rank cell of `rows` that `design` gives a source for, predicted without it: from the
    comm rows of its own setting, and its strategy's world-size-1 cell and source cell (module docstring)."""
    design = Design(design)
    if isinstance(max_source_world_size, bool) or not isinstance(max_source_world_size, int) \
            or max_source_world_size < 2:
        raise SpecError(f"the largest source world size must be a whole number >= 2, got {max_source_world_size!r}")
    by_network = calibrations_by_network(comm_records)
    layouts = layouts_by_network(comm_records)
    loopback = by_network.get(network_key({}))      # `harness comm` on the host itself: no emulated network
    settings = _settings([row for row in rows if is_ok(row)])
    calibrations = {setting: by_network.get(network_key(members[0])) for setting, members in settings.items()}
    # {(setting, strategy key, world size, global batch): the launches of that cell}
    cells: dict[tuple, list[Mapping[str, Any]]] = {}
    for setting, members in settings.items():
        for row in members:
            cells.setdefault((setting, _strategy_key(row), spec(row)["world_size"], spec(row)["global_batch"]),
                             []).append(row)
    checked: list[Checked] = []
    left_out: list[str] = []
    for (setting, key, world_size, _), launches in sorted(cells.items(), key=lambda kv: (_rate(kv[0][0]), kv[0][2])):
        if world_size < 2:
            continue
        what = f"{setting}: {key[1]} at world size {world_size}"
        if is_asynchronous(measurements(launches[0])):
            left_out.append(f"{what}: asynchronous updates, measured and not predicted (the projection models "
                            "synchronous steps)")
            continue
        if design is Design.LARGER and world_size <= max_source_world_size:
            continue
        calibration = calibrations.get(setting)
        if calibration is None:
            left_out.append(f"{setting}: no `harness comm` rows of this setting to calibrate on")
            continue
        sources = _sources(design, setting, key, world_size, cells, max_source_world_size)
        if not sources:
            left_out.append(f"{what}: {_no_source(design, max_source_world_size)}")
            continue
        for source_setting, source in sources:
            ones = _one_rank_cell(cells, source_setting, key)
            measuring_host = calibrations.get(source_setting)
            where = what + (f" from {source_setting}" if source_setting != setting else "")
            if not ones or measuring_host is None:
                left_out.append(f"{where}: " + ("no ok world-size-1 cell" if not ones else
                                                "no `harness comm` rows of the source's setting"))
                continue
            try:
                checked.append(_check(setting, launches, source_setting, source, ones,
                                      on_nodes(measuring_host, loopback, source[0], layouts),
                                      on_nodes(calibration, loopback, launches[0], layouts), facts))
            except SpecError as error:
                left_out.append(f"{where}: {error}")
    if not checked:
        raise SpecError(f"nothing to validate ({design.value}): no ok multi-rank cell with a source cell, a "
                        "world-size-1 cell and comm rows of its setting; "
                        + ("; ".join(dict.fromkeys(left_out)) or "no cell rows in the files"))
    return Validation(cells=tuple(checked), taus=_taus(checked, lambda c: c.predicted_s),
                      left_out=tuple(dict.fromkeys(left_out)),
                      design=design, baseline_taus=_taus(checked, lambda c: c.baseline_s))


def on_nodes(calibration: Calibration, loopback: Calibration | None, row: Mapping[str, Any],
             layouts: Mapping[str, Mapping[tuple[int, int, int], Calibration]] | None = None) -> CommModel:
    """How the collectives of an emulated row's cell are priced: the ranks of one emulated node talk over its
    loopback, unshaped, as ranks on the host do, so a group inside a node is priced on the host's own
    `harness comm` rows (`loopback`) and any other on the link's (harness.project.fit.NodesCalibration); where
    the network's comm rows measured a layout whose ranks outnumbered the cores (`layouts_by_network`), a group
    of that layout in a step of that world size is priced on them. A row on real hosts, or rows without the
    host's calibration, are priced on `calibration` alone."""
    measured = (layouts or {}).get(network_key(row), {})
    if network_of(row) is None or (loopback is None and not measured):
        return calibration
    world_size = int(spec(row)["world_size"])
    nodes = int(spec(row).get("nnodes") or 1)
    # Without the host's rows, a group inside a node is priced as the link prices it (one level), as before.
    return NodesCalibration(within_node=loopback or calibration, across_nodes=calibration,
                            ranks_per_node=world_size // nodes, layouts=measured)


def _one_rank_cell(cells: Mapping[tuple, list], setting: str, key: tuple) -> list[Mapping[str, Any]]:
    """The launches of the strategy's world-size-1 cell at `setting`; where it has none (a layout that needs
    several ranks: fsdp2-tp or autotp at tp 2, a pipeline of 2 stages), its world-size-1 cell under other
    options (tp=1, stages=1: its own machinery on one rank), else the plain loop's of the same workload,
    precision and micro-batch, as harness.project.projection takes a basis's compute from."""
    own = [r for (s_, k, n, _), group in cells.items() if s_ == setting and k == key and n == 1 for r in group]
    if own:
        return own
    own = [r for (s_, k, n, _), group in cells.items()
           if s_ == setting and k[:2] + k[3:] == key[:2] + key[3:] and n == 1 and at_degree_one(dict(k[2]), dict(key[2]))
           for r in group]
    if own:
        return own
    plain = (key[0], "plain", (), *key[3:])
    return [r for (s_, k, n, _), group in cells.items() if s_ == setting and k == plain and n == 1 for r in group]


def _sources(design: Design, setting: str, key: tuple, world_size: int, cells: Mapping[tuple, list],
             max_source_world_size: int) -> list[tuple[str, list[Mapping[str, Any]]]]:
    """[(source setting, the source cell's launches)] for one held-out cell under `design`."""
    same = {n: group for (s_, k, n, _), group in cells.items() if s_ == setting and k == key and n >= 2}
    if design is Design.INTERPOLATE:
        others = [n for n in same if n != world_size]
        return [(setting, same[min(others)])] if others else []
    if design is Design.LARGER:
        below = [n for n in same if n <= max_source_world_size]
        return [(setting, same[max(below)])] if below else []
    return [(s_, group) for (s_, k, n, _), group in sorted(cells.items(), key=lambda kv: _rate(kv[0][0]))
            if s_ != setting and k == key and n == world_size]


def _no_source(design: Design, max_source_world_size: int) -> str:
    return {Design.INTERPOLATE: "no other multi-rank cell to take its schedule from",
            Design.LARGER: f"no multi-rank cell at or below {max_source_world_size} ranks to take its schedule from",
            Design.ACROSS_SETTINGS: "no cell of the same world size at another setting"}[design]


def _median_step(launches: Sequence[Mapping[str, Any]]) -> float | None:
    """The median over launches of each launch's median unstalled step."""
    steps = [t for t in (unstalled_median_step_s(measurements(r)) for r in launches) if t is not None]
    return float(np.median(steps)) if steps else None


def _check(setting: str, launches: Sequence[Mapping[str, Any]], source_setting: str,
           source: Sequence[Mapping[str, Any]], ones: Sequence[Mapping[str, Any]], measuring_host: CommModel,
           target: CommModel, facts: StrategyFacts) -> Checked:
    """The module docstring's prediction of the held-out cell (`launches`) from `source` (its strategy at
    world size M, measured on `source_setting`) and `ones` (its strategy at world size 1 there), as
    harness.project.projection projects measured rows: f is judged on the source's own network
    (`measuring_host`), the held-out cell's collectives priced on its own (`target`)."""
    row = launches[0]
    measured = _median_step(launches)
    if measured is None:
        raise SpecError("no unstalled step")
    bases, skipped = bases_from_rows([*ones, *source], facts, measuring_host, compute_factor=shared_cores_factor)
    # The source's basis: a world-size-1 cell under other options (tp=1) is one of its own beside it, which
    # gives the source its compute and is not what is projected.
    options = dict(spec(source[0]).get("options") or {})
    chosen = [b for b in bases if dict(b.options) == options]
    if len(chosen) != 1:
        raise SpecError(skipped[0] if skipped else f"{len(chosen)} bases of the source cell")
    [basis] = chosen
    n = int(spec(row)["world_size"])
    # The projection's N: the ranks that run the model (a dedicated parameter server's workers; its servers
    # share the machine's cores all the same).
    workers = n - star_servers(facts, basis.strategy, basis.options)
    scaling = Scaling.STRONG if spec(row)["global_batch"] == basis.global_batch else Scaling.WEAK
    if scaling is Scaling.WEAK and spec(row)["global_batch"] / workers != basis.per_device_batch:
        raise SpecError(f"global batch {spec(row)['global_batch']} is neither world size {basis.world_size}'s "
                        f"({basis.global_batch}) nor {workers} x its per-device batch")
    # project() scales compute_s by the per-device share at N; the shared cores stretch it at N.
    at_n = replace(basis, compute_s=basis.compute_s * shared_cores_factor(row, n))
    [point], _ = project(at_n, [workers], target, facts, [scaling])
    computes = [c for c in (compute_only_seconds(measurements(r)) for r in launches) if c is not None]
    # The world-size-1 launches the basis took its compute from (one batch: harness.derive.beyond_ws1).
    held_against, _ = one_rank_launches(ones, basis.per_device_batch)
    one_device = [c for c in (compute_only_seconds(measurements(r)) for r in held_against) if c is not None]
    rule_compute = (float(np.median(one_device)) * (spec(row)["global_batch"] / workers)
                    / spec(held_against[0])["global_batch"] * shared_cores_factor(row, n)) if one_device else None
    return Checked(setting=setting, strategy=spec(row)["strategy"], label=basis.label, world_size=n,
                   options=options_text(row), workers=workers,
                   source_world_size=int(basis.world_size), scaling=scaling, measured_s=measured,
                   predicted_s=point.step_s, compute_s=point.compute_s, exposed_s=point.exposed_s,
                   exposed_fraction=basis.exposed_fraction, launches=len(launches), source_setting=source_setting,
                   baseline_s=_median_step(source),
                   measured_compute_s=float(np.median(computes)) if computes else None, rule_compute_s=rule_compute)


def _taus(checked: Sequence[Checked], predicted: Callable[[Checked], float | None]) -> dict[tuple[str, int], float]:
    """Kendall's tau between measured and `predicted` step times of the strategies at each (setting, world
    size); where a cell was predicted from several source settings, from each of them in turn (by source)."""
    from scipy.stats import kendalltau

    groups: dict[tuple[str, int], list[Checked]] = {}
    for cell in checked:
        if predicted(cell) is not None:
            groups.setdefault((_pair(cell), cell.ranks_working), []).append(cell)
    taus = {}
    for key, cells in groups.items():
        if len(cells) >= 2:
            taus[key] = float(kendalltau([c.measured_s for c in cells], [predicted(c) for c in cells]).statistic)
    return taus


def _pair(cell: Checked) -> str:
    """The setting a cell was held out on, and the other one it was predicted from where they differ."""
    if cell.source_setting and cell.source_setting != cell.setting:
        return f"{cell.setting} from {cell.source_setting}"
    return cell.setting


def _pair_order(pair: str) -> tuple[float, float]:
    target, _, source = pair.partition(" from ")
    return (_rate(target), _rate(source) if source else 0.0)


def term_errors(cells: Sequence[Checked]) -> dict[str, float | None]:
    """Median error of each term of the model over `cells` (the module docstring's "Terms"): compute, r_c =
    rule compute / the held-out cell's compute-only pass - 1; beyond compute, the predicted step beyond compute
    / (measured step - predicted compute / (1 + r_c)) - 1. Cells without both compute-only passes, or with no positive exposed
    time left, are left out of a term."""
    compute, exposed = [], []
    for c in cells:
        if not (c.measured_compute_s and c.rule_compute_s):
            continue
        r_c = c.rule_compute_s / c.measured_compute_s - 1
        compute.append(r_c)
        left = c.measured_s - c.compute_s / (1 + r_c)
        if left > 0:
            exposed.append(c.exposed_s / left - 1)
    return {"compute": float(np.median(compute)) if compute else None,
            "beyond compute": float(np.median(exposed)) if exposed else None}


def format_validation(result: Validation) -> str:
    header = (f"{'setting':<14} {'strategy':<9} {'N':>2} {'from':<22} {'scaling':<7} {'launches':>8} "
              f"{'measured ms':>11} {'predicted ms':>12} {'error':>7} {'baseline':>8}   {'compute ms':>10} "
              f"{'(measured)':>10} {'beyond ms':>10} {'(measured)':>10} {'f':>5}")
    lines = [f"parbench: projection validation ({result.design.value}): each multi-rank cell predicted without it, "
             "from its setting's comm rows and its strategy's world-size-1 step and source cell (`from`); "
             "baseline: the source cell's measured step copied", header, "-" * len(header)]
    names = cell_names(result.cells)
    for c in result.cells:
        baseline = f"{c.baseline_error:+.1%}" if c.baseline_error is not None else "-"
        r_c = (c.rule_compute_s / c.measured_compute_s - 1) if c.measured_compute_s and c.rule_compute_s else None
        measured_compute = f"{c.compute_s / (1 + r_c) * 1e3:.1f}" if r_c is not None else "-"
        measured_exposed = f"{(c.measured_s - c.compute_s / (1 + r_c)) * 1e3:.1f}" if r_c is not None else "-"
        lines.append(f"{c.setting:<14} {names[id(c)]:<9} {c.world_size:>2} {c.source:<22} {c.scaling.value:<7} "
                     f"{c.launches:>8} {c.measured_s * 1e3:>11.1f} {c.predicted_s * 1e3:>12.1f} {c.error:>+7.1%} "
                     f"{baseline:>8}   {c.compute_s * 1e3:>10.1f} {measured_compute:>10} {c.exposed_s * 1e3:>10.1f} "
                     f"{measured_exposed:>10} {c.exposed_fraction:>5.2f}")
    lines.append("")
    lines.append(f"{len(result.cells)} cells: median |error| {result.median_abs_error:.1%} (bar {MEDIAN_ERROR_BAR:.0%}), "
                 f"p90 |error| {result.p90_abs_error:.1%} (bar {P90_ERROR_BAR:.0%})")
    if result.baseline_median_abs_error is not None:
        lines.append(f"baseline (the source cell's step copied): median |error| "
                     f"{result.baseline_median_abs_error:.1%}, p90 |error| {result.baseline_p90_abs_error:.1%}")
    terms = term_errors(result.cells)
    lines.append("terms, against the held-out cells' compute-only passes ((measured) columns; median error): "
                 + ", ".join(f"{name} {value:+.1%}" if value is not None else f"{name} -"
                             for name, value in terms.items()))
    baseline_taus = result.baseline_taus or {}
    for (pair, n), tau in sorted(result.taus.items(), key=lambda kv: (_pair_order(kv[0][0]), kv[0][1])):
        copied = baseline_taus.get((pair, n))
        lines.append(f"ranking at {pair}, {n} ranks running the model: Kendall tau {tau:+.2f} (bar {TAU_BAR})"
                     + (f"; baseline {copied:+.2f}" if copied is not None else ""))
    lines.append(f"verdict: {'within' if result.passes else 'outside'} the bars")
    lines += [f"left out: {note}" for note in result.left_out]
    return "\n".join(lines)


def cell_names(cells: Sequence[Checked]) -> dict[int, str]:
    """{id(cell): its column's name}: the strategy, with its options where cells of that strategy ran with several
    (ps colocated and with dedicated servers are different layouts, never one column)."""
    layouts: dict[str, set[str]] = {}
    for c in cells:
        layouts.setdefault(c.strategy, set()).add(c.options)
    return {id(c): f"{c.strategy}[{c.options}]" if len(layouts[c.strategy]) > 1 and c.options else c.strategy
            for c in cells}


def markdown_table(*results: Validation) -> str:
    """One line per setting (and source setting, across settings) of each result: each strategy's error at
    each held-out world size, the median and p90 |error| and the ranking's tau, the model's and beside them
    the baseline's (the source cell's step copied). Lines of the larger design say which world sizes were
    predicted from which. The tables README.md and docs/clusters.md show, kept true by tests."""
    every = [c for result in results for c in result.cells]
    names = cell_names(every)
    strategies = list(dict.fromkeys(names[id(c)] for c in every))
    sizes = sorted({c.ranks_working for c in every})
    per_size = " / ".join(str(n) for n in sizes)
    counted = "ranks" if all(c.ranks_working == c.world_size for c in every) else "workers"
    lines = [f"| link | {' | '.join(strategies)} | median | p90 | tau ({per_size} {counted}) "
             f"| baseline median | baseline p90 | baseline tau |",
             "|" + " --- |" * (len(strategies) + 7)]
    for result in results:
        baseline_taus = result.baseline_taus or {}
        for pair in sorted({_pair(c) for c in result.cells}, key=_pair_order):
            cells = [c for c in result.cells if _pair(c) == pair]
            errors = {(names[id(c)], c.ranks_working): c.error for c in cells}
            shown = [" / ".join(f"{errors[s, n]:+.0%}" if (s, n) in errors else "-" for n in sizes)
                     for s in strategies]
            magnitudes = [abs(c.error) for c in cells]
            copied = [abs(c.baseline_error) for c in cells if c.baseline_error is not None]

            def taus(found: Mapping[tuple[str, int], float]) -> str:
                return " / ".join(f"{found[pair, n]:+.2f}" if (pair, n) in found else "-" for n in sizes)

            name = pair
            if result.design is Design.LARGER:
                targets = " / ".join(str(n) for n in sorted({c.world_size for c in cells}))
                sources = " / ".join(str(n) for n in sorted({c.source_world_size for c in cells}))
                name = f"{pair}, {targets} from {sources} ranks"
            baseline = (f"{np.median(copied):.1%} | {np.percentile(copied, 90):.1%}" if copied else "- | -")
            lines.append(f"| {name} | {' | '.join(shown)} | {np.median(magnitudes):.1%} | "
                         f"{np.percentile(magnitudes, 90):.1%} | {taus(result.taus)} | {baseline} | "
                         f"{taus(baseline_taus)} |")
    return "\n".join(lines)
