"""Reports of results files: Markdown summary, self-contained HTML with plots, CSV and Parquet.

    python -m harness report results/full-*.jsonl --out report/

The HTML embeds every plot as inline SVG (matplotlib, rendered here) and fetches nothing, so it opens
offline and can be archived with the rows. Every string that came from a row or a user (labels, options,
messages, environment values) is HTML-escaped. Figures are computed from the rows by the formulas in
the README: scaling efficiency by harness.scaling, medians across repeats with a bootstrap interval by
harness.stats. Rows from a shared GPU never appear in speed or scaling plots.
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

from harness.commbench import with_bandwidth  # noqa: E402
from harness.derive.parity import judge  # noqa: E402
from harness.record import COMMBENCH_KIND, read_rows  # noqa: E402
from harness.scaling import scaling_efficiency  # noqa: E402
from harness.spec import RunResult  # noqa: E402
from harness.stats import bootstrap_median_ci  # noqa: E402
from harness.table import load_table  # noqa: E402

CELL_COLUMNS = ["workload", "strategy", "options", "world_size", "global_batch", "micro_batch", "precision",
                "device", "shared_device"]


UNSTALLED = "unstalled steps"
ALL_STEPS = "all steps"


def throughput_basis(table: pd.DataFrame) -> str:
    """Which steps the report's throughput, plots and efficiencies rest on. Where the host stalled any
    step of these rows (harness.timing) and every ok row has an unstalled median, the unstalled steps:
    a stalled step measures the host, and stalls hit cells at random, so a ratio of two cells' raw
    throughputs would mostly compare their stalls. Otherwise all steps."""
    ok = table[table["status"] == "ok"] if "status" in table else table.iloc[0:0]
    if ok.empty or "host_stalled_steps" not in ok or "step_time_unstalled_median_s" not in ok:
        return ALL_STEPS
    if ok["host_stalled_steps"].fillna(0).sum() == 0 or ok["step_time_unstalled_median_s"].isna().any():
        return ALL_STEPS
    return UNSTALLED


def cell_summary(table: pd.DataFrame) -> pd.DataFrame:
    """One line per cell: status, medians across repeats with a 95% bootstrap interval of throughput
    (samples/s over the steps `throughput_basis` picks; `samples_per_s_all_steps` is the raw one)."""
    basis = throughput_basis(table)
    lines = []
    for _, launches in table.groupby("cell_id", sort=False):
        first = launches.iloc[0]
        ok = launches[launches["status"] == "ok"]
        line = {c: first[c] for c in CELL_COLUMNS if c in launches}
        line.update({"launches": len(launches), "ok": len(ok),
                     "status": "ok" if len(ok) == len(launches) else first["status"] if ok.empty else "partial",
                     "message": "" if not ok.empty else first["message"]})
        if not ok.empty:
            raw = ok["samples_per_s"].astype(float)
            throughput = (raw if basis == ALL_STEPS else
                          ok["global_batch"] / ok["step_time_unstalled_median_s"].astype(float)).tolist()
            low, high = bootstrap_median_ci(throughput)
            line.update({
                "step_time_ms": ok["step_time_median_s"].median() * 1e3,
                "step_time_unstalled_ms": _median(ok, "step_time_unstalled_median_s", 1e3),
                "host_stalled_share": (ok["host_stalled_steps"].sum() / ok["timed_steps"].sum()
                                       if "host_stalled_steps" in ok else None),
                "samples_per_s": pd.Series(throughput).median(), "samples_per_s_ci_low": low,
                "samples_per_s_ci_high": high, "samples_per_s_all_steps": raw.median(), "throughput_basis": basis,
                "tokens_per_s": ok["tokens_per_s"].median() if "tokens_per_s" in ok else None,
                "exposed_comm_share": _median(ok, "exposed_comm_share"),
                "comm_bytes_per_step": _median(ok, "comm_bytes_per_step_total"),
                "peak_rss_mib": _median(ok, "peak_rss_bytes_max") / (1 << 20),
                "allocated_after_step_mib": _median(ok, "allocated_after_step_bytes_max", 1 / (1 << 20)),
                "model_state_predicted_mib": _median(ok, "model_state_bytes_predicted", 1 / (1 << 20)),
                "mfu": _median(ok, "mfu"),
                "parity": first.get("parity_verdict", ""),
                "parity_failed": first.get("parity_failed", ""),
            })
        lines.append(line)
    summary = pd.DataFrame(lines)
    if not summary.empty and "samples_per_s" in summary:
        summary = scaling_efficiency(summary.fillna({"samples_per_s": float("nan")}))
    return summary


def with_parity(table: pd.DataFrame, results: Sequence[RunResult]) -> pd.DataFrame:
    """`table` (one line per result, in order) with each launch's parity verdict and failed quantities
    judged afresh across all `results` (harness.derive.parity), in place of anything a row stored."""
    judged = judge([result.to_dict() for result in results])
    stored = [column for column in table if column.startswith("parity_")]
    return table.drop(columns=stored).assign(parity_verdict=[p.verdict.value for p in judged],
                                             parity_failed=[",".join(p.failed) for p in judged])


def _median(frame: pd.DataFrame, column: str, scale: float = 1.0):
    if column not in frame or frame[column].isna().all():
        return None
    return float(frame[column].astype(float).median()) * scale


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
        errors = [group["samples_per_s"] - group["samples_per_s_ci_low"],
                  group["samples_per_s_ci_high"] - group["samples_per_s"]]
        axis.errorbar(group["world_size"], group["samples_per_s"], yerr=errors, marker="o", capsize=3,
                      label=strategy + (f" [{options}]" if options and strategy != "pipeline" else ""))
    axis.set_xlabel("world size")
    axis.set_ylabel("samples/s (median, 95% CI)")
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
    labels = [f"{r.strategy} ws{r.world_size}" for r in rows.itertuples()]
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    width = 0.8 / len(columns)
    for index, column in enumerate(columns):
        axis.bar([i + index * width for i in range(len(rows))], rows[column].fillna(0), width,
                 label=column.replace("_", " "))
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([i + width * (len(columns) - 1) / 2 for i in range(len(rows))], labels, rotation=45,
                    ha="right", fontsize=7)
    axis.set_ylabel("efficiency (1 = perfect)")
    axis.set_title(f"{workload}: scaling efficiency")
    axis.legend(fontsize=7)
    return _svg(figure)


def plot_memory(summary: pd.DataFrame, workload: str) -> str | None:
    rows = summary[(summary["workload"] == workload) & (summary["status"] == "ok")] if "status" in summary else summary
    if rows.empty or "model_state_predicted_mib" not in rows:
        return None
    measured_column = ("allocated_after_step_mib" if rows["allocated_after_step_mib"].notna().any()
                       else "peak_rss_mib")
    measured_label = ("measured: allocated after a step (model states)" if measured_column.startswith("alloc")
                      else "measured: peak RSS (includes the runtime)")
    labels = [f"{r.strategy} ws{r.world_size}" for r in rows.itertuples()]
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    positions = range(len(rows))
    axis.bar([p - 0.2 for p in positions], rows[measured_column].fillna(0), 0.4, label=measured_label)
    axis.bar([p + 0.2 for p in positions], rows["model_state_predicted_mib"].fillna(0), 0.4,
             label="predicted model states (ZeRO paper)")
    axis.set_xticks(list(positions), labels, rotation=45, ha="right", fontsize=7)
    axis.set_ylabel("MiB per rank (max over ranks)")
    axis.set_yscale("log")
    axis.set_title(f"{workload}: memory per rank")
    axis.legend(fontsize=7)
    return _svg(figure)


def plot_communication(table: pd.DataFrame, workload: str) -> str | None:
    ok = table[(table["workload"] == workload) & (table["status"] == "ok") & (table["world_size"] > 1)]
    kinds = sorted(c for c in ok.columns if c.startswith("comm_") and c.endswith("_bytes_per_step")
                   and ok[c].notna().any())
    if ok.empty or not kinds:
        return None
    per_cell = ok.groupby(["strategy", "world_size"], sort=False)[kinds].median().fillna(0)
    figure, (volume_axis, exposed_axis) = plt.subplots(1, 2, figsize=(10, 3.6))
    bottom = [0.0] * len(per_cell)
    labels = [f"{s} ws{w}" for s, w in per_cell.index]
    for kind in kinds:
        values = (per_cell[kind] / (1 << 20)).tolist()
        volume_axis.bar(labels, values, bottom=bottom, label=kind.removeprefix("comm_").removesuffix("_bytes_per_step"))
        bottom = [b + v for b, v in zip(bottom, values)]
    volume_axis.set_ylabel("MiB per step per rank (intercepted)")
    volume_axis.set_title(f"{workload}: communication volume")
    volume_axis.tick_params(axis="x", rotation=45, labelsize=7)
    volume_axis.legend(fontsize=7)
    exposed = ok.groupby(["strategy", "world_size"], sort=False)["exposed_comm_share"].median() \
        if "exposed_comm_share" in ok else pd.Series(dtype=float)
    exposed = exposed.dropna()
    if not exposed.empty:
        exposed_axis.bar([f"{s} ws{w}" for s, w in exposed.index], exposed * 100)
        exposed_axis.axhline(0, color="black", linewidth=0.8)
    exposed_axis.set_ylabel("exposed communication, % of step")
    exposed_axis.set_title(f"{workload}: exposed communication")
    exposed_axis.tick_params(axis="x", rotation=45, labelsize=7)
    return _svg(figure)


def plot_busbw(commbench: Sequence[dict]) -> str | None:
    if not commbench:
        return None
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    for run in commbench:
        rows = pd.DataFrame(with_bandwidth(run["rows"], run["world_size"]))
        for collective, group in rows.groupby("collective"):
            axis.plot(group["size_bytes"], group["busbw_bytes_per_s"] / 1e9, marker=".",
                      label=f"{collective} ({run['backend']}, {run['world_size']} ranks)")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("size (bytes)")
    axis.set_ylabel("busbw (GB/s)")
    axis.set_title("collectives: bus bandwidth (nccl-tests definitions)")
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)
    return _svg(figure)


def plot_losses(results: Sequence[RunResult], workload: str) -> str | None:
    chosen = [r for r in results if r.spec.workload == workload and r.status.value == "ok" and r.repeat == 0]
    if not chosen:
        return None
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    for result in chosen:
        losses = result.measurements["loss_per_step"]
        style = {"linewidth": 2.5, "color": "black"} if result.spec.strategy == "plain" else {"linewidth": 1}
        axis.plot(range(len(losses)), losses, label=f"{result.spec.strategy} ws{result.spec.world_size}", **style)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss of the global batch")
    axis.set_title(f"{workload}: loss per step (plain loop in black)")
    axis.legend(fontsize=6, ncol=3)
    return _svg(figure)


# ---- documents --------------------------------------------------------------------------------------------

SUMMARY_COLUMNS = [("workload", "workload"), ("strategy", "strategy"), ("options", "options"),
                   ("world_size", "ws"), ("status", "status"), ("step_time_ms", "step ms"),
                   ("host_stalled_share", "host-stalled steps"), ("step_time_unstalled_ms", "unstalled step ms"),
                   ("samples_per_s_all_steps", "samples/s, all steps"),
                   ("samples_per_s", "samples/s"), ("samples_per_s_ci_low", "CI low"),
                   ("samples_per_s_ci_high", "CI high"), ("strong_efficiency_vs_ws1", "strong eff. vs ws1"),
                   ("strong_efficiency_vs_plain", "strong eff. vs plain"), ("exposed_comm_share", "exposed comm"),
                   ("peak_rss_mib", "peak RSS MiB"), ("allocated_after_step_mib", "allocated MiB"),
                   ("model_state_predicted_mib", "predicted MiB"), ("mfu", "MFU"), ("parity", "parity"),
                   ("message", "why")]


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
    lines += ["", "Step time and throughput: medians across repeats (95% bootstrap CI); efficiencies by the "
              "formulas in the README; rows on a shared GPU carry no speed figures.", "", _basis_note(summary),
              "", "## Environment", ""]
    for environment in environments:
        lines.append("- " + ", ".join(f"{k}: {escape(str(v))}" for k, v in environment.items()))
    return "\n".join(lines) + "\n"


def html_report(summary: pd.DataFrame, table: pd.DataFrame, results: Sequence[RunResult],
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
    parts.append("</table><p>Medians across repeats with 95% bootstrap intervals. Efficiencies: "
                 "E(N) = X(N) / (N X_ref(1)) (README, 'Derived figures'). Shared-GPU rows carry no speed.</p>")
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
    parts += [f"<div>{svg}</div>" for svg in (plot_losses(results, w) for w in workloads) if svg]
    parts.append("</div><h2>Environment</h2><ul>")
    parts += ["<li>" + e(", ".join(f"{k}: {v}" for k, v in env.items())) + "</li>" for env in environments]
    parts.append("</ul></body></html>")
    return "\n".join(parts)


def _basis_note(summary: pd.DataFrame) -> str:
    if "throughput_basis" not in summary or not (summary["throughput_basis"] == UNSTALLED).any():
        return "Throughput (samples/s), its plot and the efficiencies use every timed step."
    return ("The host stalled some timed steps (column 'host-stalled steps'; README, 'Host stalls'), so "
            "samples/s, its interval, the throughput plot and the efficiencies use the unstalled steps; "
            "'samples/s, all steps' is the raw figure the rows carry.")


def _environments(results: Sequence[RunResult]) -> list[dict]:
    keys = ("host", "cpu_model", "gpus", "gpu_driver", "python", "torch", "cuda", "nccl", "deepspeed", "horovod",
            "git_sha", "git_dirty", "pip_freeze_sha256")
    distinct = []
    for result in results:
        environment = {k: result.environment.get(k) for k in keys}
        if environment not in distinct:
            distinct.append(environment)
    return distinct


def write_report(sources: Iterable[Path], out: Path) -> list[Path]:
    """Write report.md, report.html, rows.csv and rows.parquet into `out`; returns their paths."""
    sources = list(sources)
    table, results = load_table(sources)
    table = with_parity(table, results) if not table.empty else table
    commbench = read_rows(sources, kind=COMMBENCH_KIND)
    summary = cell_summary(table) if not table.empty else pd.DataFrame()
    environments = _environments(results)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.md", out / "report.html", out / "rows.csv", out / "rows.parquet"]
    written[0].write_text(markdown_report(summary, environments, sources))
    written[1].write_text(html_report(summary, table, results, commbench, environments, sources))
    table.to_csv(written[2], index=False)
    table.to_parquet(written[3], index=False)
    return written
