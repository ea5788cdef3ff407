"""Run a list of cells one after another, appending a row per launch, and summarise them.

    python -m harness run --matrix smoke

Each row is appended as soon as its cell ends, so an interrupted run keeps everything already measured,
and `resume` picks it up again: launches already recorded `ok` in the results file under the same
conditions (harness.derive.identity: the link rate, placement and host type are part of a cell) are not
repeated, nor are those recorded `skipped` while the reason still holds (their row is not appended again),
a launch recorded more than once going by its last row (harness.derive.launches, as the summary and `report` do),
and a launch whose measurements reached its cell folder but whose row never reached the results file (the
append failed, or the harness was killed first) is recorded from its folder without running it again.
A failed append ends the run with AppendError, naming the folder that keeps the cell's measurements.

Launches go round the cells repeat by repeat unless the matrix orders them otherwise (harness.launch_order): every cell's first launch in the matrix's order, then every second
launch of the cells that have one, and so on. A cell's launches then spread over the run, so a drift of the
machine's speed over minutes (another tenant, a warming room) lands on every cell alike instead of on the one whose
launches ran during it: the plain and bare loops' five launches each, launched one cell after the other, put the
harness's cost on gpt-tiny at +4.8% here, where the same steps timed in one process, alternately, differed by 0.2%.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import sys
import time
import uuid
from datetime import datetime, timezone
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from harness.derive.harness_overhead import BARE_STRATEGY, overhead_verdict
from harness.derive.identity import cell_identity, identity_of
from harness.derive.launches import last_row_indices
from harness.derive.memory_flags import flag_lines
from harness.derive.parity import REFERENCE_STRATEGY
from harness.run_cost import planned_seconds
from harness.environment import capture_environment
from harness.launch.cell import LOG_FILE, SPEC_FILE, launch_dir, run_cell
from harness.launch.host_builds import build_before_launch
from harness.launch.interrupt import Interrupted
from harness.launch_order import LaunchOrder, round_robin
from harness.launch.placement import LocalPlacement, Placement
from harness.launch.placement.emulated import EmulatedPlacement
from harness.record import AppendError, append_row, read_results, read_rows
from harness.spec import RunResult, RunSpec, SpecError, Status
from harness.rank.worker import ERROR_FILE, MEASUREMENTS_FILE

# Starts the message of a row recorded from its cell folder by a resumed run (recover_from_cell_dir).
RECOVERED = "recovered from its cell folder"


@dataclass(frozen=True)
class RunOptions:
    results: Path                 # the JSONL file rows are appended to
    timeout_s: float = 900.0      # per launch, after which every rank of the cell is killed
    placement: Placement = LocalPlacement()
    peak_flops_per_s: float | None = None   # the user's peak for MFU, recorded as the user's (CPUs)
    resume: bool = False          # skip launches (cell and repeat) already recorded ok in `results`, and
                                  # record those with measurements in their cell folder but no row
    emulated_network: dict[str, Any] | None = None   # harness.emulate's record, kept in every row's environment
    # Seconds the whole run may take (a lent GPU's time, a Slurm allocation's): no launch starts with less than
    # BUDGET_FLOOR_S of it left, each is timed out at what is left, and the launches never started are recorded
    # `skipped`, saying so. None: no limit.
    budget_s: float | None = None
    # The order the launches go in (harness.launch_order): repeat by repeat unless the matrix asks for another.
    launch_order: LaunchOrder = round_robin

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise SpecError(f"timeout_s must be a positive, finite number of seconds, got {self.timeout_s!r}")
        if self.budget_s is not None and not (math.isfinite(self.budget_s) and self.budget_s > 0):
            raise SpecError(f"budget_s must be a positive, finite number of seconds, got {self.budget_s!r}")


@dataclass(frozen=True)
class Planned:
    """What a run will do, known before its first launch: the header's counts."""

    cells: int
    launches: int                 # launches to run now
    recorded: int                 # launches a resumed run finds already recorded (ok, or skipped and still so)
    recovered: int                # launches a resumed run records from their cell folders without running
    seconds: float | None = None  # the launches' wall time on the 2-core VM (harness.run_cost); None on GPUs


def run_environment(options: RunOptions) -> dict[str, Any]:
    """The environment every row of the run records: versions, hardware, and where its cells run (the
    placement's name and an emulated cluster's record), which are part of each cell's identity."""
    environment = {**capture_environment(freeze_dir=options.results.parent), "placement": options.placement.name}
    if options.emulated_network is not None:
        environment["emulated_network"] = options.emulated_network
    return environment


def run_specs(specs: Sequence[RunSpec], options: RunOptions,
              on_result: Callable[[RunResult], None] | None = None,
              on_start: Callable[[RunSpec, int], None] | None = None,
              on_plan: Callable[[Planned], None] | None = None) -> list[RunResult]:
    """Launch every repeat of every cell in the run's order (the module docstring); returns the rows of this call,
    with the rows a resumed run found already recorded in their place. `on_plan` hears what will run before anything does,
    `on_start` each launch as it starts, `on_result` each row appended (a launch's, or one recovered from its
    cell folder), never a row that was already recorded. Raises AppendError, naming where the launch's own
    record is kept, when its row cannot be appended."""
    environment = run_environment(options)
    steps = planned_steps(specs, options, environment)
    if on_plan is not None:
        on_plan(planned(specs, steps))
    if isinstance(options.placement, (LocalPlacement, EmulatedPlacement)):    # ranks that share this host's files
        build_before_launch([spec for spec, _, _, recorded, result in steps if recorded is None and result is None],
                            say=lambda line: print(line, file=sys.stderr))
    results = []
    budget = Budget(options.budget_s)
    for spec, repeat, cell_dir, recorded, result in steps:
        if recorded is not None:
            results.append(recorded)
            continue
        if result is None and budget.spent():
            result = RunResult(spec=spec, status=Status.SKIPPED, run_id=uuid.uuid4().hex, repeat=repeat,
                               environment=environment, message=budget.spent(),
                               started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        if result is None:
            if on_start is not None:
                on_start(spec, repeat)
            _clear_outcome(cell_dir)
            began, started = time.monotonic(), datetime.now(timezone.utc).isoformat(timespec="seconds")
            try:
                result = run_cell(spec, repeat=repeat, cell_dir=cell_dir, timeout_s=budget.timeout(options.timeout_s),
                                  environment=environment, placement=options.placement)
            except Interrupted as stop:      # its processes are stopped by now (harness.launch.processes)
                row = RunResult(spec=spec, status=Status.INTERRUPTED, run_id=uuid.uuid4().hex, repeat=repeat,
                                environment=environment, artifacts_dir=str(cell_dir), started_at=started,
                                wall_time_s=round(time.monotonic() - began, 3),
                                message=f"{stop.name} arrived {time.monotonic() - began:.0f} s into the launch: its "
                                        "processes were stopped, and the run with it")
                append_row(options.results, row)
                stop.recorded.append(f"{spec.label} r{repeat} -> {options.results}")
                if on_result is not None:
                    on_result(row)
                raise
        result = _with_user_peak(result, options.peak_flops_per_s)
        try:
            append_row(options.results, result)
        except AppendError as error:
            raise AppendError(f"{error}. {_where_kept(result, cell_dir)}") from error
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


# Less than this left of a run's budget starts no launch: a launch's start-up alone (interpreters, a launcher, CUDA)
# takes 12-38 s on a GPU machine (results/reference/h200), and one killed half-way measures nothing.
BUDGET_FLOOR_S = 30.0


class Budget:
    """A run's time budget (RunOptions.budget_s), counted from when the run's first launch is due."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.started = seconds, time.monotonic()

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - (time.monotonic() - self.started)

    def spent(self) -> str:
        """Why no launch may start now ("" while one may)."""
        if self.left() >= BUDGET_FLOOR_S:
            return ""
        return (f"not launched: {max(self.left(), 0):.0f} s were left of the run's budget of {self.seconds:g} s "
                f"(--budget), under the {BUDGET_FLOOR_S:g} s a launch needs")

    def timeout(self, per_launch: float) -> float:
        """A launch's time-out: its own, or what is left of the budget where that is less."""
        return min(per_launch, self.left())


Step = tuple[RunSpec, int, Path, RunResult | None, RunResult | None]   # spec, repeat, folder, recorded, recovered


def planned_steps(specs: Sequence[RunSpec], options: RunOptions, environment: dict[str, Any]) -> list[Step]:
    """Every launch of `specs` in the run's order (`RunOptions.launch_order`), with the row a resume keeps for it (`recorded`) or the one it
    recovers from its cell folder (`recovered`); both None for a launch that will run. Reads, never writes."""
    existing = read_results([options.results]) if options.results.exists() else []
    # A cell is its spec under the run's conditions (harness.derive.identity): a row of the same spec at
    # another link rate, placement or host type is another cell's, never reused.
    with_row = {(_identity(r.spec, r.environment), r.repeat) for r in existing}
    kept = _kept_on_resume(existing) if options.resume else {}
    steps = []
    for spec, repeat in options.launch_order(specs):
        identity = _identity(spec, environment)
        cell_dir = launch_dir(options.results, spec, repeat, environment=environment)
        recorded = kept.get((identity, repeat))
        if recorded is not None and recorded.status is Status.SKIPPED and not _skip_reason(spec):
            recorded = None            # what made it skip is gone (a library installed): run it now
        recovered = None
        # A launch with a row of any status keeps its verdict: only a missing row is recovered.
        if recorded is None and options.resume and (identity, repeat) not in with_row:
            recovered = recover_from_cell_dir(spec, repeat, cell_dir, environment)
        steps.append((spec, repeat, cell_dir, recorded, recovered))
    return steps


def planned(specs: Sequence[RunSpec], steps: Sequence[Step]) -> Planned:
    """The counts of `planned_steps`: cells, launches to run, recorded and recovered."""
    to_launch = [spec for spec, *_, r, v in steps if r is None and v is None]
    return Planned(cells=len(specs), launches=len(to_launch), recorded=sum(r is not None for *_, r, _ in steps),
                   recovered=sum(v is not None for *_, v in steps), seconds=planned_seconds(to_launch))


def resume_plan(specs: Sequence[RunSpec],
                options: RunOptions) -> tuple[list[RunSpec], list[tuple[int, ...]], Planned]:
    """What `run --resume` would launch: each cell with launches still to run, its repeats their number; which
    launches those are, by repeat (their cell folders, `-r1` for a cell's second launch); and the counts
    (harness.launch.dry_run prints the cells)."""
    steps = planned_steps(specs, options, run_environment(options))
    left: dict[int, list[int]] = {}
    for spec, repeat, _, recorded, recovered in steps:
        if recorded is None and recovered is None:
            left.setdefault(id(spec), []).append(repeat)
    kept = [spec for spec in specs if id(spec) in left]
    return ([spec.replace(repeats=len(left[id(spec)])) for spec in kept],
            [tuple(sorted(left[id(spec)])) for spec in kept], planned(specs, steps))


def _identity(spec: RunSpec, environment: dict[str, Any]) -> str:
    return identity_of(spec.to_dict(), environment)


def _kept_on_resume(existing: Sequence[RunResult]) -> dict[tuple[str, int], RunResult]:
    """The row each launch (cell, repeat) keeps on resume: its last row (harness.derive.launches, as the summary
    and `report` count it) where that is ok or skipped (a skip is the machine's answer, which launching again
    would only append a second time); a launch whose last row is failed, oom, timeout or interrupted runs again."""
    kept: dict[tuple[str, int], RunResult] = {}
    for index in last_row_indices([row.to_dict() for row in existing]):
        row = existing[index]
        if row.status in (Status.OK, Status.SKIPPED):
            kept[(_identity(row.spec, row.environment), row.repeat)] = row
    return kept


def _skip_reason(spec: RunSpec) -> str | None:
    from harness.strategies import get_strategy

    return get_strategy(spec.strategy).skip_reason(spec)


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
    # The folder is named by the cell's identity under the run's conditions; its spec must be this one too.
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
    what is there afterwards is this launch's alone (harness.launch.cell reads them as its outcome; a resumed
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


def _with_user_peak(result: RunResult, user_peak: float | None) -> RunResult:
    """The row with the peak the user stated (`--peak-tflops`), a recorded input: MFU itself is derived
    when rows are read (harness.derive.peaks, harness.derive.cells)."""
    if result.status is not Status.OK or user_peak is None:
        return result
    return dataclasses.replace(result, measurements={**result.measurements, "user_peak_flops_per_s": user_peak})


def _oversubscribed(flag: Any) -> bool:
    """True only for a recorded True (a table's missing value may be None or NaN)."""
    return flag is not None and flag == True  # noqa: E712  (numpy's bool is not `True`)


# What the two columns of the step beyond the compute-only pass hold (harness.derive.exposed).
EXPOSED_NOTE = ("(exposed: the step beyond the compute-only pass at >= 2 ranks; overhead: the same at 1 rank, where "
                "nothing is communicated; docs/methodology.md)")


def _share(value: Any) -> str:
    return f"{value:.0%}" if value is not None and value == value else "-"


def _checkpoint_text(cell: dict) -> str:
    """A checkpoint cell's resume verdict and its save (harness.derive.resume), last on its line."""
    verdict = cell.get("resume")
    if not isinstance(verdict, str):
        return ""
    failed = f" ({cell['resume_failed']})" if cell.get("resume_failed") else ""
    recovered = (f", recovered in {cell['recovery_s']:.1f} s, {int(cell['steps_recomputed'])} steps recomputed"
                 if _present(cell.get("recovery_s")) else "")
    return f"  resume {verdict}{failed}, save {cell['checkpoint_save_s']:.2f} s{recovered}"


def _present(value: Any) -> bool:
    return value is not None and value == value


def _harness_overhead_notes(cells: Sequence[dict]) -> list[str]:
    """A line per plain cell beside a bare one: the harness's own cost on its step (harness.derive.harness_overhead)."""
    notes = []
    for cell in cells:
        share = cell.get("harness_overhead_share")
        if cell.get("strategy") != REFERENCE_STRATEGY or share is None or share != share:
            continue
        over = ", " + overhead_verdict(cell)[1]
        notes.append(f"(harness overhead, {cell['label']}: {share:+.1%}, its mean step against the bare loop's timed "
                     f"whole{over}; docs/methodology.md, 'The harness's own cost')")
    return notes


def summary_table(rows: Sequence[dict], results_file: Path | None = None) -> str:
    """One line per cell: its status and headline figures, from `harness.derive.cells.cell_table` (the
    same figures `harness report` shows). Throughput is the median across ok launches on the table's
    basis (every timed step, or the unstalled ones where the host stalled some: harness.derive.throughput),
    and `step ms` the step it stands for on that same basis (global batch / samples/s on every line);
    `stalled` counts the timed steps the host descheduled; `exposed` is exposed communication at >= 2
    ranks and `overhead` the framework's own overhead at 1 rank (harness.derive.exposed); the interval, last on the line, is the one the
    number of launches supports (harness.derive.intervals), with its label. Parity is judged
    (harness.derive.parity) over these rows and every row of `results_file`, so a reference recorded later
    in the matrix, or by an earlier run into the same file, still counts."""
    from harness.derive.cells import cell_table

    rows = [row.to_dict() if isinstance(row, RunResult) else row for row in rows]
    earlier = read_rows([results_file]) if results_file is not None and results_file.exists() else []
    cells = cell_table(rows, context=earlier)
    # As wide as the longest label (at least 52): a label cut short would drop the link rate it ends with.
    width = max([52, *(len(label) for label in cells.get("label", []))])
    header = (f"{'cell':<{width}} {'status':<7} {'step ms':>8} {'samples/s':>10} {'stalled':>8} "
              f"{'exposed':>8} {'overhead':>8} {'loss first->last':>18} {'parity':>12}  samples/s interval")
    lines = [header, "-" * len(header)]
    losses = {cell_identity(row): row["measurements"]["loss_per_step"] for row in rows if row.get("status") == "ok"}
    for cell in cells.to_dict("records"):
        label = cell["label"]
        if not cell["ok"]:
            lines.append(f"{label:<{width}} {cell['status']:<7} {cell['message'][:70]}")
            continue
        # A cell of one launch has no interval; in a table beside cells of several, pandas holds its None as NaN.
        interval = (f"{cell['samples_per_s_low']:.0f}-{cell['samples_per_s_high']:.0f} "
                    f"({cell['samples_per_s_interval']})" if _present(cell["samples_per_s_low"])
                    else "1 launch" if cell["launches"] == 1 else f"{int(cell['launches'])} launches")
        exposed_text, overhead_text = _share(cell.get("exposed_comm_share")), _share(cell.get("framework_overhead_share"))
        stalled_text = f"{int(cell['host_stalled_steps'])}/{int(cell['timed_steps_recorded'])}"   # floats where a skipped cell left NaN
        if cell["strategy"] == BARE_STRATEGY:         # one clock around its steps: no step of its own to call stalled
            stalled_text = "-"
        first, last = losses[cell["cell_id"]][0], losses[cell["cell_id"]][-1]
        status = "ok" if cell["status"] == "ok" else f"{cell['ok']}/{cell['launches']}ok"
        samples = cell["samples_per_s"]
        # Last on the line, like the interval: a mark that the step times measured cores taking turns.
        shared = f"  {cell['host_load']}" if _oversubscribed(cell.get("host_oversubscribed")) else ""
        shared += _checkpoint_text(cell)
        lines.append(f"{label:<{width}} {status:<7} {cell['step_time_on_basis_s'] * 1e3:>8.1f} {samples:>10.1f} "
                     f"{stalled_text:>8} {exposed_text:>8} {overhead_text:>8} {first:>8.4f}->{last:<8.4f} "
                     f"{cell['parity']:>12}  "
                     f"{interval}{shared}")
    if len(cells):
        lines.append(f"(step ms and samples/s over {cells['throughput_basis'].iloc[0]}; docs/methodology.md, 'Host stalls')")
        lines.append(EXPOSED_NOTE)
        lines += _harness_overhead_notes(cells.to_dict("records"))
    else:
        lines.append("")
    if any(_oversubscribed(cell.get("host_oversubscribed")) for cell in cells.to_dict("records")):
        lines.append("(oversubscribed: a host ran more rank threads than it has cores, so those step times "
                     "measure the cores' sharing; docs/methodology.md, 'On CPU')")
    # Last, where the eye lands: launches whose ranks held memory outside their model states
    # (harness.derive.memory_flags).
    lines += [f"MEMORY FLAGGED: {line}" for line in flag_lines(rows)]
    return "\n".join(lines)
