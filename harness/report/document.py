"""The report's documents: report.html and report.md, written beside rows.csv and rows.parquet.

    python -m harness report results/reference/ci-cpu/full.jsonl --out report/

Both open with the verdicts (harness.report.verdicts; first, where the rows read it, the launches whose ranks held
memory outside their model states: harness.derive.memory_flags), the HTML then shows the plots (harness.report.plots,
and harness.report.projected where the files hold projected rows), then the compact table of cells
(harness.report.table), then the environments the rows ran in. The HTML embeds every plot as inline SVG
and fetches nothing, so it opens offline and can be archived with the rows. Every string that came from a
row or a user (labels, options, messages, environment values) is HTML-escaped.
"""

from __future__ import annotations

import html
import re
import shlex
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from harness.derive.cells import cell_table, launch_table
from harness.derive.launches import last_row_indices
from harness.derive.memory_flags import FLAG_COLUMNS, SECTION as MEMORY_HEADING, flag_columns, verdict_lines
from harness.derive.rows import Row, load_rows, measurements
from harness.derive.throughput import Basis
from harness.record import COMMBENCH_KIND, read_rows
from harness.report.plots import (plot_busbw, plot_communication, plot_efficiency, plot_losses, plot_memory,
                                  plot_throughput, plot_traffic_by_group)
from harness.report.projected import projection_figures, read_projections
from harness.report.table import BEYOND_WS1_TITLE, EXPOSED_TITLE, OVERHEAD_TITLE, Table, tables
from harness.report.verdicts import EXPOSED_DOMINATES, RSS_CONTAINS, Verdicts, verdicts
from harness.spec import DeviceKind

HOST_LOAD_NOTE = ("'host load' is the most loaded host's rank threads against its cores, 'oversubscribed' where "
                  "they outnumber them: those step times measure the cores' sharing (docs/methodology.md, 'On CPU').")

LOSS_CAPTION = ("Left: the plain loop's loss per step, the reference. Right: each other cell's deviation from it at "
                "the steps parity compares, in units of the tolerance it is held to: step 0 relative to the loss, "
                "later steps relative to the reference's largest step move (docs/methodology.md, 'Loss parity'). "
                "At or below 1 it matches on its losses; first launches only.")

STEP_BEYOND_NOTE = (f"'{EXPOSED_TITLE}': at 2 ranks or more, the step beyond the compute-only pass (the model's "
                    "forward, backward and optimizer step alone): communication and the strategy's own work. "
                    f"'{BEYOND_WS1_TITLE}': the step beyond the strategy's own world-size-1 step, in proportion to "
                    "the samples a rank runs: what running on several ranks adds, the strategy's own work left out. "
                    f"'{OVERHEAD_TITLE}': at 1 rank, where nothing is communicated, the step beyond the compute-only "
                    "pass: the framework's own work (docs/methodology.md, 'Exposed communication').")

STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1300px;color:#222}"
         "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
         "td{white-space:nowrap}.wide{overflow-x:auto}"
         "td:first-child,th:first-child,td:nth-child(2),th:nth-child(2){text-align:left}h2{margin-top:1.6em}"
         "#verdicts h3{font-size:1em;margin:0.8em 0 0.2em}#verdicts ul{margin:0.2em 0}"
         ".plots{display:flex;flex-wrap:wrap;gap:1em}.plots>figure{flex:0 0 auto;margin:0}"
         "figcaption{font-size:12px;max-width:60em}svg{max-width:100%;height:auto}.note{font-size:12px}")


TECHNIQUES_HEADING = "Memory saved, step time paid"
PARAMETER_SERVER_HEADING = "Parameter server against all-reduce"
CHECKPOINT_HEADING = "Checkpoint and resume"
EXPERTS_HEADING = "Experts: all-to-all and load"
SEQUENCE_HEADING = "Long sequences: attention's exchanges and memory a rank"


def _verdict_sections(found: Verdicts, memory: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """(heading, lines) in the order they are shown: memory outside the model states where the rows read it
    (`memory`: harness.derive.memory_flags.verdict_lines, first, so that a flagged launch is not missed), what each
    memory technique saved and cost where cells ran with one, the parameter servers beside all-reduce where they ran,
    checkpoints, the MoE cells' all-to-all and load, each group of comparable cells, then parity, then the cells that
    did not run."""
    first = [(MEMORY_HEADING, list(memory))] if memory else []
    first += [(TECHNIQUES_HEADING, found.techniques)] if found.techniques else []
    first += [(PARAMETER_SERVER_HEADING, found.parameter_server)] if found.parameter_server else []
    first += [(CHECKPOINT_HEADING, found.checkpoint)] if found.checkpoint else []
    first += [(EXPERTS_HEADING, found.experts)] if found.experts else []
    first += [(SEQUENCE_HEADING, found.sequence)] if found.sequence else []
    return (first + [(group.heading, group.lines) for group in found.groups]
            + [("Loss parity", found.parity), ("Failed or skipped cells", found.not_run)])


def verdicts_html(found: Verdicts, memory: Sequence[str] = ()) -> str:
    e = html.escape
    parts = ["<section id='verdicts'><h2>Verdicts</h2>",
             f"<p class='note'>Per device, workload, precision, global batch and world size. Margins are between "
             f"medians across launches; a tie is called where the launches' intervals overlap. Exposed "
             f"communication dominates where more than {EXPOSED_DOMINATES:.0%} of the step lies beyond the "
             f"strategy's own world-size-1 step. Memory per "
             f"rank: on GPU the allocator's model states at gradients_ready; on CPU peak RSS.</p>"]
    for heading, lines in _verdict_sections(found, memory):
        parts.append(f"<h3>{e(heading)}</h3><ul>" + "".join(f"<li>{e(line)}</li>" for line in lines) + "</ul>")
    parts.append("</section>")
    return "\n".join(parts)


def _table_html(table: Table) -> str:
    e = html.escape
    parts = [f"<h3>{e(table.device)}</h3><div class='wide'><table><tr>"
             + "".join(f"<th>{e(t)}</th>" for t in table.titles) + "</tr>"]
    parts += ["<tr>" + "".join(f"<td>{e(cell)}</td>" for cell in row) + "</tr>" for row in table.rows]
    parts.append("</table></div>")
    if table.hidden:
        parts.append(f"<p class='note'>Left out, as nothing on {e(table.device)} fills them: "
                     f"{e(', '.join(table.hidden))}.</p>")
    return "\n".join(parts)


def _table_notes(summary: pd.DataFrame) -> list[str]:
    notes = ["Medians across launches. The samples/s interval is the range of the launches below 5 launches and a "
             "95% bootstrap interval from 5; a cell of one launch has none ('-'). Efficiencies: "
             "E(N) = X(N) / (N X_ref(1)) (docs/methodology.md, 'Derived figures'). Shared-GPU rows carry no speed.",
             _basis_note(summary)]
    if any(column in summary and summary[column].notna().any()
           for column in ("exposed_comm_share", "framework_overhead_share", "step_beyond_ws1_share")):
        notes.append(STEP_BEYOND_NOTE)
    if "host_load" in summary and summary["host_load"].notna().any():
        notes.append(HOST_LOAD_NOTE)
    return notes


def _figures(title: str, figures: Iterable[tuple[str | None, Sequence[str]]], anchor: str,
             caption: str = "", empty: str = "No rows with these figures.") -> list[str]:
    """A section of plots (those drawn; `empty`, saying there are none and how to get them, otherwise),
    each with its notes."""
    e = html.escape
    drawn = [(svg, notes) for svg, notes in figures if svg]
    parts = [f"<section id='{anchor}'><h2>{e(title)}</h2>"]
    if caption:
        parts.append(f"<p class='note'>{e(caption)}</p>")
    parts.append("<div class='plots'>")
    for svg, notes in drawn:
        captions = "".join(f"<br>{e(note)}" for note in notes).removeprefix("<br>")
        parts.append(f"<figure>{svg}" + (f"<figcaption>{captions}</figcaption>" if notes else "") + "</figure>")
    if not drawn:
        parts.append("<p>" + re.sub(r"`([^`]+)`", r"<code>\1</code>", e(empty)) + "</p>")   # commands as code
    parts.append("</div></section>")
    return parts


def busbw_missing(summary: pd.DataFrame, sources: Sequence[Path]) -> str:
    """What to run for the bus-bandwidth plot: `harness comm` at the largest world size of these cells (at
    least 2, a collective's smallest group) on their device, and this report again with its rows."""
    world_size = max([2, *(int(n) for n in summary.get("world_size", ()) if n == n)])
    devices = set(summary["device"]) if "device" in summary else set()
    device = f" --device {devices.pop()}" if len(devices) == 1 else ""
    rows = "results/comm.jsonl"
    report = shlex.join(["python", "-m", "harness", "report", *(str(s) for s in sources), rows])
    return (f"No collective benchmark rows in these files. `python -m harness comm --world-size {world_size}{device} "
            f"--out {rows}` times each collective over doubling sizes on this machine (nccl-tests' algbw and "
            f"busbw); then `{report}` draws them here.")


def _by_device(summary: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    if summary.empty:
        return []
    return [(str(device), group) for device, group in summary.groupby("device", sort=False)]


def _memory_caption(summary: pd.DataFrame) -> str:
    devices = set(summary["device"]) if "device" in summary else set()
    lines = []
    if DeviceKind.CUDA.value in devices:
        lines.append("GPU: model states as the allocator holds them at gradients_ready of the last warm-up step, "
                     "beside the ZeRO paper's prediction from the strategy's plan.")
    if devices - {DeviceKind.CUDA.value}:
        lines.append(f"CPU: {RSS_CONTAINS}. Left: against the plain loop's on the same workload (dashed line; "
                     "labels: the difference in MiB). Right: the model states alone, counted from their storages, "
                     "beside the prediction.")
    return " ".join(lines)


def html_report(summary: pd.DataFrame, table: pd.DataFrame, raw_rows: Sequence[Row], commbench: Sequence[dict],
                environments: list[dict], sources: Sequence[Path],
                projections: Sequence[Mapping[str, Any]] = ()) -> str:
    e = html.escape
    found = verdicts(summary, table)
    workloads = list(dict.fromkeys(summary["workload"])) if not summary.empty else []
    by_device = _by_device(summary)
    table_by_device = _by_device(table)
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>parbench report</title>",
             f"<style>{STYLE}</style></head><body>", "<h1>parbench report</h1>",
             f"<p class='note'>From {e(', '.join(str(s) for s in sources))}: {len(raw_rows)} measured rows"
             + (f", {len(projections)} projected rows (drawn under 'Projected scaling' only, never in the verdicts "
                "or the table)" if projections else "")
             + f"; generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.</p>",
             verdicts_html(found, verdict_lines(raw_rows))]
    per_workload = lambda plot, frames: [(plot(frame, w), ()) for _, frame in frames for w in workloads]  # noqa: E731
    # Each workload's throughput beside its scaling efficiency.
    speed = [figure for pair in zip(per_workload(plot_throughput, by_device), per_workload(plot_efficiency, by_device))
             for figure in pair]
    parts += _figures("Throughput and scaling efficiency", speed, anchor="speed")
    if projections:
        parts += _figures("Projected scaling", projection_figures(projections, summary), anchor="projection",
                          caption="Predictions of `python -m harness project`, not measurements: each strategy's "
                                  "projected efficiency (line) with its interval (band: the projected step time's "
                                  "interval, so the slow end is the low efficiency), and that strategy's measured "
                                  "cells on top (diamonds, efficiency against its measured world size 1).")
    parts += _figures("Memory per rank", per_workload(plot_memory, by_device), caption=_memory_caption(summary),
                      anchor="memory")
    communication = [(plot_communication(frame, w, summary[summary["device"] == device]), ())
                     for device, frame in table_by_device for w in workloads]
    communication += [(plot_traffic_by_group(frame, w), ()) for device, frame in table_by_device for w in workloads]
    parts += _figures("Communication", communication, anchor="communication")
    parts += _figures("Collective bus bandwidth", [(plot_busbw(commbench), ())], anchor="busbw",
                      empty=busbw_missing(summary, sources))
    parts += _figures("Loss parity", [(plot_losses(raw_rows, w), ()) for w in workloads], anchor="losses",
                      caption=LOSS_CAPTION)
    parts.append("<section id='cells'><h2>Cells</h2>")
    parts += [_table_html(t) for t in tables(summary)] or ["<p>No cell rows.</p>"]
    parts += [f"<p class='note'>{e(note)}</p>" for note in _table_notes(summary)]
    parts.append("</section><section id='environment'><h2>Environment</h2><ul>")
    parts += ["<li>" + e(", ".join(f"{k}: {v}" for k, v in env.items())) + "</li>" for env in environments]
    parts.append("</ul></section></body></html>")
    return "\n".join(parts)


def markdown_report(summary: pd.DataFrame, environments: list[dict], sources: Sequence[Path],
                    table: pd.DataFrame | None = None, raw_rows: Sequence[Row] = ()) -> str:
    escape = lambda text: text.replace("|", "\\|")  # noqa: E731
    lines = ["# parbench report", "", f"From {', '.join(str(s) for s in sources)}; "
             f"generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.", "", "## Verdicts", ""]
    for heading, items in _verdict_sections(verdicts(summary, table), verdict_lines(raw_rows)):
        lines += [f"### {heading}", ""] + [f"- {item}" for item in items] + [""]
    lines += ["## Cells", ""]
    for found in tables(summary):
        lines += [f"### {found.device}", "", "| " + " | ".join(found.titles) + " |", "|" + " --- |" * len(found.titles)]
        lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in found.rows]
        lines.append("")
    for note in _table_notes(summary):
        lines += [note, ""]
    lines += ["## Environment", ""]
    for environment in environments:
        lines.append("- " + ", ".join(f"{k}: {escape(str(v))}" for k, v in environment.items()))
    return "\n".join(lines) + "\n"


def _basis_note(summary: pd.DataFrame) -> str:
    if "throughput_basis" not in summary or not (summary["throughput_basis"] == Basis.UNSTALLED.value).any():
        return "Step ms, throughput (samples/s), its plot and the efficiencies use every timed step."
    return ("The host stalled some timed steps (column 'host-stalled steps'; docs/methodology.md, 'Host stalls'), so "
            "step ms, samples/s, its interval, the throughput plot and the efficiencies use the unstalled steps; "
            "'step ms, all steps' and 'samples/s, all steps' are the raw figures the rows carry.")


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
    projections = read_projections(sources)
    table = launch_table(rows)
    # Each launch's memory outside its model states (harness.derive.memory_flags) in rows.csv: whether it was flagged
    # beside its status, the figures last.
    table = pd.concat([table, pd.DataFrame([flag_columns(measurements(row)) for row in rows], columns=FLAG_COLUMNS,
                                           index=table.index)], axis=1)
    # A launch recorded again (`run --resume`) counts by its last row in time (harness.derive.launches): rows.csv keeps
    # every row, each replaced one marked, so that a reader filtering on it counts what the report counts.
    counted = set(last_row_indices(rows))
    table["replaced"] = [index not in counted for index in range(len(rows))]
    if "status" in table:
        table.insert(table.columns.get_loc("status") + 1, "replaced", table.pop("replaced"))
        table.insert(table.columns.get_loc("replaced") + 1, "memory_flagged", table.pop("memory_flagged"))
    summary = cell_table(rows)
    environments = _environments(rows)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.md", out / "report.html", out / "rows.csv", out / "rows.parquet"]
    written[0].write_text(markdown_report(summary, environments, sources, table, rows))
    written[1].write_text(html_report(summary, table, rows, commbench, environments, sources, projections))
    table.to_csv(written[2], index=False)
    table.to_parquet(written[3], index=False)
    return written
