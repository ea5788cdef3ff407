"""Projected rows in the report: the projected efficiency curve of each strategy with its band, and the
measured points of the same strategy and workload on top, each labelled as what it is.

    python -m harness project results/reference/ci-cpu/full.jsonl --comm results/reference/ci-cpu/comm-ws2.jsonl \
        --world-sizes 1,2,4,8 --out proj.jsonl
    python -m harness report results/reference/ci-cpu/full.jsonl proj.jsonl --out report/

Projected rows (kind "projection", written by harness/project/projection.py `projected_record`) are read
here only, by kind; they never enter the verdicts, the measured plots or the table.

A projected row's efficiency E(N) is against the projection's own one-device step, and is inversely
proportional to its projected step time T(N) (E = T(1) / (N T(N)) strong, T(1) / T(N) weak, the
reference fixed), so the step-time band [T_low, T_high] gives the efficiency band
[E T / T_high, E T / T_low]: the slow end of the step is the low end of the efficiency. A row without a
band (a described cluster has no calibration residuals to draw one from) is drawn as a line, and its
figure says so. Measured points are `harness.derive.scaling`'s efficiencies against the same strategy's
measured world size 1, at the projection's global batch (strong) or per-device batch (weak).

SVG ids name what each element is, so a browser or a test can find them: `projected-{scaling}-{cell}`
(the line), `projected-band-{scaling}-{cell}` and `measured-{scaling}-{cell}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from harness.record import PROJECTION_KIND, read_rows
from harness.report.plots import figure, legend_outside, svg
from harness.report.verdicts import cell_name

SCALINGS = ("weak", "strong")
NO_INTERVAL_CLUSTER = "no interval: described cluster"


@dataclass(frozen=True, kw_only=True)
class Point:
    world_size: int
    efficiency: float
    low: float | None
    high: float | None


@dataclass(frozen=True, kw_only=True)
class Curve:
    workload: str
    precision: str
    target: str
    target_kind: str
    scaling: str
    cell: str                   # strategy[options] and the conditions its basis was measured under
    strategy: str
    options: str
    batch: float                # strong: the global batch; weak: the batch per device
    points: list[Point]
    measured_under: str = ""    # "@50Mbit/s": the basis's conditions (harness.derive.identity), "" where one set


def read_projections(paths: Iterable) -> list[dict[str, Any]]:
    return read_rows(list(paths), kind=PROJECTION_KIND)


def target_label(row: Mapping[str, Any]) -> tuple[str, str]:
    """(what the projection priced communication on, its kind: "cluster" or "calibration")."""
    target = (row.get("inputs") or {}).get("target") or {}
    kind = str(target.get("kind", "unknown"))
    if kind == "cluster":
        return f"cluster {target.get('name', '?')}", kind
    if kind == "calibration":
        return f"calibrated {target.get('backend', '?')}/{target.get('device', '?')} host", kind
    return kind, kind


def efficiency_band(row: Mapping[str, Any]) -> Point:
    """The row's efficiency and its band from the step-time band (module docstring)."""
    efficiency = float(row[f"{row['scaling']}_efficiency_vs_1_device"])
    step, low, high = row["step_time_s"], row.get("step_time_low_s"), row.get("step_time_high_s")
    if low is None or high is None:
        return Point(world_size=int(row["world_size"]), efficiency=efficiency, low=None, high=None)
    return Point(world_size=int(row["world_size"]), efficiency=efficiency,
                 low=efficiency * step / high, high=efficiency * step / low)


def curves(projections: Sequence[Mapping[str, Any]]) -> list[Curve]:
    """One curve per workload, precision, target, scaling and strategy; a world size projected twice (a
    file appended to again) shows its last projection."""
    latest: dict[tuple, Mapping[str, Any]] = {}
    for row in projections:
        target, _ = target_label(row)
        options = ",".join(f"{k}={v}" for k, v in sorted((row.get("options") or {}).items()))
        # A basis measured under other conditions (another link rate: harness.derive.identity) is its own curve.
        key = (row["workload"], row.get("precision", ""), target, row["scaling"], row["strategy"], options,
               row.get("measured_under") or "")
        latest[key + (int(row["world_size"]),)] = row
    grouped: dict[tuple, list[Mapping[str, Any]]] = {}
    for key, row in latest.items():
        grouped.setdefault(key[:-1], []).append(row)
    result = []
    for (workload, precision, target, scaling, strategy, options, measured_under), rows in grouped.items():
        rows = sorted(rows, key=lambda r: r["world_size"])
        batch = rows[0]["global_batch"] if scaling == "strong" else rows[0]["per_device_batch"]
        result.append(Curve(workload=workload, precision=precision, target=target,
                            target_kind=target_label(rows[0])[1], scaling=scaling,
                            cell=cell_name({"strategy": strategy, "options": options}) + measured_under,
                            strategy=strategy, options=options, batch=float(batch),
                            points=[efficiency_band(r) for r in rows], measured_under=measured_under))
    return result


def measured_points(summary: pd.DataFrame, curve: Curve) -> list[tuple[int, float]]:
    """(world size, efficiency vs the same strategy's world size 1) of measured cells of the curve's
    workload, strategy, options and precision, at its global batch (strong) or per-device batch (weak)."""
    column = f"{curve.scaling}_efficiency_vs_ws1"
    if summary.empty or column not in summary:
        return []
    cells = summary[(summary["workload"] == curve.workload) & (summary["strategy"] == curve.strategy)
                    & (summary["options"].fillna("") == curve.options) & (summary["precision"] == curve.precision)
                    & (summary["status"] == "ok") & ~summary["shared_device"].astype(bool)
                    & summary[column].notna()]
    if "conditions" in cells:     # the cells measured under the conditions of the curve's basis
        cells = cells[cells["conditions"].fillna("") == curve.measured_under]
    batch = cells["global_batch"] if curve.scaling == "strong" else cells["global_batch"] / cells["world_size"]
    cells = cells[batch == curve.batch]
    return sorted((int(ws), float(e)) for ws, e in zip(cells["world_size"], cells[column]))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text)


def plot_projection(found: Sequence[Curve], summary: pd.DataFrame) -> tuple[str, list[str]]:
    """One figure (a panel per scaling) for curves of one workload, precision and target; with the
    notes to print under it."""
    scalings = [s for s in SCALINGS if any(c.scaling == s for c in found)]
    fig, [axes] = figure(len(scalings))
    cells = list(dict.fromkeys(c.cell for c in found))
    colors = {cell: f"C{i % 10}" for i, cell in enumerate(cells)}
    banded = unbanded = measured_any = False
    notes = []
    for axis, scaling in zip(axes, scalings):
        ticks: set[int] = set()
        top = 1.0
        for curve in (c for c in found if c.scaling == scaling):
            color = colors[curve.cell]
            sizes = [p.world_size for p in curve.points]
            # Small markers: a curve of one world size is still seen.
            axis.plot(sizes, [p.efficiency for p in curve.points], color=color, linewidth=1.5, marker="o",
                      markersize=2.5, gid=f"projected-{scaling}-{_slug(curve.cell)}")
            band = [p for p in curve.points if p.low is not None]
            if band:
                banded = True
                axis.fill_between([p.world_size for p in band], [p.low for p in band], [p.high for p in band],
                                  color=color, alpha=0.2, linewidth=0,
                                  gid=f"projected-band-{scaling}-{_slug(curve.cell)}")
                top = max(top, max(p.high for p in band))
            if len(band) < len(curve.points):
                unbanded = True
            measured = measured_points(summary, curve)
            if measured:
                measured_any = True
                axis.plot([w for w, _ in measured], [e for _, e in measured], linestyle="none", marker="D",
                          markersize=6, color=color, markeredgecolor="black", zorder=4,
                          gid=f"measured-{scaling}-{_slug(curve.cell)}")
                top = max(top, max(e for _, e in measured))
            ticks.update(sizes + [w for w, _ in measured])
            top = max(top, max(p.efficiency for p in curve.points))
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        axis.minorticks_off()
        axis.set_ylim(0, top * 1.08)
        axis.set_xlabel("world size (devices)")
        axis.set_ylabel("efficiency vs 1 device (1 = perfect)")
        axis.set_title(f"{found[0].workload}, {scaling} scaling: {found[0].target}", fontsize=9)
        axis.grid(alpha=0.3)
        if not any(measured_points(summary, c) for c in found if c.scaling == scaling):
            notes.append(f"{scaling} scaling: no measured cell of these strategies at the projection's "
                         + ("global batch" if scaling == "strong" else "batch per device") + ".")
    handles = [Line2D([], [], color=colors[cell], linewidth=2, label=cell) for cell in cells]
    handles.append(Line2D([], [], color="gray", linewidth=1.5, marker="o", markersize=2.5, label="projected (line)"))
    if banded:
        handles.append(Patch(facecolor="gray", alpha=0.3, label="projected interval (band)"))
    if measured_any:
        handles.append(Line2D([], [], color="gray", marker="D", markeredgecolor="black", linestyle="none",
                              label="measured"))
    legend_outside(fig, handles, [h.get_label() for h in handles])
    if unbanded:
        why = NO_INTERVAL_CLUSTER if found[0].target_kind == "cluster" else "no interval recorded"
        notes.insert(0, f"Lines without a band: {why}.")
    if measured_any and found[0].target_kind == "cluster":
        notes.append(f"Measured points are from the machine the rows ran on, not {found[0].target}.")
    return svg(fig), notes


def projection_figures(projections: Sequence[Mapping[str, Any]], summary: pd.DataFrame) -> list[tuple[str, list[str]]]:
    """Every projection figure of these rows, one per workload, precision and target."""
    found = curves(projections)
    figures: dict[tuple, list[Curve]] = {}
    for curve in found:
        figures.setdefault((curve.workload, curve.precision, curve.target), []).append(curve)
    return [plot_projection(group, summary) for group in figures.values()]
