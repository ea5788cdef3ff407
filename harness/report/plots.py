"""The report's plots of measured cells, rendered here to inline SVG (matplotlib; nothing fetched).

    python -m harness report results/reference/ci-cpu/full.jsonl --out report/

Every legend sits outside its axes (right of the figure's plots), so none covers data. Text stays text in
the SVG (`svg.fonttype: none`): it scales, can be searched, and lets a browser or a test read the plots.
Memory plots compare like with like: on GPU the allocator's model states at gradients_ready against the
ZeRO paper's prediction; on CPU the process's peak RSS against the plain loop's (the runtime is most of
it), with the census of model-state storages against the prediction beside it.
Rows from a shared GPU never appear in speed, scaling or communication plots.
"""

from __future__ import annotations

import io
from typing import Sequence

import matplotlib

matplotlib.use("Agg")   # no display, no browser: plots are rendered to SVG text here
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from harness.commbench import MAX_RANK_ONLY, rank_time_reduction, with_bandwidth  # noqa: E402
from harness.derive.exposed import BOUND_PREFIX  # noqa: E402
from harness.derive.loss_deviation import deviations_in_tolerances  # noqa: E402
from harness.derive.parity import PARITY_STEPS, REFERENCE_STRATEGY, held_key, references  # noqa: E402
from harness.derive.rows import Row, is_ok, measurements, spec  # noqa: E402
from harness.report.verdicts import EXPOSED_DOMINATES, cell_name, shown_name  # noqa: E402
from harness.spec import DeviceKind  # noqa: E402

MIB = float(1 << 20)
WIDE, TALL = 5.0, 3.2           # inches of one panel; a figure of two panels is twice as wide


def figure(panels: int = 1):
    """A figure whose layout keeps room outside the axes for the legend `legend_outside` places there."""
    return plt.subplots(1, panels, figsize=(WIDE * panels, TALL), layout="constrained", squeeze=False)


def legend_outside(fig, handles=None, labels=None, columns: int = 1) -> None:
    """One legend for the whole figure, to the right of its axes: never over data."""
    if handles is None:
        handles, labels = [], []
        for axis in fig.axes:
            for handle, label in zip(*axis.get_legend_handles_labels()):
                if label not in labels:
                    handles.append(handle)
                    labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=7, ncols=columns)


def svg(fig) -> str:
    buffer = io.StringIO()
    # Text as text, and ids that do not change from one run to the next (so two reports diff cleanly).
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "parbench"}):
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]           # inline: drop the XML prologue and doctype


def _title(rows: pd.DataFrame, workload: str, what: str) -> str:
    devices = rows["device"].dropna().unique() if "device" in rows else []
    return f"{workload} ({devices[0]}): {what}" if len(devices) == 1 else f"{workload}: {what}"


def _with_conditions(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` with the columns that keep cells apart on lines and bars of their own: `conditions` (another link
    rate, host type: harness.derive.identity; "" where the table has none) and `precision_tag` (" bf16", where
    the rows hold more than one precision, as the hybrid matrix's do; "" otherwise)."""
    conditions = rows["conditions"].fillna("") if "conditions" in rows else ""
    mixed = "precision" in rows and rows["precision"].nunique() > 1
    tag = (" " + rows["precision"].astype(str)) if mixed else ""
    return rows.assign(conditions=conditions, precision_tag=tag)


def _cell_label(line) -> str:
    return f"{shown_name(line)} ws{line['world_size']}{line.get('precision_tag', '')}"


def _bytes(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return str(size)


def _speed_rows(summary: pd.DataFrame) -> pd.DataFrame:
    if summary.empty or "samples_per_s" not in summary:
        return summary.iloc[0:0]
    return summary[(summary["status"] == "ok") & ~summary["shared_device"].astype(bool)]


def plot_throughput(summary: pd.DataFrame, workload: str) -> str | None:
    rows = _speed_rows(summary)
    rows = rows[rows["workload"] == workload]
    if rows.empty:
        return None
    fig, [[axis]] = figure()
    for (strategy, options, conditions, tag), group in _with_conditions(rows).groupby(
            ["strategy", "options", "conditions", "precision_tag"]):
        group = group.sort_values("world_size")
        low, high = group["samples_per_s_low"], group["samples_per_s_high"]
        errors = [(group["samples_per_s"] - low).fillna(0), (high - group["samples_per_s"]).fillna(0)]
        axis.errorbar(group["world_size"], group["samples_per_s"], yerr=errors, marker="o", capsize=3,
                      label=shown_name({"strategy": strategy, "options": options if strategy != "pipeline" else "",
                                        "conditions": conditions}) + tag)
    axis.set_xlabel("world size")
    axis.set_ylabel("samples/s (median; bars: launches' interval)")
    axis.set_title(_title(rows, workload, "throughput"), fontsize=9)
    axis.set_xticks(sorted(rows["world_size"].unique()))
    axis.grid(alpha=0.3)
    legend_outside(fig)
    return svg(fig)


def plot_efficiency(summary: pd.DataFrame, workload: str) -> str | None:
    rows = _speed_rows(summary)
    rows = rows[(rows["workload"] == workload) & (rows["world_size"] > 1)]
    columns = [c for c in ("strong_efficiency_vs_ws1", "strong_efficiency_vs_plain", "weak_efficiency_vs_ws1",
                           "weak_efficiency_vs_plain") if c in rows and rows[c].notna().any()]
    if rows.empty or not columns:
        return None
    labels = [_cell_label(line) for line in _with_conditions(rows).to_dict("records")]
    fig, [[axis]] = figure()
    width = 0.8 / len(columns)
    for index, column in enumerate(columns):
        # A cell without a reference has no efficiency: no bar, and "n/a" where it would stand (a
        # zero-height bar would read as an efficiency of 0).
        positions = [i + index * width for i in range(len(rows))]
        values = rows[column].astype(float).tolist()
        drawn = [(x, v) for x, v in zip(positions, values) if v == v]
        axis.bar([x for x, _ in drawn], [v for _, v in drawn], width, label=column.replace("_", " "))
        for x, v in zip(positions, values):
            if v != v:
                axis.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=6)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([i + width * (len(columns) - 1) / 2 for i in range(len(rows))], labels, rotation=45,
                    ha="right", fontsize=7)
    axis.set_ylabel("efficiency (1 = perfect)")
    axis.set_title(_title(rows, workload, "scaling efficiency"), fontsize=9)
    legend_outside(fig)
    return svg(fig)


def plot_memory(summary: pd.DataFrame, workload: str) -> str | None:
    rows = summary[(summary["workload"] == workload) & (summary["status"] == "ok")] if "status" in summary \
        else summary.iloc[0:0]
    if rows.empty:
        return None
    if (rows["device"] == DeviceKind.CUDA.value).all():
        return _memory_gpu(rows, workload)
    return _memory_cpu(rows, workload)


def _model_states_panel(axis, rows: pd.DataFrame, measured: str, measured_label: str) -> bool:
    """Measured model states beside the predicted ones, per cell, on a linear axis; False if nothing to draw."""
    if measured not in rows or rows[measured].isna().all() or rows["model_state_bytes_predicted"].isna().all():
        return False
    positions = range(len(rows))
    axis.bar([p - 0.2 for p in positions], rows[measured].astype(float) / MIB, 0.4, label=measured_label)
    axis.bar([p + 0.2 for p in positions], rows["model_state_bytes_predicted"].astype(float) / MIB, 0.4,
             label="model states predicted (ZeRO paper, sec. 5.1)")
    labels = [_cell_label(line) for line in _with_conditions(rows).to_dict("records")]
    axis.set_xticks(list(positions), labels, rotation=45,
                    ha="right", fontsize=7)
    axis.set_ylabel("MiB per rank (largest rank)")
    return True


def _memory_gpu(rows: pd.DataFrame, workload: str) -> str | None:
    fig, [[axis]] = figure()
    drawn = (_model_states_panel(axis, rows, "model_state_bytes_measured_max",
                                 "model states allocated at gradients_ready")
             or _model_states_panel(axis, rows, "model_state_census_bytes_max", "model states, census of storages"))
    if not drawn:
        plt.close(fig)
        return None
    axis.set_title(_title(rows, workload, "model states per rank, measured vs predicted"), fontsize=9)
    legend_outside(fig)
    return svg(fig)


def _memory_cpu(rows: pd.DataFrame, workload: str) -> str | None:
    if "peak_rss_bytes_max" not in rows or rows["peak_rss_bytes_max"].isna().all():
        return None
    fig, [[rss_axis, states_axis]] = figure(2)
    labels = [_cell_label(line) for line in _with_conditions(rows).to_dict("records")]
    rss = rows["peak_rss_bytes_max"].astype(float) / MIB
    rss_axis.bar(range(len(rows)), rss, 0.6, color="tab:gray", label="peak RSS per rank (largest rank)")
    plain = rows[(rows["strategy"] == "plain") & rows["peak_rss_bytes_max"].notna()]
    if not plain.empty:
        baseline = float(plain["peak_rss_bytes_max"].median()) / MIB
        rss_axis.axhline(baseline, color="black", linestyle="--", linewidth=1,
                         label=f"plain loop, same workload: {baseline:.0f} MiB")
        for x, value in enumerate(rss):
            rss_axis.text(x, value, f"{value - baseline:+.0f}", ha="center", va="bottom", fontsize=6)
        rss_axis.set_title(_title(rows, workload, "peak RSS vs the plain loop"), fontsize=9)
    else:
        rss_axis.set_title(_title(rows, workload, "peak RSS (no plain-loop row)"), fontsize=9)
    rss_axis.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=7)
    rss_axis.set_ylabel("MiB per rank (labels: MiB above plain)" if not plain.empty else "MiB per rank")
    rss_axis.set_ylim(0, float(rss.max()) * 1.12)
    if _model_states_panel(states_axis, rows, "model_state_census_bytes_max",
                           "model states, census of storages at gradients_ready"):
        states_axis.set_title("model states alone: measured vs predicted", fontsize=9)
    else:
        states_axis.set_visible(False)
    legend_outside(fig)
    return svg(fig)


# The exposed panel's bars are times, not collectives: greys, none of which the property cycle (the bytes
# panel's collective colours, whose fifth is `send`'s tab:purple) ever gives. Two figures, each its own grey
# (harness.derive.exposed, harness.derive.beyond_ws1).
STEP_BEYOND = {
    "exposed_comm_share": ("#404040", "step beyond the compute-only pass (exposed communication)"),
    "step_beyond_ws1_share": ("#a0a0a0", "step beyond the strategy's own world-size-1 step"),
}
BOUND_HATCH = "//"


def plot_communication(table: pd.DataFrame, workload: str, summary: pd.DataFrame | None = None) -> str | None:
    """Wire bytes per step per rank (harness.derive.comm: nccl-tests size x ring factor, so types add up),
    stacked by collective type, with the strategy's expected wire bytes beside each bar (from the launch
    `table`); beside it the step beyond the compute-only pass and beyond the strategy's own world-size-1 step,
    per cell (from the cell `summary`)."""
    ok = table[(table["workload"] == workload) & (table["status"] == "ok") & (table["world_size"] > 1)
               & ~table["shared_device"].astype(bool)]
    kinds = sorted(c for c in ok.columns if c.startswith("comm_") and c.endswith("_wire_bytes_per_step")
                   and c not in ("comm_wire_bytes_per_step", "comm_expected_wire_bytes_per_step")
                   and not c.startswith(GROUP_PREFIX)
                   and c != "comm_recv_wire_bytes_per_step" and ok[c].notna().any())
    if ok.empty or not kinds:
        return None
    columns = kinds + (["comm_expected_wire_bytes_per_step"] if "comm_expected_wire_bytes_per_step" in ok else [])
    ok, cell = _with_conditions(ok), ["strategy", "options", "conditions", "world_size", "precision_tag"]
    per_cell = ok.groupby(cell, sort=False)[columns].median()
    fig, [[volume_axis, exposed_axis]] = figure(2)
    bottom = [0.0] * len(per_cell)
    labels = [f"{shown_name({'strategy': s, 'options': o, 'conditions': c})} ws{w}{t}"
              for s, o, c, w, t in per_cell.index]
    for kind in kinds:
        values = (per_cell[kind].fillna(0) / MIB).tolist()
        name = kind.removeprefix("comm_").removesuffix("_wire_bytes_per_step")
        for position, bar in enumerate(volume_axis.bar(labels, values, bottom=bottom, label=name)):
            bar.set_gid(f"wire-{name}-{position}")
        bottom = [b + v for b, v in zip(bottom, values)]
    if "comm_expected_wire_bytes_per_step" in per_cell:
        volume_axis.scatter(labels, per_cell["comm_expected_wire_bytes_per_step"] / MIB, marker="_", s=300,
                            color="black", label="expected (strategy's model)", zorder=3)
    volume_axis.set_ylabel("MiB sent per step per rank (wire)")
    volume_axis.set_title(f"{workload}: bytes on the wire", fontsize=9)
    volume_axis.tick_params(axis="x", rotation=45, labelsize=7)
    _step_beyond_panel(exposed_axis, summary, workload)
    legend_outside(fig)
    return svg(fig)


GROUP_PREFIX = "comm_group_"     # harness.derive.comm.comm_columns: wire bytes per named process group


def plot_traffic_by_group(table: pd.DataFrame, workload: str) -> str | None:
    """Wire bytes per step per rank stacked by the process group they ran in (harness.derive.comm
    `group_wire_bytes`): tensor parallelism's `tp` apart from data parallelism's `dp` (and the pipeline's `pp`
    and `tied`, the default group's `world`), for the workload's multi-rank cells; None unless some cell ran in
    a named group other than the default one."""
    ok = table[(table["workload"] == workload) & (table["status"] == "ok") & (table["world_size"] > 1)
               & ~table["shared_device"].astype(bool)]
    groups = sorted(c for c in ok.columns if c.startswith(GROUP_PREFIX) and ok[c].notna().any())
    if ok.empty or set(groups) <= {f"{GROUP_PREFIX}world_wire_bytes_per_step"}:
        return None
    ok, cell = _with_conditions(ok), ["strategy", "options", "conditions", "world_size", "precision_tag"]
    per_cell = ok.groupby(cell, sort=False)[groups].median()
    fig, [[axis]] = figure(1)
    bottom = [0.0] * len(per_cell)
    labels = [f"{shown_name({'strategy': s, 'options': o, 'conditions': c})} ws{w}{t}"
              for s, o, c, w, t in per_cell.index]
    for column in groups:
        values = (per_cell[column].fillna(0) / MIB).tolist()
        name = column.removeprefix(GROUP_PREFIX).removesuffix("_wire_bytes_per_step")
        for position, bar in enumerate(axis.bar(labels, values, bottom=bottom, label=f"group {name}")):
            bar.set_gid(f"group-{name}-{position}")
        bottom = [b + v for b, v in zip(bottom, values)]
    axis.set_ylabel("MiB sent per step per rank (wire)")
    axis.set_title(f"{workload}: bytes on the wire by process group", fontsize=9)
    axis.tick_params(axis="x", rotation=45, labelsize=7)
    legend_outside(fig)
    return svg(fig)


def _step_beyond_panel(axis, summary: pd.DataFrame | None, workload: str) -> None:
    """Per multi-rank cell, a bar for each figure of STEP_BEYOND it has; a bar whose compute-only pass only
    bounds the rank's work is hatched, with a legend entry saying so (and none where no bar is)."""
    cells = summary.iloc[0:0] if summary is None or summary.empty else summary[
        (summary["workload"] == workload) & (summary["status"] == "ok") & (summary["world_size"] > 1)
        & ~summary["shared_device"].astype(bool)]
    present = [key for key in STEP_BEYOND if key in cells and cells[key].notna().any()]
    cells = cells[cells[present].notna().any(axis=1)] if present else cells.iloc[0:0]
    axis.set_title(f"{workload}: time beyond compute", fontsize=9)
    axis.set_ylabel("% of the step (median across launches)")
    if cells.empty:
        axis.text(0.5, 0.5, "no figure: no compute-only pass or world-size-1 cell", ha="center", va="center",
                  fontsize=7, transform=axis.transAxes)
        return
    width = 0.8 / len(present)
    bounded = False
    for index, key in enumerate(present):
        colour, label = STEP_BEYOND[key]
        for position, line in enumerate(cells.to_dict("records")):
            value = line.get(key)
            if value is None or value != value:
                continue
            bound = key == "exposed_comm_share" and str(line.get("compute_only_kind") or "").startswith(BOUND_PREFIX)
            bounded = bounded or bound
            [bar] = axis.bar(position + (index - (len(present) - 1) / 2) * width, float(value) * 100, width,
                             color=colour, edgecolor="black", linewidth=0.4, hatch=BOUND_HATCH if bound else None,
                             label=label)
            bar.set_gid(f"{key}-{position}")
    if bounded:
        axis.bar(0, 0, 0, color="white", edgecolor="black", linewidth=0.4, hatch=BOUND_HATCH,
                 label="hatched: the compute-only pass only bounds the rank's work")
    axis.axhline(0, color="black", linewidth=0.8)
    axis.axhline(EXPOSED_DOMINATES * 100, color="tab:red", linestyle="--", linewidth=1,
                 label=f"verdicts: communication dominates above {EXPOSED_DOMINATES:.0%} (beyond own ws1 step)")
    labels = [_cell_label(line) for line in _with_conditions(cells).to_dict("records")]
    axis.set_xticks(range(len(cells)), labels, rotation=45,
                    ha="right", fontsize=7)


def plot_busbw(commbench: Sequence[dict]) -> str | None:
    if not commbench:
        return None
    fig, [[axis]] = figure()
    for run in commbench:
        # Concurrent groups (`harness comm --group-size`): each collective ran among a group's ranks.
        members = int(run.get("group_size") or run["world_size"])
        rows = pd.DataFrame(with_bandwidth(run["rows"], members))
        # busbw is from the mean over ranks; rows written before that say they hold the slowest rank's.
        old = ", slowest rank only" if rank_time_reduction(run["rows"]) == MAX_RANK_ONLY else ""
        ranks = (f"groups of {members} of {run['world_size']} ranks, stride {run.get('group_stride') or 1}"
                 if members != run["world_size"] else f"{run['world_size']} ranks")
        for collective, group in rows.groupby("collective"):
            axis.plot(group["size_bytes"], group["busbw_bytes_per_s"] / 1e9, marker=".",
                      label=f"{collective} ({run['backend']}, {ranks}{old})")
    axis.set_xscale("log", base=2)
    sizes = sorted({int(size) for run in commbench for size in pd.DataFrame(run["rows"])["size_bytes"]})
    shown = sizes[::max(1, -(-len(sizes) // 5))]      # at most 5 labels: they stay apart
    axis.set_xticks(shown, [_bytes(size) for size in shown])
    axis.minorticks_off()
    axis.set_xlabel("message size")
    axis.set_ylabel("busbw, GB/s (nccl-tests; mean of ranks)")
    axis.set_title("collectives: bus bandwidth", fontsize=9)
    axis.grid(alpha=0.3)
    legend_outside(fig)
    return svg(fig)


# Deviations above this many tolerances sit on the top edge as an up-pointing triangle: a mismatch is a
# mismatch, and one at 10^6 tolerances would flatten every other point onto the axis.
DEVIATION_CAP = 5.0
MARKERS = ("o", "s", "D", "v", "P", "X", "<", ">")


def plot_losses(rows: Sequence[Row], workload: str) -> str | None:
    """Left, the reference's loss per step (the plain loop's); right, each other launch's deviation from it at
    the steps parity compares, in units of the tolerance it is held to (harness.derive.loss_deviation), so
    the judged figure is seen against its bar. First launches (repeat 0) only."""
    chosen = [r for r in rows if spec(r)["workload"] == workload and is_ok(r) and r.get("repeat", 0) == 0
              and measurements(r).get("loss_per_step")]
    if not chosen:
        return None
    found = references(rows)
    held = [(row, found[held_key(row)]) for row in chosen
            if spec(row)["strategy"] != REFERENCE_STRATEGY and held_key(row) in found]
    plain = [row for row in chosen if spec(row)["strategy"] == REFERENCE_STRATEGY]
    fig, [[loss_axis, deviation_axis]] = figure(2)
    batches = {spec(row)["global_batch"] for row in plain}
    for row in plain:
        losses = measurements(row)["loss_per_step"]
        batch = f" gb{spec(row)['global_batch']}" if len(batches) > 1 else ""
        loss_axis.plot(range(len(losses)), losses, color="black", linewidth=1.5,
                       label=f"{REFERENCE_STRATEGY} ws{spec(row)['world_size']}{batch} (the reference)")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss of the global batch")
    loss_axis.set_title(f"{workload}: the reference's loss per step", fontsize=9)
    if not plain:
        loss_axis.text(0.5, 0.5, "no plain-loop row: nothing to hold the others against", ha="center",
                       va="center", fontsize=7, transform=loss_axis.transAxes)
    _deviation_panel(deviation_axis, held, workload)
    legend_outside(fig, columns=2 if len(held) > 12 else 1)
    return svg(fig)


def _deviation_panel(axis, held: Sequence[tuple[Row, Row]], workload: str) -> None:
    steps = range(PARITY_STEPS)
    axis.set_title(f"{workload}: deviation from the reference, in tolerances", fontsize=9)
    axis.set_xlabel("optimizer step (those parity compares)")
    axis.set_ylabel("|loss - reference| / tolerance")
    axis.set_xticks(list(steps))
    series = [(row, deviations_in_tolerances(row, reference)) for row, reference in held]
    largest = max((v for _, values in series for v in values if v == v), default=0.0)
    top = DEVIATION_CAP if largest > DEVIATION_CAP else max(1.5, largest * 1.15)
    # Side by side within each step, so that launches at the same deviation (often exactly 0) stay apart.
    spread = 0.7
    offsets = [spread * (i / (len(series) - 1) - 0.5) if len(series) > 1 else 0.0 for i in range(len(series))]
    batches = {spec(row)["global_batch"] for row, _ in held}
    for index, ((row, values), offset) in enumerate(zip(series, offsets)):
        xs = [step + offset for step in range(len(values))]
        shown = [min(v, top) for v in values]
        batch = f" gb{spec(row)['global_batch']}" if len(batches) > 1 else ""
        name = f"{cell_name({'strategy': spec(row)['strategy'], 'options': _options(row)})} ws{spec(row)['world_size']}{batch}"
        [line] = axis.plot(xs, shown, marker=MARKERS[index % len(MARKERS)], markersize=4, linestyle="none",
                           label=name)
        line.set_gid(f"loss-deviation-{name.replace(' ', '-')}")
        beyond = [(x, top) for x, v in zip(xs, values) if v > top]
        if beyond:
            axis.scatter(*zip(*beyond), marker="^", s=40, color=line.get_color(), zorder=3)
    axis.axhline(1.0, color="tab:red", linestyle="--", linewidth=1,
                 label="parity tolerance (above: a mismatch)")
    if largest > DEVIATION_CAP:
        axis.scatter([], [], marker="^", color="gray", label=f"beyond {DEVIATION_CAP:g} tolerances (off the axis)")
    axis.set_ylim(0, top * 1.04)
    axis.set_xlim(-0.6, PARITY_STEPS - 0.4)
    axis.grid(alpha=0.3, axis="y")
    if not series:
        axis.text(0.5, 0.5, "no launch to hold against a plain-loop reference", ha="center", va="center",
                  fontsize=7, transform=axis.transAxes)


def _options(row: Row) -> str:
    options = spec(row).get("options") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(options.items())) if spec(row)["strategy"] != "pipeline" else ""
