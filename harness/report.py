"""Reports of results files: Markdown summary, self-contained HTML with plots, CSV and Parquet.

    python -m harness report results/full-*.jsonl --out report/

The HTML embeds every plot as inline SVG (matplotlib, rendered here) and fetches nothing, so it opens
offline and can be archived with the rows. Every string that came from a row or a user (labels, options,
messages, environment values) is HTML-escaped. Figures are computed from the rows by the formulas in
the README, all of them derived from the raw rows by `harness.derive` (the same tables the console summary
prints). Rows from a shared GPU never appear in speed or scaling plots.
"""

from __future__ import annotations

import html
import io
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Sequence

import matplotlib

matplotlib.use("Agg")   # no display, no browser: plots are rendered to SVG text here
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from harness.commbench import MAX_RANK_ONLY, rank_time_reduction, with_bandwidth  # noqa: E402
from harness.derive.cells import cell_table, launch_table  # noqa: E402
from harness.derive.rows import Row, is_ok, load_rows, measurements, spec  # noqa: E402
from harness.derive.throughput import Basis  # noqa: E402
from harness.record import COMMBENCH_KIND, read_rows  # noqa: E402


# ---- plots ----------------------------------------------------------------------------------------------


def _svg(figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]           # inline: drop the XML prologue and doctype


def _speed_rows(summary: pd.DataFrame) -> pd.DataFrame:
    if summary.empty or "samples_per_s" not in summary:
        return summary.iloc[0:0]
    return summary[(summary["status"] == "ok") & ~summary["shared_device"].astype(bool)]


def plot_throughput(summary: pd.DataFrame, workload: str) -> str | None:
    rows = _speed_rows(summary)
    rows = rows[rows["workload"] == workload]
    if rows.empty:
        return None
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    for (strategy, options), group in rows.groupby(["strategy", "options"]):
        group = group.sort_values("world_size")
        low, high = group["samples_per_s_low"], group["samples_per_s_high"]
        errors = [(group["samples_per_s"] - low).fillna(0), (high - group["samples_per_s"]).fillna(0)]
        axis.errorbar(group["world_size"], group["samples_per_s"], yerr=errors, marker="o", capsize=3,
                      label=strategy + (f" [{options}]" if options and strategy != "pipeline" else ""))
    axis.set_xlabel("world size")
    axis.set_ylabel("samples/s (median; bars: interval across launches)")
    axis.set_title(f"{workload}: throughput")
    axis.set_xticks(sorted(rows["world_size"].unique()))
    axis.legend(fontsize=7, ncol=2)
    axis.grid(alpha=0.3)
    return _svg(figure)


def plot_efficiency(summary: pd.DataFrame, workload: str) -> str | None:
    rows = _speed_rows(summary)
    rows = rows[(rows["workload"] == workload) & (rows["world_size"] > 1)]
    columns = [c for c in ("strong_efficiency_vs_ws1", "strong_efficiency_vs_plain", "weak_efficiency_vs_ws1",
                           "weak_efficiency_vs_plain") if c in rows and rows[c].notna().any()]
    if rows.empty or not columns:
        return None
    labels = [f"{r.strategy}{' [' + r.options + ']' if r.options else ''} ws{r.world_size}"
              for r in rows.itertuples()]
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
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
    axis.set_title(f"{workload}: scaling efficiency")
    axis.legend(fontsize=7)
    return _svg(figure)


def plot_memory(summary: pd.DataFrame, workload: str) -> str | None:
    rows = summary[(summary["workload"] == workload) & (summary["status"] == "ok")] if "status" in summary else summary
    if rows.empty or "model_state_bytes_predicted" not in rows or rows["model_state_bytes_predicted"].isna().all():
        return None
    # Model states read at gradients_ready of the last warm-up step (README, "Memory"): the allocator's
    # figure on GPU, else the census of their storages; peak RSS (mostly the runtime) only as a last resort.
    candidates = [("model_state_bytes_measured_max", "measured: allocated at gradients_ready (model states)"),
                  ("model_state_census_bytes_max", "measured: census of model-state storages"),
                  ("peak_rss_bytes_max", "measured: peak RSS (includes the runtime)")]
    measured_column, measured_label = next(((column, label) for column, label in candidates
                                            if column in rows and rows[column].notna().any()), candidates[-1])
    labels = [f"{r.strategy} ws{r.world_size}" for r in rows.itertuples()]
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    positions = range(len(rows))
    mib = float(1 << 20)
    axis.bar([p - 0.2 for p in positions], rows[measured_column].astype(float) / mib, 0.4, label=measured_label)
    axis.bar([p + 0.2 for p in positions], rows["model_state_bytes_predicted"].astype(float) / mib, 0.4,
             label="predicted model states (ZeRO paper)")
    axis.set_xticks(list(positions), labels, rotation=45, ha="right", fontsize=7)
    axis.set_ylabel("MiB per rank (max over ranks)")
    axis.set_yscale("log")
    axis.set_title(f"{workload}: memory per rank")
    axis.legend(fontsize=7)
    return _svg(figure)


def plot_communication(table: pd.DataFrame, workload: str) -> str | None:
    """Wire bytes per step per rank (harness.derive.comm: nccl-tests size x ring factor, so types add up),
    stacked by collective type, with the strategy's expected wire bytes beside each bar; exposed share."""
    ok = table[(table["workload"] == workload) & (table["status"] == "ok") & (table["world_size"] > 1)]
    kinds = sorted(c for c in ok.columns if c.startswith("comm_") and c.endswith("_wire_bytes_per_step")
                   and c not in ("comm_wire_bytes_per_step", "comm_expected_wire_bytes_per_step")
                   and c != "comm_recv_wire_bytes_per_step" and ok[c].notna().any())
    if ok.empty or not kinds:
        return None
    columns = kinds + (["comm_expected_wire_bytes_per_step"] if "comm_expected_wire_bytes_per_step" in ok else [])
    per_cell = ok.groupby(["strategy", "world_size"], sort=False)[columns].median()
    figure, (volume_axis, exposed_axis) = plt.subplots(1, 2, figsize=(10, 3.6))
    bottom = [0.0] * len(per_cell)
    labels = [f"{s} ws{w}" for s, w in per_cell.index]
    for kind in kinds:
        values = (per_cell[kind].fillna(0) / (1 << 20)).tolist()
        volume_axis.bar(labels, values, bottom=bottom,
                        label=kind.removeprefix("comm_").removesuffix("_wire_bytes_per_step"))
        bottom = [b + v for b, v in zip(bottom, values)]
    if "comm_expected_wire_bytes_per_step" in per_cell:
        volume_axis.scatter(labels, per_cell["comm_expected_wire_bytes_per_step"] / (1 << 20), marker="_", s=300,
                            color="black", label="expected (strategy's model)", zorder=3)
    volume_axis.set_ylabel("MiB sent per step per rank (wire)")
    volume_axis.set_title(f"{workload}: communication on the wire")
    volume_axis.tick_params(axis="x", rotation=45, labelsize=7)
    volume_axis.legend(fontsize=7)
    exposed = ok.groupby(["strategy", "world_size"], sort=False)["exposed_comm_share"].median() \
        if "exposed_comm_share" in ok else pd.Series(dtype=float)
    exposed = exposed.dropna()
    if not exposed.empty:
        kinds = ok.groupby(["strategy", "world_size"], sort=False)["compute_only_kind"].first() \
            if "compute_only_kind" in ok else pd.Series(dtype=object)
        # A baseline that is not the rank's same work bounds the figure: hatch it so it is not read as one.
        hatches = ["//" if str(kinds.get(cell, "")).startswith("bound") else "" for cell in exposed.index]
        exposed_axis.bar([f"{s} ws{w}" for s, w in exposed.index], exposed * 100, hatch=hatches,
                         edgecolor="black", linewidth=0.4)
        exposed_axis.axhline(0, color="black", linewidth=0.8)
    exposed_axis.set_ylabel("exposed communication, % of step")
    exposed_axis.set_title(f"{workload}: exposed communication (hatched: a bound)")
    exposed_axis.tick_params(axis="x", rotation=45, labelsize=7)
    return _svg(figure)


def plot_busbw(commbench: Sequence[dict]) -> str | None:
    if not commbench:
        return None
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    for run in commbench:
        rows = pd.DataFrame(with_bandwidth(run["rows"], run["world_size"]))
        # busbw is from the mean over ranks; rows written before that say they hold the slowest rank's.
        old = ", slowest rank only" if rank_time_reduction(run["rows"]) == MAX_RANK_ONLY else ""
        for collective, group in rows.groupby("collective"):
            axis.plot(group["size_bytes"], group["busbw_bytes_per_s"] / 1e9, marker=".",
                      label=f"{collective} ({run['backend']}, {run['world_size']} ranks{old})")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("size (bytes)")
    axis.set_ylabel("busbw (GB/s)")
    axis.set_title("collectives: bus bandwidth (nccl-tests definitions, mean over ranks)")
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)
    return _svg(figure)


def plot_losses(rows: Sequence[Row], workload: str) -> str | None:
    chosen = [r for r in rows if spec(r)["workload"] == workload and is_ok(r) and r.get("repeat", 0) == 0]
    if not chosen:
        return None
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    for row in chosen:
        losses = measurements(row)["loss_per_step"]
        strategy = spec(row)["strategy"]
        style = {"linewidth": 2.5, "color": "black"} if strategy == "plain" else {"linewidth": 1}
        axis.plot(range(len(losses)), losses, label=f"{strategy} ws{spec(row)['world_size']}", **style)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss of the global batch")
    axis.set_title(f"{workload}: loss per step (plain loop in black)")
    axis.legend(fontsize=6, ncol=3)
    return _svg(figure)


# ---- documents --------------------------------------------------------------------------------------------

SUMMARY_COLUMNS = [("workload", "workload"), ("strategy", "strategy"), ("options", "options"),
                   ("world_size", "ws"), ("status", "status"), ("step_time_median_s", "step s"),
                   ("host_stalled_steps", "host-stalled steps"), ("step_time_unstalled_median_s", "unstalled step s"),
                   ("samples_per_s_all_steps", "samples/s, all steps"),
                   ("samples_per_s", "samples/s"), ("samples_per_s_interval", "interval"), ("strong_efficiency_vs_ws1", "strong eff. vs ws1"),
                   ("strong_efficiency_vs_plain", "strong eff. vs plain"), ("exposed_comm_share", "exposed comm"),
                   ("compute_only_kind", "exposed baseline"), ("comm_wire_bytes_per_step", "wire B/step"),
                   ("comm_expected_wire_bytes_per_step", "expected wire B/step"),
                   ("peak_rss_bytes_max", "peak RSS B"), ("peak_allocated_bytes_max", "peak allocated B"),
                   ("model_state_bytes_measured_max", "model states (allocator) B"),
                   ("model_state_census_bytes_max", "model states (census) B"),
                   ("model_state_bytes_predicted", "predicted model states B"), ("mfu", "MFU"), ("parity", "parity"),
                   ("host_load", "host load"),
                   ("message", "why")]


HOST_LOAD_NOTE = ("'host load' is the most loaded host's rank threads against its cores, 'oversubscribed' where "
                  "they outnumber them: those step times measure the cores' sharing (README, 'On CPU').")


def _format(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _table_cells(summary: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    columns = [(key, title) for key, title in SUMMARY_COLUMNS if key in summary]
    rows = [[_format(line.get(key)) for key, _ in columns] for line in summary.to_dict("records")]
    return [title for _, title in columns], rows


def markdown_report(summary: pd.DataFrame, environments: list[dict], sources: Sequence[Path]) -> str:
    titles, rows = _table_cells(summary)
    escape = lambda text: text.replace("|", "\\|")  # noqa: E731
    lines = [f"# parbench report", "", f"From {', '.join(str(s) for s in sources)}; "
             f"generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.", "",
             "| " + " | ".join(titles) + " |", "|" + " --- |" * len(titles)]
    lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in rows]
    lines += ["", "Step time and throughput: medians across repeats; the samples/s interval is the range of the "
              "launches below 5 launches, a 95% bootstrap CI from 5 (column 'interval'); efficiencies by the "
              "formulas in the README; rows on a shared GPU carry no speed figures. " + HOST_LOAD_NOTE, "",
              _basis_note(summary),
              "", "## Environment", ""]
    for environment in environments:
        lines.append("- " + ", ".join(f"{k}: {escape(str(v))}" for k, v in environment.items()))
    return "\n".join(lines) + "\n"


def html_report(summary: pd.DataFrame, table: pd.DataFrame, raw_rows: Sequence[Row],
                commbench: Sequence[dict], environments: list[dict], sources: Sequence[Path]) -> str:
    e = html.escape
    titles, rows = _table_cells(summary)
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>parbench report</title><style>",
             "body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
             "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}h2{margin-top:2em}.plots{display:flex;flex-wrap:wrap;"
             "gap:1em}.plots>div{flex:0 0 auto}svg{max-width:100%;height:auto}</style></head><body>",
             "<h1>parbench report</h1>",
             f"<p>From {e(', '.join(str(s) for s in sources))}; generated "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.</p>",
             "<h2>Cells</h2><table><tr>" + "".join(f"<th>{e(t)}</th>" for t in titles) + "</tr>"]
    parts += ["<tr>" + "".join(f"<td>{e(cell)}</td>" for cell in row) + "</tr>" for row in rows]
    parts.append("</table><p>Medians across repeats; samples/s intervals are the range of the launches below 5 "
                 "launches and 95% bootstrap intervals from 5 (column 'interval'). Efficiencies: "
                 "E(N) = X(N) / (N X_ref(1)) (README, 'Derived figures'). Shared-GPU rows carry no speed. "
                 f"{e(HOST_LOAD_NOTE)}</p>")
    parts.append(f"<p>{e(_basis_note(summary))}</p>")
    workloads = list(dict.fromkeys(table["workload"])) if not table.empty else []
    sections = [("Throughput", plot_throughput, summary), ("Scaling efficiency", plot_efficiency, summary),
                ("Memory: measured vs predicted", plot_memory, summary),
                ("Communication", plot_communication, table)]
    for title, plot, data in sections:
        svgs = [plot(data, w) for w in workloads]
        parts.append(f"<h2>{e(title)}</h2><div class='plots'>")
        parts += [f"<div>{svg}</div>" for svg in svgs if svg]
        if not any(svgs):
            parts.append("<p>No rows with these figures.</p>")
        parts.append("</div>")
    busbw = plot_busbw(commbench)
    parts.append("<h2>Collective bus bandwidth</h2>" + (f"<div>{busbw}</div>" if busbw else
                 "<p>No <code>python -m harness comm</code> rows in these files.</p>"))
    parts.append("<h2>Loss parity</h2><div class='plots'>")
    parts += [f"<div>{svg}</div>" for svg in (plot_losses(raw_rows, w) for w in workloads) if svg]
    parts.append("</div><h2>Environment</h2><ul>")
    parts += ["<li>" + e(", ".join(f"{k}: {v}" for k, v in env.items())) + "</li>" for env in environments]
    parts.append("</ul></body></html>")
    return "\n".join(parts)


def _basis_note(summary: pd.DataFrame) -> str:
    if "throughput_basis" not in summary or not (summary["throughput_basis"] == Basis.UNSTALLED.value).any():
        return "Throughput (samples/s), its plot and the efficiencies use every timed step."
    return ("The host stalled some timed steps (column 'host-stalled steps'; README, 'Host stalls'), so "
            "samples/s, its interval, the throughput plot and the efficiencies use the unstalled steps; "
            "'samples/s, all steps' is the raw figure the rows carry.")


def _environments(rows: Sequence[Row]) -> list[dict]:
    keys = ("host", "cpu_model", "gpus", "gpu_driver", "python", "torch", "cuda", "nccl", "deepspeed", "horovod",
            "git_sha", "git_dirty", "pip_freeze_sha256")
    distinct = []
    for row in rows:
        environment = {k: (row.get("environment") or {}).get(k) for k in keys}
        if environment not in distinct:
            distinct.append(environment)
    return distinct


def write_report(sources: Iterable[Path], out: Path) -> list[Path]:
    """Write report.md, report.html, rows.csv and rows.parquet into `out`; returns their paths."""
    sources = list(sources)
    rows = load_rows(sources)
    commbench = read_rows(sources, kind=COMMBENCH_KIND)
    table = launch_table(rows)
    summary = cell_table(rows)
    environments = _environments(rows)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.md", out / "report.html", out / "rows.csv", out / "rows.parquet"]
    written[0].write_text(markdown_report(summary, environments, sources))
    written[1].write_text(html_report(summary, table, rows, commbench, environments, sources))
    table.to_csv(written[2], index=False)
    table.to_parquet(written[3], index=False)
    return written
