"""Run a list of cells one after another, appending a row per launch, and summarise them.

    python -m harness run --matrix smoke

Each row is appended as soon as its cell ends, so an interrupted run keeps everything already measured,
and `resume` picks it up again: launches already recorded `ok` in the results file are not repeated, and
a launch whose measurements reached its cell folder but whose row never reached the results file (the
append failed, or the harness was killed first) is recorded from its folder without running it again.
A failed append ends the run with AppendError, naming the folder that keeps the cell's measurements.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import uuid
from datetime import datetime, timezone
from statistics import median
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from harness.environment import capture_environment
from harness.launch import LOG_FILE, SPEC_FILE, run_cell
from harness.mfu import model_flops_utilization, peak_flops
from harness.placement import Placement
from harness.parity import parity_for, reference_key
from harness.record import AppendError, append_row, read_results
from harness.spec import RunResult, RunSpec, SpecError, Status
from harness.stats import bootstrap_median_ci
from harness.worker import ERROR_FILE, MEASUREMENTS_FILE

# Starts the message of a row recorded from its cell folder by a resumed run (recover_from_cell_dir).
RECOVERED = "recovered from its cell folder"


@dataclass(frozen=True)
class RunOptions:
    results: Path                 # the JSONL file rows are appended to
    timeout_s: float = 900.0      # per launch, after which every rank of the cell is killed
    placement: Placement = Placement()
    peak_flops_per_s: float | None = None   # the user's peak for MFU where the table has none (CPUs)
    resume: bool = False          # skip launches (cell and repeat) already recorded ok in `results`, and
                                  # record those with measurements in their cell folder but no row


def cells_dir(results: Path) -> Path:
    """Folder of per-cell artifacts (spec, logs) beside a results file."""
    return results.with_name(results.stem + "-cells")


def run_specs(specs: Sequence[RunSpec], options: RunOptions,
              on_result: Callable[[RunResult], None] | None = None,
              on_start: Callable[[RunSpec, int], None] | None = None) -> list[RunResult]:
    """Launch every repeat of every cell in order; returns the rows of this call, with the rows a resumed
    run found already recorded (or recovered from cell folders) in their place. Raises AppendError, naming
    where the launch's own record is kept, when its row cannot be appended."""
    environment = capture_environment(freeze_dir=options.results.parent)
    existing = read_results([options.results]) if options.results.exists() else []
    references: dict[tuple, list[float]] = {}
    for row in existing:
        _remember_reference(row, references)
    with_row = {(r.spec.cell_id, r.repeat) for r in existing}
    recorded = {(r.spec.cell_id, r.repeat): r for r in existing if options.resume and r.status is Status.OK}
    results = []
    for spec in specs:
        for repeat in range(spec.repeats):
            if (spec.cell_id, repeat) in recorded:
                results.append(recorded[spec.cell_id, repeat])
                if on_result is not None:
                    on_result(recorded[spec.cell_id, repeat])
                continue
            cell_dir = cells_dir(options.results) / f"{_slug(spec.label)}-{spec.cell_id}-r{repeat}"
            # A launch with a row of any status keeps its verdict: only a missing row is recovered.
            result = None
            if options.resume and (spec.cell_id, repeat) not in with_row:
                result = recover_from_cell_dir(spec, repeat, cell_dir, environment)
            if result is None:
                if on_start is not None:
                    on_start(spec, repeat)
                _clear_outcome(cell_dir)
                result = run_cell(spec, repeat=repeat, cell_dir=cell_dir, timeout_s=options.timeout_s,
                                  environment=environment, placement=options.placement)
            result = _with_parity(result, references)
            result = _with_mfu(result, options.peak_flops_per_s)
            try:
                append_row(options.results, result)
            except AppendError as error:
                raise AppendError(f"{error}. {_where_kept(result, cell_dir)}") from error
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def recover_from_cell_dir(spec: RunSpec, repeat: int, cell_dir: Path,
                          environment: dict[str, Any]) -> RunResult | None:
    """The ok row of a launch whose rank 0 wrote measurements.json into `cell_dir` (and no rank an error
    report) for this cell, or None. The spec is the folder's spec.json, the launch command the first line
    of its log.txt, the start the time spec.json was written (just before the launch), the environment
    the one captured now; the message says the row was recovered and what the folder cannot tell: the
    launcher's exit status and wall time (left at 0). A multi-node launch's per-node commands are not
    recovered."""
    measurements_path = cell_dir / MEASUREMENTS_FILE
    if not measurements_path.is_file() or any(cell_dir.glob(ERROR_FILE.format(rank="*"))):
        return None
    try:
        recorded_spec = RunSpec.from_dict(json.loads((cell_dir / SPEC_FILE).read_text()))
        measurements = json.loads(measurements_path.read_text())
        started = datetime.fromtimestamp((cell_dir / SPEC_FILE).stat().st_mtime, timezone.utc)
    except (OSError, ValueError, KeyError, TypeError, SpecError):   # not a whole launch's folder: run it
        return None
    if recorded_spec.cell_id != spec.cell_id or not isinstance(measurements, dict):
        return None
    return RunResult(spec=recorded_spec, status=Status.OK, run_id=uuid.uuid4().hex, repeat=repeat,
                     message=f"{RECOVERED} {cell_dir} by a resumed run: rank 0's {MEASUREMENTS_FILE} was "
                     "written but the row never reached the results file; the launcher's exit status and "
                     "wall time were not recorded",
                     measurements=measurements, environment=environment,
                     launch_command=_logged_command(cell_dir / LOG_FILE),
                     started_at=started.isoformat(timespec="seconds"), artifacts_dir=str(cell_dir))


def _logged_command(log: Path) -> list[str]:
    """The launch command from the first line of a cell's log.txt ("$ ENV=... command  # node 0"), or []."""
    try:
        with open(log, encoding="utf-8", errors="replace") as handle:
            first = handle.readline()
        return shlex.split(first[2:], comments=True) if first.startswith("$ ") else []
    except (OSError, ValueError):   # ValueError: shlex on a line cut short inside a quote
        return []


def _clear_outcome(cell_dir: Path) -> None:
    """Remove an earlier launch's measurements and error reports from a folder about to be reused, so that
    what is there afterwards is this launch's alone (harness.launch reads them as its outcome; a resumed
    run recovers rows from them)."""
    for stale in [cell_dir / MEASUREMENTS_FILE, *cell_dir.glob(ERROR_FILE.format(rank="*"))]:
        stale.unlink(missing_ok=True)


def _where_kept(result: RunResult, cell_dir: Path) -> str:
    """Where a launch whose row could not be appended left its own record, for the one-line error."""
    what = f"The {result.status.value} row of {result.spec.label} r{result.repeat}"
    if (cell_dir / MEASUREMENTS_FILE).is_file() and result.status is Status.OK:
        return (f"{what} is not recorded, but its measurements are kept in {cell_dir / MEASUREMENTS_FILE}: "
                "once the file can be written again, resuming this run (--resume) records it from there "
                "without running the cell again")
    if cell_dir.is_dir():
        return f"{what} is not recorded; the cell's folder is {cell_dir}"
    return f"{what} is not recorded"


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
    """One line per cell: its status and headline figures. With several repeats, throughput is the median
    across the repeats' medians with its 95% bootstrap confidence interval; `stalled` counts the timed
    steps the host descheduled (harness.timing), which the raw medians include; exposed communication and
    the parity verdict are the first repeat's."""
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
                     f"{stalled_text:>8} {exposed_text:>8} {losses[0]:>8.4f}->{losses[-1]:<8.4f} {m.get('parity_verdict', ''):>10}")
    return "\n".join(lines)
