"""Exact gates: the figures of a cell that do not depend on the machine, held to committed expectations.

    python -m harness run --matrix ci --device cpu --out results/ci.jsonl
    python -m harness expect results/ci.jsonl --against results/reference/ci-expectations/ci.json
    python -m harness expect results/ci.jsonl --against results/reference/ci-expectations/ci.json --write

A cell's step time depends on the machine and its load; these figures do not. With the same versions of
Python, torch, DeepSpeed and Horovod, the same spec computes them the same on any machine:
- its status (a cell that stops running, or starts being skipped, is a change);
- the collectives counted per step on each rank (harness.rank.comm_counter): per type its calls, its bytes
  (nccl-tests' size), its bytes by the size of the group each call ran among and by dtype;
- the bytes each rank puts on the wire per step, derived from those (harness.derive.comm.rank_wire_bytes,
  summed by `sent_total`: the ring algorithm's count);
- the model-state census of each rank (harness.rank.memory_model.census_bytes: weights, gradients, optimizer);
- the bytes of the tensors each rank holds outside that census (harness.rank.memory_model.untracked_tensor_bytes),
  and whether any rank's resident growth beyond the census was flagged: a measured figure, but judged against a
  size far above any honest cell's (OUTSIDE_CENSUS_FLAG_BYTES there), so the same verdict everywhere;
- the model's parameters, and those each rank holds and keeps whole;
- its parity verdict (harness.derive.parity.judge over the rows read);
- the losses of its first PARITY_STEPS steps. These are the only figures compared with a tolerance: a loss
  is a floating-point sum whose order may follow the machine (the threads per rank follow its cores), so it
  is compared by parity's own per-step measure (`loss_deviations`, the expectation taking the reference's
  place) against the tolerances of the row's arithmetic (`TOLERANCE`): how far the row is off the recorded
  run's own progress, not how far off the plain loop.
Every other figure is compared for equality. Cells are keyed by their label (harness.derive.rows.label),
not by the host type: the point is that these figures are the same everywhere.

Versions are part of the key. Rows run under other versions than the expectations were recorded with are
reported as that ("versions changed: torch A -> B"), with their figures' differences listed beneath as what
the upgrade changed, never as a regression: `Outcome.exit_status` is VERSIONS_CHANGED (3) then, 1 for a
difference under the same versions, 0 for none. Re-recording (`--write`) rewrites the file with sorted keys,
one figure per line, so the change shows as a diff in review.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from harness.derive.comm import rank_wire_bytes, sent_total
from harness.derive.parity import PARITY_STEPS, TOLERANCE, Quantity, arithmetic, judge, loss_deviations
from harness.derive.rows import Row, is_ok, label, measurements

FORMAT = 1
# What changes these figures besides the code: the interpreter and the libraries that compute and communicate
# (as harness.environment records them; None where one is not installed, or not on this device).
VERSION_KEYS = ("python", "torch", "deepspeed", "horovod", "cuda", "cudnn", "nccl")
CENSUS_KINDS = ("weights", "gradients", "optimizer")
LOSSES = f"losses of steps 0-{PARITY_STEPS - 1}"
STATUS = "status"
OUTSIDE_CENSUS_FLAGGED = "memory outside the census flagged"
FAULT_VARIABLE = "PARBENCH_FAULT"        # harness.rank.faults.FAULT_ENV (not imported: that module needs torch)
UPDATE = ("python -m harness expect ROWS.jsonl --against THIS_FILE --write, ROWS from a run of the same matrix "
          "(docs/methodology.md, 'What CI gates exactly')")

SAME, DIFFERENT, VERSIONS_CHANGED = 0, 1, 3     # `harness expect`'s exit statuses (2 is bad input)


class ExpectationsError(ValueError):
    """Rows or an expectations file that cannot be judged or recorded: one line saying why."""


# ---- a row's figures ---------------------------------------------------------------------------------


def figures(row: Row, verdict: str) -> dict[str, Any]:
    """{figure name: value} of one row, every value a JSON scalar but the losses' list. `verdict` is the row's
    parity verdict among the rows it was read with."""
    if not is_ok(row):
        return {STATUS: row.get("status")}
    m, spec = measurements(row), row["spec"]
    found: dict[str, Any] = {STATUS: row["status"], "warm-up steps": spec["warmup_steps"],
                             "timed steps": spec["timed_steps"], "seed": spec.get("seed", 0),
                             "parameters": m.get("parameters"), "parity verdict": verdict,
                             LOSSES: list(m.get("loss_per_step", [])[:PARITY_STEPS])}
    for rank, held in enumerate(m.get("parameters_held_by_rank") or []):
        found[f"parameters held on rank {rank}"] = held
    for rank, whole in enumerate(m.get("weights_kept_whole_parameters_by_rank") or []):
        found[f"parameters kept whole on rank {rank}"] = whole
    for rank, census in enumerate(m.get("model_state_census_bytes_by_rank") or []):
        for kind in CENSUS_KINDS:
            found[f"census bytes of {kind} on rank {rank}"] = census.get(kind)
    for rank, untracked in enumerate(m.get("untracked_tensor_bytes_by_rank") or []):
        found[f"untracked tensor bytes on rank {rank}"] = untracked
    if "memory_outside_census_flagged" in m:
        found[OUTSIDE_CENSUS_FLAGGED] = m["memory_outside_census_flagged"]
    ranks = int(m.get("data_parallel") or 1)
    for rank, counted in enumerate(m.get("comm_per_step_by_rank") or []):
        for collective, counts in counted.items():
            found[f"{collective} calls per step on rank {rank}"] = counts["calls"]
            found[f"{collective} bytes per step on rank {rank}"] = counts["bytes"]
            for group, size in (counts.get("bytes_by_group_size") or {}).items():
                found[f"{collective} bytes per step in groups of {group} on rank {rank}"] = size
            for label, figures in (counts.get("by_group") or {}).items():     # tp and dp told apart
                found[f"{collective} calls per step in group {label} on rank {rank}"] = figures["calls"]
                found[f"{collective} bytes per step in group {label} on rank {rank}"] = figures["bytes"]
            for dtype, by_dtype in (counts.get("dtypes") or {}).items():
                found[f"{collective} bytes per step in {dtype} on rank {rank}"] = by_dtype["bytes"]
        found[f"wire bytes per step on rank {rank}"] = sent_total(rank_wire_bytes(counted, ranks))
    return {name: _plain(value) for name, value in found.items()}


def _plain(value: Any) -> Any:
    """A per-step mean that is a whole number as an int (947712.0 -> 947712), so the file reads as counts."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def versions(rows: Sequence[Row]) -> dict[str, Any]:
    """The versions every row ran under; ExpectationsError where rows disagree."""
    found: dict[str, Any] = {}
    for row in rows:
        environment = row.get("environment") or {}
        these = {key: environment.get(key) for key in VERSION_KEYS}
        if found and these != found:
            changed = "; ".join(f"{key} {found[key]} and {these[key]}" for key in VERSION_KEYS
                                if found[key] != these[key])
            raise ExpectationsError(f"the rows ran under different versions ({changed}): judge or record the "
                                    "rows of one environment at a time")
        found = these
    return found


def cell_figures(rows: Sequence[Row]) -> list[tuple[str, Row, dict[str, Any]]]:
    """(label, row, figures) of every row, in order, parity judged over all of them."""
    verdicts = judge(rows)
    return [(label(row), row, figures(row, parity.verdict.value)) for row, parity in zip(rows, verdicts)]


# ---- comparing -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What `check` found: one line per difference, the version changes, and how much was compared."""

    differences: tuple[str, ...] = ()
    versions_changed: tuple[str, ...] = ()      # "torch 2.13.0+cpu -> 2.14.0+cpu"
    cells: int = 0
    figures: int = 0

    @property
    def exit_status(self) -> int:
        if self.versions_changed:
            return VERSIONS_CHANGED
        return DIFFERENT if self.differences else SAME

    def lines(self, update: str) -> list[str]:
        """What `harness expect` prints: the version change first, each difference, then one closing line;
        `update` is the command that re-records the expectations from these rows."""
        found = list(self.differences)
        if self.versions_changed:
            changed = "; ".join(self.versions_changed)
            what = (f"the {len(found)} difference(s) below are what the upgrade changed, not regressions" if found
                    else "every figure is as recorded")
            head = [f"versions changed: {changed}; the expectations were recorded under the old ones: {what}; "
                    f"re-record them: {update}"]
            return head + [f"  under the new versions: {line}" for line in found]
        if found:
            return found + [f"{len(found)} difference(s) from the expectations over {self.cells} cells "
                            f"(expected -> measured); if the change is meant, re-record them: {update}"]
        return [f"{self.cells} cells, {self.figures} figures: as expected"]


def check(rows: Sequence[Row], expected: Mapping[str, Any]) -> Outcome:
    """Each row's figures against the expectations of its cell (`load`'s form), one line per difference,
    and each expected cell without a row."""
    measured = cell_figures(rows)
    cells: dict[str, Mapping[str, Any]] = expected["cells"]
    differences: list[str] = []
    for name, row, found in measured:
        if name not in cells:
            differences.append(f"{name}: no expectation recorded for this cell (a new cell? re-record them)")
            continue
        differences.extend(f"{name}: {line}" for line in _compare(cells[name], found, row))
    seen = {name for name, _, _ in measured}
    differences.extend(f"{name}: expected, but no row of this cell among the rows read"
                       for name in cells if name not in seen)
    now = versions(rows)
    changed = tuple(f"{key} {expected['versions'].get(key)} -> {now[key]}" for key in VERSION_KEYS
                    if expected["versions"].get(key) != now[key])
    return Outcome(differences=tuple(dict.fromkeys(differences)), versions_changed=changed,
                   cells=len(seen), figures=sum(len(found) for _, _, found in measured))


def _compare(expected: Mapping[str, Any], found: Mapping[str, Any], row: Row) -> list[str]:
    """One line per figure that differs: exact but for the losses (the module docstring)."""
    if expected.get(STATUS) != found.get(STATUS):
        message = f" ({row.get('message')})" if row.get("message") else ""
        return [f"{STATUS} {expected.get(STATUS)} -> {found.get(STATUS)}{message} (expected -> measured)"]
    lines = []
    for name in sorted(set(expected) | set(found)):
        if name == LOSSES:
            line = _compare_losses(expected.get(name), found.get(name), row)
            if line:
                lines.append(f"{name}: {line}")
            continue
        was, now = expected.get(name, _ABSENT), found.get(name, _ABSENT)
        if was != now:
            lines.append(f"{name} {_show(was)} -> {_show(now)} (expected -> measured)")
    return lines


_ABSENT = object()


def _show(value: Any) -> str:
    return "absent" if value is _ABSENT else json.dumps(value)


def _compare_losses(expected: Sequence[float] | None, found: Sequence[float] | None, row: Row) -> str:
    """'' where every compared step is within the parity tolerance of the row's arithmetic, taking the expected
    losses as the reference; else the steps that are not, in tolerances, with both losses."""
    expected, found = list(expected or []), list(found or [])
    if len(expected) != len(found):
        return f"{len(expected)} -> {len(found)} steps (expected -> measured)"
    tolerance = TOLERANCE[arithmetic(row)]
    steps = loss_deviations({"measurements": {"loss_per_step": found}},
                            {"measurements": {"loss_per_step": expected}})
    off = []
    for step, deviation in enumerate(steps):
        allowed = tolerance[Quantity.FIRST_LOSS if step == 0 else Quantity.LATER_LOSSES]
        if not deviation <= allowed:
            off.append(f"step {step} {expected[step]:.7g} -> {found[step]:.7g} ({deviation / allowed:.3g} "
                       f"parity tolerances off)")
    return "; ".join(off) + (" (expected -> measured)" if off else "")


# ---- recording and reading -----------------------------------------------------------------------------


def record(rows: Sequence[Row]) -> dict[str, Any]:
    """The expectations of `rows` (`load`'s form); ExpectationsError where they cannot stand as expectations:
    a planted fault, a launch that failed, or repeats of a cell that disagree."""
    if not rows:
        raise ExpectationsError("no cell rows to record")
    cells: dict[str, dict[str, Any]] = {}
    for name, row, found in cell_figures(rows):
        fault = ((row.get("environment") or {}).get("env") or {}).get(FAULT_VARIABLE)
        if fault:
            raise ExpectationsError(f"{name} ran with {FAULT_VARIABLE}={fault}: a planted fault is no expectation")
        if row.get("status") not in ("ok", "skipped"):
            raise ExpectationsError(f"{name} is {row.get('status')} ({row.get('message')}): record a run whose "
                                    "cells ran (or were skipped for a reason of the machine)")
        if name in cells:
            disagree = _compare(cells[name], found, row)
            if disagree:
                raise ExpectationsError(f"{name}: its launches disagree ({disagree[0]}): these figures are not "
                                        "deterministic here")
            continue
        cells[name] = found
    return {"format": FORMAT, "versions": versions(rows), "update": UPDATE, "cells": cells}


def dumps(expectations: Mapping[str, Any]) -> str:
    """The file's text: sorted keys, one figure (one loss) per line, so a change is a small diff."""
    return json.dumps(expectations, indent=1, sort_keys=True, allow_nan=False) + "\n"


def load(path: Path) -> dict[str, Any]:
    """An expectations file as `record` made it; ExpectationsError naming what is wrong otherwise."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExpectationsError(f"{path}: no such expectations file; record one with --write") from None
    except (OSError, ValueError) as error:
        raise ExpectationsError(f"{path}: not an expectations file ({error})") from None
    if (not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("cells"), dict)
            or not isinstance(data.get("versions"), dict)):
        raise ExpectationsError(f"{path}: not an expectations file of format {FORMAT} (a JSON object with "
                                "format, versions and cells, as --write records it)")
    return data


__all__ = ["DIFFERENT", "ExpectationsError", "Outcome", "SAME", "VERSIONS_CHANGED", "check", "dumps", "figures",
           "load", "record"]
