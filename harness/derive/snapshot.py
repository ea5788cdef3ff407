"""Every derived figure of the committed reference rows, as one canonical JSON document: what the derive tier holds.

    python -m harness.derive.snapshot --out snapshot.json            # this checkout's derive code
    python -m harness.derive.snapshot --set ci-cpu                    # one reference set, to stdout
    cd BASE && PYTHONPATH=BASE python /tmp/x/snapshot.py --root HEAD --code BASE --out base.json   # BASE's code

What is derived, per reference set (`REFERENCE_SETS`: committed rows read together, as `harness report` reads the
files it is given) and per cell, keyed by the cell's label as the report's table shows it (its conditions included):
- every column of `harness.derive.cells.cell_table`, the table the console summary, `harness report` and the asv
  suite read: status, step times and throughput on the set's basis, the throughput's interval, strong and weak
  scaling efficiency against both references, exposed communication, the framework's overhead, the step beyond the
  strategy's own world-size-1 step, wire bytes counted (in all and by process group) and expected, model states
  predicted (the ZeRO paper's formula), counted and allocated, activations predicted and measured, recompute cost,
  MFU, the parity verdict, checkpoint cost, size and resume verdict, the parameter servers' link bytes and
  staleness, torch.compile's figures, the host's load; all but the spec fields that name the cell (`IDENTITY`) and
  the prose notes beside figures (`PROSE`: a note's wording is not a figure);
- the launch table's figures that the cell table does not fold, which `harness report` writes to rows.csv and draws
  in its communication plot (wire bytes and sizes by collective, counted over expected, exposed seconds, MFU's peak
  and model FLOP/s, the fastest step, each launch's parity verdict), over the cell's ok launches;
- parity's deviation of each quantity and the tolerance it was held to (harness.derive.parity.judge), the worst
  launch's: a tolerance's constant moves these where it moves no verdict;
- each compared step's loss deviation in units of its tolerance (harness.derive.loss_deviation, the report's loss
  plot), the worst launch's;
- the ZeRO paper's model-state prediction by component (harness.derive.memory.predicted_model_states), the
  largest rank's, the median over launches as the table takes it;
and per point of the set's collective benchmarks (`commbench #i (backend, N ranks): COLLECTIVE SIZE B`, runs in file
order): algbw and busbw, from the mean and from the slowest rank's time (harness.derive.comm.bus_bandwidth,
nccl-tests' definition), as the report's bus-bandwidth plot draws them.
The report's verdicts (fastest strategy, margins, lowest memory) are computed from the cell table's figures, so a
change of the derive code that moves them moves a figure here first.

Precision. Each number is kept to SIGNIFICANT_DIGITS significant digits, and the tier (harness/derive_check.py)
calls two figures different where they differ by more than RELATIVE_TOLERANCE of the larger: well above the last
bits a platform's floating point may change (a median of the same floats is the same floats; a libm may differ in
the last bit, 1e-16 of the value), well below any change of a formula's constant, and enough digits to keep every
byte count below a terabyte whole. A missing figure (None, NaN) is left out, so a figure that appears or disappears
is a change too; an infinity is kept as "inf".

Why a script as well as a module: the derive tier runs this very file against another commit's harness package
(PYTHONPATH), so that both sides extract the same figures from the same rows and differ only by their derive code.
It therefore imports only `harness.derive.*` and `harness.record`, by absolute name, never itself; a family of
figures whose function that package lacks is left out and named in the set's `unavailable`, not failed; a set the
package cannot derive at all records its `error`.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import platform
import sys
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

FORMAT = 1
SIGNIFICANT_DIGITS = 12
RELATIVE_TOLERANCE = 1e-10

# Committed rows that reach most derived figures, small enough to derive in seconds. Paths from the repository root.
REFERENCE_SETS: dict[str, tuple[str, ...]] = {
    # gpt-tiny under the plain loop and every data-parallel strategy at 1 and 2 ranks on CPU, collectives counted;
    # gloo's collective benchmark at 2 ranks beside it (busbw)
    "ci-cpu": ("results/reference/ci-cpu/full.jsonl", "results/reference/ci-cpu/comm-ws2.jsonl"),
    # tensor parallelism, FSDP2 + TP, AutoTP and the pipeline, fp32 and bf16: traffic by process group
    "hybrid-cpu": ("results/reference/hybrid-cpu/cells.jsonl",),
    # an H200: MFU against the datasheet's peaks, allocated model states, activations, fp16, a failed and a skipped
    # cell, parity against a GPU's noise floor
    "h200": ("results/reference/h200/a3663fd/rows.jsonl",),
    # activation checkpointing on the H200: saved activations, the allocator's, the recompute cost
    "h200-memory-techniques": ("results/reference/h200-memory-techniques/memory-techniques.jsonl",),
    # checkpoint cells: save and load cost, size against the plan, resume verdicts, recovery after a kill
    "fault-tolerance": ("results/reference/fault-tolerance/ff47f7d/rows.jsonl",),
    # parameter servers beside DDP on an emulated network at several link rates: link bytes, staleness,
    # asynchronous parity; gloo's collective benchmark at each rate
    "emulated-ps": ("results/reference/emulated-ps/cells.jsonl", "results/reference/emulated-ps/comm.jsonl"),
}

# Cell-table columns that name the cell or copy a count from it: the cell's key, not figures of it.
IDENTITY = frozenset({"workload", "strategy", "options", "world_size", "nnodes", "global_batch", "micro_batch",
                      "precision", "device", "shared_device", "cell_id", "label", "conditions_id", "conditions"})
# Prose beside the figures: what a figure means or why there is none, worded for a reader.
PROSE = frozenset({"emulation", "message"})
PROSE_SUFFIXES = ("_note", "_because")

# Launch-table columns that say which launch it was or copy its spec, besides IDENTITY and PROSE.
LAUNCH_RECORD = frozenset({"run_id", "repeat", "status", "schema_version", "started_at", "wall_time_s", "git_sha",
                           "host", "warmup_steps", "timed_steps", "seed", "peak_rss_since"})

Figures = dict[str, dict[str, Any]]          # {cell: {figure: value}}


# ---- values --------------------------------------------------------------------------------------------------


def canonical(value: Any) -> bool | int | float | str | None:
    """A JSON scalar for a figure: numbers to SIGNIFICANT_DIGITS, integers and booleans as they are (numpy's too),
    None for a missing one (None, NaN), "inf" / "-inf" for an infinity."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isnan(number):
            return None
        if math.isinf(number):
            return "inf" if number > 0 else "-inf"
        return float(f"{number:.{SIGNIFICANT_DIGITS}g}") + 0.0      # + 0.0: no "-0.0"
    return str(value)


def same(a: Any, b: Any) -> bool:
    """Two canonical figures are the same: equal, or numbers within RELATIVE_TOLERANCE of the larger."""
    numeric = (isinstance(a, (int, float)) and not isinstance(a, bool)
               and isinstance(b, (int, float)) and not isinstance(b, bool))
    if numeric:
        return abs(a - b) <= RELATIVE_TOLERANCE * max(abs(a), abs(b))
    return a == b and type(a) is type(b)


def _add(found: Figures, cell: str, figures: Mapping[str, Any]) -> None:
    kept = {name: canonical(value) for name, value in figures.items()}
    found.setdefault(cell, {}).update({name: value for name, value in kept.items() if value is not None})


# ---- families of figures ---------------------------------------------------------------------------------------


def cell_figures(table: Any, cells: Mapping[str, str]) -> Figures:
    """Every column of the cell table but IDENTITY and PROSE, per cell (`cells`: {cell id: key})."""
    found: Figures = {}
    for line in table.to_dict("records"):
        _add(found, cells[str(line["cell_id"])], {name: value for name, value in line.items() if name not in IDENTITY
                                                  and name not in PROSE and not name.endswith(PROSE_SUFFIXES)})
    return found


def cell_key(line: Mapping[str, Any], seen: set[str]) -> str:
    """A cell's key: its label as the table shows it, conditions included, or where two cells share one (which the
    table's condition suffixes should prevent) the label and the cell's id, rather than merging them."""
    cell = str(line["label"])
    if cell in seen:
        cell = f"{cell} [{line['cell_id']}]"
    seen.add(cell)
    return cell


def launch_figures(rows: Sequence[Mapping[str, Any]], table: Any, cells: Mapping[str, str]) -> Figures:
    """The launch table's figures that the cell table does not fold (wire bytes by collective, their ratio to the
    expected, exposed seconds, MFU's peak and model FLOP/s, the fastest step, per-launch parity verdicts: what
    `harness report` writes to rows.csv and draws in its communication plot), per cell over its ok launches: a
    number's median, a text's distinct values (sorted, joined by " | ")."""
    from harness.derive.cells import launch_table

    launches = launch_table(rows)
    shown = set(table.columns)
    found: Figures = {}
    by_cell: dict[str, dict[str, list[Any]]] = {}
    for line in launches.to_dict("records"):
        if line.get("status") != "ok":
            continue
        figures = by_cell.setdefault(cells[str(line["cell_id"])], {})
        for name, value in line.items():
            if (name in shown or name in IDENTITY or name in PROSE or name in LAUNCH_RECORD
                    or name.endswith(PROSE_SUFFIXES) or canonical(value) is None):
                continue
            figures.setdefault(name, []).append(value)
    for cell, figures in by_cell.items():
        _add(found, cell, {name: _fold(values) for name, values in figures.items()})
    return found


def _fold(values: Sequence[Any]) -> Any:
    if all(isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) for value in values):
        return median(float(value) for value in values)
    return " | ".join(sorted({str(canonical(value)) for value in values}))


def parity_figures(rows: Sequence[Mapping[str, Any]], cell_of: Callable[[Mapping[str, Any]], str]) -> Figures:
    """Per cell, each quantity's largest deviation over its ok launches and the largest tolerance it was held to
    (harness.derive.parity.judge over the set's rows, as the table judges them)."""
    from harness.derive.parity import judge

    worst: dict[str, dict[str, float]] = {}
    for row, parity in zip(rows, judge(list(rows))):
        if row.get("status") != "ok":
            continue
        figures = worst.setdefault(cell_of(row), {})
        for kind, values in (("deviation", parity.deviations), ("tolerance", parity.tolerances)):
            for quantity, value in values.items():
                name = f"parity_{kind}_{getattr(quantity, 'value', quantity)}"
                figures[name] = max(figures.get(name, -math.inf), float(value))
    found: Figures = {}
    for cell, figures in worst.items():
        _add(found, cell, figures)
    return found


def loss_deviation_figures(rows: Sequence[Mapping[str, Any]], cell_of: Callable[[Mapping[str, Any]], str]) -> Figures:
    """Per cell held against a plain-loop reference, each compared step's loss deviation in tolerances
    (harness.derive.loss_deviation), the largest over its ok launches."""
    from harness.derive.loss_deviation import deviations_in_tolerances
    from harness.derive.parity import REFERENCE_STRATEGY, held_key, references

    found_references = references(rows)
    worst: dict[str, dict[str, float]] = {}
    for row in rows:
        reference = found_references.get(held_key(row))
        if (row.get("status") != "ok" or row["spec"]["strategy"] == REFERENCE_STRATEGY or reference is None
                or not (row.get("measurements") or {}).get("loss_per_step")):
            continue
        figures = worst.setdefault(cell_of(row), {})
        for step, value in enumerate(deviations_in_tolerances(row, reference)):
            name = f"loss_deviation_step_{step}_in_tolerances"
            figures[name] = max(figures.get(name, -math.inf), float(value))
    found: Figures = {}
    for cell, figures in worst.items():
        _add(found, cell, figures)
    return found


def model_state_figures(rows: Sequence[Mapping[str, Any]], cell_of: Callable[[Mapping[str, Any]], str]) -> Figures:
    """Per cell, the ZeRO paper's prediction of each model-state component and of what offload keeps on the host,
    the largest rank's, the median over ok launches (harness.derive.memory.predicted_model_states)."""
    from harness.derive.memory import predicted_model_states

    by_cell: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        predicted = predicted_model_states(row.get("measurements") or {}) if row.get("status") == "ok" else None
        if not predicted:
            continue
        figures = by_cell.setdefault(cell_of(row), {})
        for component in ("weights", "gradients", "optimizer", "host"):
            values = [rank[component] for rank in predicted if rank.get(component) is not None]
            if values:
                figures.setdefault(f"model_state_predicted_{component}_bytes_max", []).append(max(values))
    found: Figures = {}
    for cell, figures in by_cell.items():
        _add(found, cell, {name: median(values) for name, values in figures.items()})
    return found


def busbw_figures(runs: Sequence[Mapping[str, Any]]) -> Figures:
    """Per collective-benchmark run, algbw and busbw (from the mean over ranks, and from the slowest rank where the
    row has it) of each collective and size, among the ranks each collective ran in (a group's, with --group-size)."""
    from harness.derive.comm import bus_bandwidth

    found: Figures = {}
    for index, run in enumerate(runs, start=1):
        members = int(run.get("group_size") or run["world_size"])
        groups = f", groups of {members}" if members != run["world_size"] else ""
        name = f"commbench #{index} ({run.get('backend')}, {run['world_size']} ranks{groups})"
        for row in run["rows"]:
            algbw, busbw = bus_bandwidth(row["collective"], row["size_bytes"], row["time_s"], members)
            figures = {"algbw_bytes_per_s": algbw, "busbw_bytes_per_s": busbw}
            if "time_max_rank_s" in row:
                figures["busbw_max_rank_bytes_per_s"] = bus_bandwidth(row["collective"], row["size_bytes"],
                                                                      row["time_max_rank_s"], members)[1]
            _add(found, f"{name}: {row['collective']} {int(row['size_bytes'])} B", figures)
    return found


# Families of figures besides the cell table's, each computed from the set's rows and the cell of each row.
ROW_FAMILIES: dict[str, Callable[..., Figures]] = {
    "parity": parity_figures,
    "loss deviations": loss_deviation_figures,
    "model states by component": model_state_figures,
}


# ---- a set, and the document -----------------------------------------------------------------------------------


def derive_set(paths: Sequence[Path]) -> dict[str, Any]:
    """{"cells": {cell: {figure: value}}, "unavailable": {family: why}} of rows read together; {"error": why} where
    the set cannot be read or its cell table derived."""
    try:
        from harness.derive.cells import cell_table
        from harness.derive.rows import load_rows
        from harness.record import COMMBENCH_KIND, read_rows

        rows = load_rows(paths)
        runs = read_rows(list(paths), kind=COMMBENCH_KIND)
        table = cell_table(rows)
    except Exception as error:       # the other commit's code: said, never raised through the tier
        return {"error": f"{type(error).__name__}: {error}"}
    found: Figures = {}
    seen: set[str] = set()
    cells = {str(line["cell_id"]): cell_key(line, seen) for line in table.to_dict("records")}
    families: dict[str, Callable[[], Figures]] = {"cell table": lambda: cell_figures(table, cells),
                                                  "launch table": lambda: launch_figures(rows, table, cells),
                                                  "busbw": lambda: busbw_figures(runs)}
    for name, function in ROW_FAMILIES.items():
        families[name] = lambda function=function: function(rows, _cell_of(cells))
    unavailable: dict[str, str] = {}
    for name, family in families.items():
        if not rows and name != "busbw":      # a file of collective benchmarks alone
            continue
        try:
            for cell, figures in family().items():
                found.setdefault(cell, {}).update(figures)
        except Exception as error:   # a function the other commit's code lacks, or computes otherwise: said
            unavailable[name] = f"{type(error).__name__}: {error}"
    return {"cells": found, "unavailable": unavailable}


def _cell_of(cells: Mapping[str, str]) -> Callable[[Mapping[str, Any]], str]:
    """A row's cell key, by its identity as the cell table computed it (harness.derive.identity)."""
    from harness.derive.identity import cell_identity

    return lambda row: cells[cell_identity(row)]


def snapshot(root: Path, sets: Iterable[str] | None = None) -> dict[str, Any]:
    """The document for `sets` (default: every one of REFERENCE_SETS), their files under `root`."""
    names = list(sets) if sets is not None else list(REFERENCE_SETS)
    unknown = [name for name in names if name not in REFERENCE_SETS]
    if unknown:
        raise ValueError(f"unknown reference set {', '.join(unknown)}; known: {', '.join(REFERENCE_SETS)}")
    sets_found = {name: {"files": list(REFERENCE_SETS[name]),
                         **derive_set([root / path for path in REFERENCE_SETS[name]])} for name in names}
    # After deriving: the libraries it imported are then known.
    return {"format": FORMAT, "significant_digits": SIGNIFICANT_DIGITS, "libraries": libraries(), "sets": sets_found}


def libraries() -> dict[str, str | None]:
    """What computes the figures besides the derive code: a numpy or pandas upgrade may move a bootstrap or a
    median, and the tier says so when the figures differ."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("numpy", "pandas"):
        module = sys.modules.get(name)
        found[name] = getattr(module, "__version__", None)
    return found


def figures_of(document: Mapping[str, Any]) -> dict[tuple[str, str, str], Any]:
    """{(set, cell, figure): value} of a document."""
    return {(name, cell, figure): value
            for name, found in document.get("sets", {}).items()
            for cell, figures in found.get("cells", {}).items()
            for figure, value in figures.items()}


def dumps(document: Mapping[str, Any]) -> str:
    """The canonical text: sorted keys, one figure per line, so a re-recorded file's change is a small diff."""
    return json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the checkout whose reference rows are "
                        "derived (default: the working folder)")
    parser.add_argument("--set", action="append", dest="sets", metavar="NAME",
                        help=f"one of {', '.join(REFERENCE_SETS)} (repeatable; default: every one)")
    parser.add_argument("--code", type=Path, help="refuse to run unless `harness` is imported from this checkout "
                        "(the tier's check that the other commit's code is the one deriving)")
    parser.add_argument("--out", type=Path, help="write the document here (default: stdout)")
    args = parser.parse_args(argv)
    import harness

    code = Path(harness.__file__).resolve().parent.parent
    if args.code is not None and code != args.code.resolve():
        print(f"snapshot: harness is imported from {code}, not {args.code}", file=sys.stderr)
        return 2
    try:
        text = dumps(snapshot(args.root.resolve(), args.sets))
    except ValueError as error:
        print(f"snapshot: {error}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
