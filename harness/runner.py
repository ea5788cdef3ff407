"""Run a list of cells one after another, appending a row per launch, and summarise them.

    python -m harness run --matrix smoke

Each row is appended as soon as its cell ends, so an interrupted run keeps everything already measured.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from harness.environment import capture_environment
from harness.launch import Placement, run_cell
from harness.mfu import model_flops_utilization, peak_flops
from harness.parity import parity_for, reference_key
from harness.record import append_row, read_results
from harness.spec import RunResult, RunSpec, Status


@dataclass(frozen=True)
class RunOptions:
    results: Path                 # the JSONL file rows are appended to
    timeout_s: float = 900.0      # per launch, after which every rank of the cell is killed
    placement: Placement = Placement()
    peak_flops_per_s: float | None = None   # the user's peak for MFU where the table has none (CPUs)


def cells_dir(results: Path) -> Path:
    """Folder of per-cell artifacts (spec, logs) beside a results file."""
    return results.with_name(results.stem + "-cells")


def run_specs(specs: Sequence[RunSpec], options: RunOptions,
              on_result: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    environment = capture_environment(freeze_dir=options.results.parent)
    references = _existing_references(options.results)
    results = []
    for spec in specs:
        for repeat in range(spec.repeats):
            cell_dir = cells_dir(options.results) / f"{_slug(spec.label)}-{spec.cell_id}-r{repeat}"
            result = run_cell(spec, repeat=repeat, cell_dir=cell_dir, timeout_s=options.timeout_s,
                              environment=environment, placement=options.placement)
            result = _with_parity(result, references)
            result = _with_mfu(result, options.peak_flops_per_s)
            append_row(options.results, result)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def _existing_references(path: Path) -> dict[tuple, list[float]]:
    """Reference losses already recorded in the results file (a resumed or extended run)."""
    references: dict[tuple, list[float]] = {}
    if path.exists():
        for result in read_results([path]):
            _remember_reference(result, references)
    return references


def _remember_reference(result: RunResult, references: dict[tuple, list[float]]) -> None:
    if result.status is Status.OK and result.spec.strategy == "plain":
        references.setdefault(reference_key(result.spec), result.measurements["loss_per_step"])


def _with_parity(result: RunResult, references: dict[tuple, list[float]]) -> RunResult:
    """The row with its loss-parity verdict against the plain reference (plain rows become references)."""
    if result.status is not Status.OK:
        return result
    _remember_reference(result, references)
    parity = parity_for(result.spec, result.measurements["loss_per_step"], references)
    return dataclasses.replace(result, measurements={**result.measurements, **parity.to_dict()})


def _with_mfu(result: RunResult, user_peak: float | None) -> RunResult:
    """The row with its model FLOPs utilisation (harness.mfu), where a peak is known or given."""
    if result.status is not Status.OK:
        return result
    m = result.measurements
    table_peak = peak_flops(m.get("device_name", "cpu"), result.spec.precision.value)
    peak = user_peak or table_peak
    figures = {"peak_flops_per_s": peak,
               "peak_flops_source": "user" if user_peak else ("datasheet" if table_peak else None),
               "model_flops_per_s_per_device": m["train_flops_per_sample"] * m["samples_per_s_per_device"],
               "mfu": model_flops_utilization(m["train_flops_per_sample"], m["samples_per_s_per_device"], peak)}
    return dataclasses.replace(result, measurements={**m, **figures})


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80]


def summary_table(results: Sequence[RunResult]) -> str:
    """One line per launch: the cell, its status and its headline figures."""
    header = (f"{'cell':<58} {'status':<8} {'step ms':>9} {'samples/s':>10} {'loss first->last':>18} "
              f"{'parity':>10}")
    lines = [header, "-" * len(header)]
    for result in results:
        m = result.measurements
        if result.status is Status.OK:
            losses = m["loss_per_step"]
            lines.append(f"{result.spec.label[:58]:<58} {result.status.value:<8} "
                         f"{m['step_time_median_s'] * 1e3:>9.1f} {m['samples_per_s']:>10.1f} "
                         f"{losses[0]:>8.4f}->{losses[-1]:<8.4f} {m.get('parity_verdict', ''):>10}")
        else:
            lines.append(f"{result.spec.label[:58]:<58} {result.status.value:<8} {result.message[:60]}")
    return "\n".join(lines)
