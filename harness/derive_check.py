"""The derive tier: every derived figure of the committed reference rows, by the base commit's code and by this
checkout's, listed where they differ, and held to committed expectations.

    python -m harness derive-check                         # base: HEAD's first parent, the previous main
    python -m harness derive-check --base origin/main      # base: the merge base of HEAD and origin/main
    python -m harness derive-check --record                # re-record results/reference/derive-expectations.json
    python -m harness derive-check --set ci-cpu --out results/derive    # one reference set; both documents kept

Why: the A/B tier derives both sides' rows with this checkout's code, and the exact tier holds a few raw figures, so
a change in harness/derive/ that moves a derived figure (a busbw factor, MFU's FLOPs, the ZeRO memory formula, a
scaling efficiency's reference) passed CI unseen. Here the same committed rows (harness.derive.snapshot's
REFERENCE_SETS, this checkout's files) are derived twice:
- by the base: its commit checked out beside this one (harness.ab.checkout_of), and this checkout's
  harness/derive/snapshot.py, copied to a temporary folder, run with this interpreter in that checkout and with
  PYTHONPATH set to it, so that every `harness` import is the base's code (the script refuses to run otherwise). This
  checkout's driver rather than the base's own: both sides then extract the same figures from the same rows and
  differ by their derive code alone, and a base that predates the snapshot module is derived the same way. A family
  of figures whose function the base lacks is left out of the comparison with it, and named;
- by this checkout (its working tree, uncommitted changes included), in this process, while the base's runs.
Every figure that differs between them is listed: figure, cell, base value -> head value. Then this checkout's
figures are held to results/reference/derive-expectations.json (`EXPECTATIONS`): a figure that differs from it,
appears or disappears fails the tier, naming the figure and its cells. A change is acknowledged by re-recording
that file (`--record`) in the same commit, where a reviewer sees it in the diff: a figure changed against the base
and equal to the file is listed as acknowledged, and passes.

Without a base (a shallow clone, a root commit) the comparison with it is skipped, saying why, and the figures are
still held to the file, which needs no history. Exit statuses: 0 pass; 1 a figure that differs from the file, or one
this checkout could not derive; 2 bad input (a --base naming nothing, an unknown set).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from harness.derive import snapshot as snapshots
from harness.spec import SpecError

EXPECTATIONS = Path("results/reference/derive-expectations.json")
BASE_DEFAULT = "HEAD^1"
RECORD = "python -m harness derive-check --record"
# The base's derivation takes as long as this checkout's (seconds here); a base that hangs is stopped and skipped.
BASE_TIMEOUT_S = 300
ABSENT = None                    # a figure one side does not have (canonical figures are never None)

Key = tuple[str, str, str]       # (set, cell, figure)


@dataclass(frozen=True)
class Difference:
    set: str
    cell: str
    figure: str
    head: Any                    # this checkout's value, ABSENT where it has none
    other: Any                   # the base's or the file's, ABSENT where it has none
    acknowledged: bool = False   # against the base: this checkout's value is the file's
    base: Any = ABSENT           # against the file: the base's value, where the base was derived

    @property
    def where(self) -> str:
        return f"{self.set}: {self.cell}"


@dataclass(frozen=True, kw_only=True)
class TierResult:
    expectations: Path
    sets: int
    cells: int
    figures: int
    base: str = ""                                        # the base commit derived, "" where none was
    base_skipped: str = ""                                # why no base was compared, "" where one was
    base_left_out: list[str] = field(default_factory=list)          # what the base could not derive
    changed: list[Difference] = field(default_factory=list)         # this checkout against the base
    unacknowledged: list[Difference] = field(default_factory=list)  # this checkout against the file
    not_derived: list[str] = field(default_factory=list)            # what this checkout could not derive
    file_missing: bool = False
    libraries: str = ""          # the libraries the file was recorded under, where other than these
    timings: str = ""

    @property
    def exit_status(self) -> int:
        return 1 if self.unacknowledged or self.not_derived or self.file_missing else 0

    def lines(self) -> list[str]:
        lines = [f"derive tier: {self.sets} reference sets, {self.cells} cells, {self.figures} figures"
                 + (f"; derived: {self.timings}" if self.timings else "")]
        if self.base_skipped:
            lines.append(f"derive tier: the base is not compared: {self.base_skipped}")
        lines += [f"derive tier: the base {self.base[:12]} could not derive {what}: not compared with it"
                  for what in self.base_left_out]
        acknowledged = [d for d in self.changed if d.acknowledged]
        if self.base and not self.changed:
            lines.append(f"derive tier: every figure is the base {self.base[:12]}'s")
        elif self.base and not acknowledged:
            lines.append(f"derive tier: {_count(self.changed)} changed against the base {self.base[:12]}, none "
                         f"acknowledged in {self.expectations}: listed below")
        elif self.base:
            others = len(self.changed) - len(acknowledged)
            lines.append(f"derive tier: {_count(self.changed)} changed against the base {self.base[:12]}; "
                         f"acknowledged in {self.expectations}" + (f" ({others} others are listed below)" if others
                                                                   else "") + " (base -> this checkout):")
            lines += _grouped(acknowledged, lambda d: _pair(d.other, d.head))
        lines += [f"derive tier: FAILED: this checkout could not derive {what}" for what in self.not_derived]
        if self.file_missing:
            lines.append(f"derive tier: FAILED: no expectations file at {self.expectations}: record it with {RECORD}")
        elif self.unacknowledged:
            lines.append(f"derive tier: FAILED: {_count(self.unacknowledged)} differ from {self.expectations}, "
                         "unacknowledged (recorded -> this checkout):")
            lines += _grouped(self.unacknowledged, lambda d: _pair(d.other, d.head) + _base_note(d))
            if self.libraries:
                lines.append(f"  {self.libraries}")
            lines.append(f"  Where the change is meant, re-record the file and commit it with the change: {RECORD}")
        if self.exit_status == 0:
            lines.append(f"derive tier: pass: every figure is as {self.expectations} records it"
                         + (f", {_count(self.changed)} changed against the base acknowledged there"
                            if self.changed else ""))
        return lines


def _count(differences: Sequence[Difference]) -> str:
    figures, cells = len({d.figure for d in differences}), len({(d.set, d.cell) for d in differences})
    return f"{figures} {'figure' if figures == 1 else 'figures'} in {cells} {'cell' if cells == 1 else 'cells'}"


def _pair(before: Any, after: Any) -> str:
    """`before -> after`, numbers to the fewest significant digits (6, 9, then all) that tell them apart."""
    digits = _digits(before, after)
    return f"{_shown(before, digits)} -> {_shown(after, digits)}"


def _digits(*values: Any) -> int:
    for digits in (6, 9):
        if len({_shown(value, digits) for value in values}) == len({json.dumps(value) for value in values}):
            return digits
    return snapshots.SIGNIFICANT_DIGITS


def _shown(value: Any, digits: int) -> str:
    if value is ABSENT:
        return "absent"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))          # a byte count as a whole number
    return f"{value:.{digits}g}" if isinstance(value, float) else json.dumps(value)


def _grouped(differences: Sequence[Difference], value: Callable[[Difference], str]) -> list[str]:
    """One heading per figure with its number of cells, then one line per cell."""
    by_figure: dict[str, list[Difference]] = {}
    for d in differences:
        by_figure.setdefault(d.figure, []).append(d)
    lines = []
    for figure, found in by_figure.items():
        lines.append(f"  {figure}, {len(found)} {'cell' if len(found) == 1 else 'cells'}:")
        lines += [f"    {d.where}: {value(d)}" for d in found]
    return lines


def _base_note(d: Difference) -> str:
    """Against the file: the base's value, or that the base derives the same (then this change's derive code did
    not move the figure: the rows, the file or the libraries did)."""
    if d.base is ABSENT:
        return ""
    if d.head is not ABSENT and snapshots.same(d.base, d.head):
        return " (the base derives the same: the rows, the file or the libraries changed, not the derive code)"
    return f" (base {_shown(d.base, _digits(d.base, d.other, d.head))})"


# ---- comparing documents -------------------------------------------------------------------------------------


def differences(head: Mapping[Key, Any], other: Mapping[Key, Any]) -> list[Difference]:
    """Every figure that is not the same (harness.derive.snapshot.same) on both sides, or is on one side only,
    sorted by set, figure and cell."""
    keys = sorted(set(head) | set(other), key=lambda key: (key[0], key[2], key[1]))
    return [Difference(*key, head=head.get(key, ABSENT), other=other.get(key, ABSENT)) for key in keys
            if key not in head or key not in other or not snapshots.same(head[key], other[key])]


def _left_out(document: Mapping[str, Any]) -> tuple[set[str], set[str], list[str]]:
    """(sets it has no figures of, sets with a family of figures it could not derive, one line for each of those)."""
    failed, partial, lines = set(), set(), []
    for name, found in document.get("sets", {}).items():
        if "error" in found:
            failed.add(name)
            lines.append(f"set {name} ({found['error']})")
        for family, why in (found.get("unavailable") or {}).items():
            partial.add(name)
            lines.append(f"the {family} figures of set {name} ({why})")
    return failed, partial, lines


def judge(head: Mapping[str, Any], expected: Mapping[str, Any] | None, base: Mapping[str, Any] | None = None,
          *, only: Sequence[str] | None = None, base_commit: str = "", base_skipped: str = "",
          expectations: Path = EXPECTATIONS, timings: str = "") -> TierResult:
    """The tier's verdict on documents of harness.derive.snapshot: this checkout's (`head`) against the file's
    (`expected`: None where there is no file) and, where given, against the base's; of the sets named in `only`
    alone where given (a tier run on some sets judges those), else of every set either holds."""
    sets = set(only) if only is not None else set(head.get("sets", {})) | set((expected or {}).get("sets", {}))
    head_figures = snapshots.figures_of(head)
    head_failed, head_partial, not_derived = _left_out(head)
    counts = {"sets": len(head.get("sets", {})), "cells": len({(s, c) for s, c, _ in head_figures}),
              "figures": len(head_figures)}
    expected_figures = ({key: value for key, value in snapshots.figures_of(expected).items() if key[0] in sets}
                        if expected is not None else {})
    base_figures: dict[Key, Any] = {}
    changed: list[Difference] = []
    base_left_out: list[str] = []
    if base is not None:
        failed, partial, base_left_out = _left_out(base)
        base_figures = {key: value for key, value in snapshots.figures_of(base).items() if key[0] in sets}
        # Where the base could not derive a family, the figures it lacks are that family's: left out, said above.
        compared = {key: value for key, value in head_figures.items()
                    if key[0] not in failed and (key[0] not in partial or key in base_figures)}
        changed = [Difference(d.set, d.cell, d.figure, head=d.head, other=d.other,
                              acknowledged=_same_or_both_absent(d.head, expected_figures.get(_key(d), ABSENT)))
                   for d in differences(compared, base_figures)]
    # What this checkout could not derive fails the tier in one line each (`not_derived`), not once a figure.
    held = {key: value for key, value in expected_figures.items()
            if key[0] not in head_failed and (key[0] not in head_partial or key in head_figures)}
    unacknowledged = [Difference(d.set, d.cell, d.figure, head=d.head, other=d.other,
                                 base=base_figures.get(_key(d), ABSENT))
                      for d in differences(head_figures, held)] if expected is not None else []
    return TierResult(expectations=expectations, **counts, base=base_commit if base is not None else "",
                      base_skipped=base_skipped, base_left_out=base_left_out, changed=changed,
                      unacknowledged=unacknowledged, not_derived=not_derived, file_missing=expected is None,
                      libraries=_libraries(head, expected) if unacknowledged else "", timings=timings)


def _key(d: Difference) -> Key:
    return (d.set, d.cell, d.figure)


def _same_or_both_absent(a: Any, b: Any) -> bool:
    return (a is ABSENT and b is ABSENT) or (a is not ABSENT and b is not ABSENT and snapshots.same(a, b))


def _libraries(head: Mapping[str, Any], expected: Mapping[str, Any] | None) -> str:
    now, then = head.get("libraries") or {}, (expected or {}).get("libraries") or {}
    moved = [f"{name} {then.get(name)} -> {now.get(name)}" for name in sorted(set(now) | set(then))
             if now.get(name) != then.get(name)]
    return (f"The file was recorded under other libraries ({'; '.join(moved)}): an upgrade may move a figure "
            "(a bootstrap interval, a median) as well as a change of the code.") if moved else ""


# ---- deriving both sides ---------------------------------------------------------------------------------------


def _check_sets(sets: Sequence[str] | None) -> None:
    unknown = [name for name in sets or () if name not in snapshots.REFERENCE_SETS]
    if unknown:
        raise SpecError(f"--set {', '.join(unknown)}: not a reference set; known: "
                        f"{', '.join(snapshots.REFERENCE_SETS)}")


def _set_arguments(sets: Sequence[str] | None) -> list[str]:
    return [argument for name in sets or () for argument in ("--set", name)]


def start_base(tree: Path, repo: Path, sets: Sequence[str] | None, scratch: Path) -> tuple[subprocess.Popen, Path]:
    """This checkout's snapshot driver, copied to `scratch`, run against the base's code in `tree`: started in
    that checkout with it first on PYTHONPATH (never this checkout's package, which the editable install would
    otherwise also offer), on this checkout's rows. Returns the process and the file it writes."""
    driver = scratch / "derive_snapshot.py"
    shutil.copyfile(Path(snapshots.__file__), driver)
    out = scratch / "base.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen([sys.executable, str(driver), "--root", str(repo), "--code", str(tree),
                                "--out", str(out), *_set_arguments(sets)], cwd=tree, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, out


def finish_base(process: subprocess.Popen, out: Path, timeout_s: float = BASE_TIMEOUT_S) -> tuple[dict | None, str]:
    """(the base's document, "") or (None, why there is none)."""
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return None, f"the base's derivation ran past {timeout_s:.0f} s and was stopped"
    if process.returncode != 0:
        tail = " | ".join(stderr.strip().splitlines()[-3:]) or "no message"
        return None, f"the base's derivation exited {process.returncode}: {tail}"
    return json.loads(out.read_text()), ""


def run_tier(repo: Path, *, base_ref: str = BASE_DEFAULT, sets: Sequence[str] | None = None,
             expectations: Path | None = None, out: Path | None = None) -> TierResult:
    """Derive the reference rows by the base and by this checkout (module docstring) and judge them."""
    from harness.ab import Unavailable, checkout_of, resolve_base
    from harness.outputs import check_folder

    _check_sets(sets)
    if out is not None:
        check_folder(out, "--out")
    expectations = expectations or repo / EXPECTATIONS
    expected = json.loads(expectations.read_text()) if expectations.exists() else None
    head, base, base_commit, skipped, timings = None, None, "", "", []
    try:
        base_commit = resolve_base(repo, base_ref)
    except Unavailable as why:
        skipped = str(why)
    if base_commit:
        try:
            with checkout_of(repo, base_commit) as tree, tempfile.TemporaryDirectory(prefix="parbench-derive-") as t:
                started = time.monotonic()
                process, written = start_base(tree, repo, sets, Path(t))
                try:
                    head = _timed(lambda: snapshots.snapshot(repo, sets), "this checkout", timings)
                    base, skipped = finish_base(process, written)
                finally:
                    if process.poll() is None:      # this checkout's derivation raised: the base's goes too
                        process.kill()
                        process.wait()
                timings.insert(0, f"the base {base_commit[:12]} in {time.monotonic() - started:.0f} s")
        except Unavailable as why:                  # no work tree of the base here
            skipped = str(why)
    if head is None:
        head = _timed(lambda: snapshots.snapshot(repo, sets), "this checkout", timings)
    if out is not None:
        (out / "head.json").write_text(snapshots.dumps(head))
        if base is not None:
            (out / "base.json").write_text(snapshots.dumps(base))
    shown = expectations.relative_to(repo) if expectations.is_relative_to(repo) else expectations
    return judge(head, expected, base, only=sets, base_commit=base_commit if base is not None else "",
                 base_skipped=skipped, expectations=shown, timings=", ".join(timings))


def _timed(derive: Callable[[], dict], who: str, timings: list[str]) -> dict:
    started = time.monotonic()
    document = derive()
    timings.append(f"{who} in {time.monotonic() - started:.0f} s")
    return document


def record(repo: Path, sets: Sequence[str] | None = None, expectations: Path | None = None) -> str:
    """Write this checkout's figures to the expectations file (the named sets' alone, the file's others kept);
    returns what was recorded, in one line. Refuses (SpecError) where a set or family could not be derived."""
    _check_sets(sets)
    expectations = expectations or repo / EXPECTATIONS
    document = snapshots.snapshot(repo, sets)
    _, _, not_derived = _left_out(document)
    if not_derived:
        raise SpecError(f"not recorded: this checkout could not derive {'; '.join(not_derived)}")
    found = snapshots.figures_of(document)
    recorded = (f"recorded {len(found)} figures of {len({(s, c) for s, c, _ in found})} cells of "
                f"{', '.join(document['sets'])} in {expectations}")
    if sets and expectations.exists():
        kept = json.loads(expectations.read_text())
        recorded += f" (its other sets kept: {', '.join(sorted(set(kept['sets']) - set(document['sets']))) or 'none'})"
        document = {**document, "sets": {**kept["sets"], **document["sets"]}}
    expectations.write_text(snapshots.dumps(document))
    return recorded + ": review the diff and commit it with the change"


def command(base_ref: str, *, record_only: bool = False, sets: Sequence[str] | None = None,
            out: Path | None = None, repo: Path | None = None) -> int:
    """`python -m harness derive-check`: prints the tier's lines and returns its exit status."""
    from harness.environment import PROJECT_ROOT

    repo = repo or PROJECT_ROOT
    if record_only:
        print(record(repo, sets))
        return 0
    result = run_tier(repo, base_ref=base_ref, sets=sets, out=out)
    print("\n".join(result.lines()))
    return result.exit_status
