"""Run a list of cells one after another, appending a row per launch, and summarise them.

    python -m harness run --matrix smoke

Each row is appended as soon as its cell ends, so an interrupted run keeps everything already measured,
and `resume` picks it up again: launches already recorded `ok` in the results file are not repeated.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from harness.environment import capture_environment
from harness.launch import run_cell
from harness.placement import Placement
from harness.parity import parity_for, reference_key
from harness.record import append_row, read_results
from harness.spec import RunResult, RunSpec, Status


@dataclass(frozen=True)
class RunOptions:
    results: Path                 # the JSONL file rows are appended to
    timeout_s: float = 900.0      # per launch, after which every rank of the cell is killed
    placement: Placement = Placement()
    peak_flops_per_s: float | None = None   # the user's peak for MFU, recorded as the user's (CPUs)
    resume: bool = False          # skip launches (cell and repeat) already recorded ok in `results`


def cells_dir(results: Path) -> Path:
    """Folder of per-cell artifacts (spec, logs) beside a results file."""
    return results.with_name(results.stem + "-cells")


def run_specs(specs: Sequence[RunSpec], options: RunOptions,
              on_result: Callable[[RunResult], None] | None = None,
              on_start: Callable[[RunSpec, int], None] | None = None) -> list[RunResult]:
    """Launch every repeat of every cell in order; returns the rows of this call, with the rows a resumed
    run found already recorded in their place."""
    environment = capture_environment(freeze_dir=options.results.parent)
    references = _existing_references(options.results)
    recorded = recorded_ok(options.results) if options.resume else {}
    results = []
    for spec in specs:
        for repeat in range(spec.repeats):
            if (spec.cell_id, repeat) in recorded:
                results.append(recorded[spec.cell_id, repeat])
                if on_result is not None:
                    on_result(recorded[spec.cell_id, repeat])
                continue
            if on_start is not None:
                on_start(spec, repeat)
            cell_dir = cells_dir(options.results) / f"{_slug(spec.label)}-{spec.cell_id}-r{repeat}"
            result = run_cell(spec, repeat=repeat, cell_dir=cell_dir, timeout_s=options.timeout_s,
                              environment=environment, placement=options.placement)
            result = _with_parity(result, references)
            result = _with_user_peak(result, options.peak_flops_per_s)
            append_row(options.results, result)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def recorded_ok(path: Path) -> dict[tuple[str, int], RunResult]:
    """{(cell_id, repeat): row} of the launches already recorded ok in a results file."""
    if not path.exists():
        return {}
    return {(r.spec.cell_id, r.repeat): r for r in read_results([path]) if r.status is Status.OK}


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


def _with_user_peak(result: RunResult, user_peak: float | None) -> RunResult:
    """The row with the peak the user stated (`--peak-tflops`), a recorded input: MFU itself is derived
    when rows are read (harness.derive.peaks, harness.derive.cells)."""
    if result.status is not Status.OK or user_peak is None:
        return result
    return dataclasses.replace(result, measurements={**result.measurements, "user_peak_flops_per_s": user_peak})


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80]


def summary_table(rows: Sequence[dict]) -> str:
    """One line per cell: its status and headline figures, from `harness.derive.cells.cell_table` (the
    same figures `harness report` shows). Throughput is the median across ok launches on the table's
    basis (every timed step, or the unstalled ones where the host stalled some: harness.derive.throughput);
    `stalled` counts the timed steps the host descheduled; the interval is the range of the launches."""
    from harness.derive.cells import cell_table

    cells = cell_table(rows)
    header = (f"{'cell':<52} {'status':<7} {'step ms':>8} {'samples/s':>10} {'range':>15} {'stalled':>8} "
              f"{'exposed':>8} {'loss first->last':>18}")
    lines = [header, "-" * len(header)]
    losses = {row["cell_id"]: row["measurements"]["loss_per_step"] for row in rows if row.get("status") == "ok"}
    for cell in cells.to_dict("records"):
        label = cell["label"][:52]
        if not cell["ok"]:
            lines.append(f"{label:<52} {cell['status']:<7} {cell['message'][:70]}")
            continue
        interval = (f"{cell['samples_per_s_low']:.0f}-{cell['samples_per_s_high']:.0f}"
                    if cell["samples_per_s_low"] is not None else f"{cell['ok']} launch")
        exposed = cell.get("exposed_comm_share")
        exposed_text = f"{exposed:.0%}" if exposed is not None and exposed == exposed else "-"
        stalled_text = f"{cell['host_stalled_steps']}/{cell['timed_steps_recorded']}"
        first, last = losses[cell["cell_id"]][0], losses[cell["cell_id"]][-1]
        status = "ok" if cell["status"] == "ok" else f"{cell['ok']}/{cell['launches']}ok"
        samples = cell["samples_per_s"]
        lines.append(f"{label:<52} {status:<7} {cell['step_time_median_s'] * 1e3:>8.1f} {samples:>10.1f} "
                     f"{interval:>15} {stalled_text:>8} {exposed_text:>8} {first:>8.4f}->{last:<8.4f}")
    lines.append(f"(throughput over {cells['throughput_basis'].iloc[0]}; README, 'Host stalls')" if len(cells) else "")
    return "\n".join(lines)
