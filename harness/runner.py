"""Run a list of cells one after another, appending a row per launch, and summarise them.

    python -m harness run --matrix smoke

Each row is appended as soon as its cell ends, so an interrupted run keeps everything already measured,
and `resume` picks it up again: launches already recorded `ok` in the results file are not repeated.
"""

from __future__ import annotations

import dataclasses
import re
from statistics import median
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from harness.environment import capture_environment
from harness.launch import run_cell
from harness.mfu import model_flops_utilization, peak_flops
from harness.placement import Placement
from harness.derive.parity import judge
from harness.record import append_row, read_results, read_rows
from harness.spec import RunResult, RunSpec, Status
from harness.stats import bootstrap_median_ci


@dataclass(frozen=True)
class RunOptions:
    results: Path                 # the JSONL file rows are appended to
    timeout_s: float = 900.0      # per launch, after which every rank of the cell is killed
    placement: Placement = Placement()
    peak_flops_per_s: float | None = None   # the user's peak for MFU where the table has none (CPUs)
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
            result = _with_mfu(result, options.peak_flops_per_s)
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


def summary_table(results: Sequence[RunResult], results_file: Path | None = None) -> str:
    """One line per cell: its status and headline figures. With several repeats, throughput is the median
    across the repeats' medians with its 95% bootstrap confidence interval; `stalled` counts the timed
    steps the host descheduled (harness.timing), which the raw medians include; exposed communication and
    the parity verdict are the first repeat's. Parity is judged (harness.derive.parity) over these rows
    and every row of `results_file`, so a reference run later, or in an earlier run, still counts."""
    shown = [result.to_dict() for result in results]
    earlier = read_rows([results_file]) if results_file is not None and results_file.exists() else []
    ids = {row["run_id"] for row in shown}
    verdicts = judge(shown + [row for row in earlier if row["run_id"] not in ids])
    parity = {row["run_id"]: verdict.verdict.value for row, verdict in zip(shown, verdicts)}
    cells: dict[str, list[RunResult]] = {}
    for result in results:
        cells.setdefault(result.spec.cell_id, []).append(result)
    header = (f"{'cell':<52} {'status':<7} {'step ms':>8} {'samples/s':>10} {'95% CI':>15} {'stalled':>8} "
              f"{'exposed':>8} {'loss first->last':>18} {'parity':>10}")
    lines = [header, "-" * len(header)]
    for launches in cells.values():
        first = launches[0]
        ok = [r for r in launches if r.status is Status.OK]
        label = first.spec.label[:52]
        if not ok:
            lines.append(f"{label:<52} {first.status.value:<7} {first.message[:70]}")
            continue
        m = ok[0].measurements
        step = median([r.measurements["step_time_median_s"] for r in ok])
        throughput = [r.measurements["samples_per_s"] for r in ok]
        low, high = bootstrap_median_ci(throughput)
        interval = f"{low:.0f}-{high:.0f}" if len(ok) > 1 else "1 launch"
        exposed = m.get("exposed_comm_share")
        exposed_text = f"{exposed:.0%}" if exposed is not None else "-"
        stalled = sum(r.measurements.get("host_stalled_steps", 0) for r in ok)
        stalled_text = f"{stalled}/{sum(len(r.measurements['step_time_s']) for r in ok)}"
        losses = m["loss_per_step"]
        status = "ok" if len(ok) == len(launches) else f"{len(ok)}/{len(launches)}ok"
        lines.append(f"{label:<52} {status:<7} {step * 1e3:>8.1f} {median(throughput):>10.1f} {interval:>15} "
                     f"{stalled_text:>8} {exposed_text:>8} {losses[0]:>8.4f}->{losses[-1]:<8.4f} "
                     f"{parity[ok[0].run_id]:>10}")
    return "\n".join(lines)
