"""The derive tier (harness/derive_check.py over harness/derive/snapshot.py): every derived figure of the committed
reference rows, by the base's code and by this checkout's, every difference listed, this checkout's held to
results/reference/derive-expectations.json.

The verdict is tested on documents written out here by hand; the committed file is held to what this checkout
derives, so it cannot go stale. The git tests (marked `launch`: they start git and the tier) build a repository from
this checkout, commit a changed constant of a formula (the all-reduce's busbw factor) and run
`python -m harness derive-check` in it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.cli import main
from harness.derive.comm import BUSBW_FACTORS
from harness.derive.rows import label, load_rows
from harness.derive.snapshot import REFERENCE_SETS, busbw_figures, canonical, same, snapshot
from harness.derive_check import EXPECTATIONS, judge

ROOT = Path(__file__).resolve().parents[1]
DDP = "gpt-tiny/ddp/ws2/gb16/mb4/fp32/cpu"
HOROVOD = "gpt-tiny/horovod/ws2/gb16/mb4/fp32/cpu"
PLAIN = "gpt-tiny/plain/ws1/gb16/mb4/fp32/cpu"
POINT = "commbench #1 (gloo, 2 ranks): all_reduce 1024 B"


def document(wire: float = 947712.0, busbw: float = 572201.0, **extra: dict) -> dict:
    """A derive document of one set: DDP and Horovod at 2 ranks all-reducing `wire` bytes a step, the plain loop,
    one benchmark point; `extra` adds figures to a cell."""
    cells = {DDP: {"comm_wire_bytes_per_step": wire, "samples_per_s": 91.0, "parity": "match"},
             HOROVOD: {"comm_wire_bytes_per_step": wire, "samples_per_s": 88.5, "parity": "match"},
             PLAIN: {"samples_per_s": 275.0, "parity": "reference"},
             POINT: {"busbw_bytes_per_s": busbw}}
    for cell, figures in extra.items():
        cells[cell] = {**cells.get(cell, {}), **figures}
    return {"format": 1, "significant_digits": 12, "libraries": {"python": "3.11.7", "numpy": "2.4.6"},
            "sets": {"ci-cpu": {"files": [], "cells": cells, "unavailable": {}}}}


def text(result) -> str:
    return "\n".join(result.lines())


# ---- figures and their precision --------------------------------------------------------------------------------


def test_a_figure_keeps_twelve_significant_digits_whole_counts_and_nothing_missing():
    assert canonical(1 / 3) == 0.333333333333
    assert canonical(np.float64(2843136.0)) == 2843136.0
    assert canonical(np.int64(16)) == 16 and type(canonical(np.int64(16))) is int
    assert canonical(np.bool_(True)) is True
    assert canonical(float("nan")) is None and canonical(None) is None
    assert canonical(float("inf")) == "inf"
    assert json.dumps(canonical(-0.0)) == "0.0"


def test_figures_are_the_same_through_float_noise_and_differ_beyond_it():
    assert same(0.1 + 0.2, 0.3)                    # 5.6e-17 apart: a platform's last bit
    assert same(947712, 947712.0)
    assert not same(1.0, 1.0 + 2e-10)               # beyond 1e-10 of the value
    assert not same(1421576.0, 1421580.0)           # 4 bytes of 1.4 MB
    assert not same(True, 1)
    assert not same("match", "mismatch")


def test_busbw_is_taken_among_the_ranks_each_collective_ran_in():
    # 1 MB in 1 ms: algbw 1e9 B/s. All-reduce busbw = algbw x 2(n-1)/n, all-gather x (n-1)/n (nccl-tests).
    point = {"collective": "all_reduce", "size_bytes": 1_000_000, "time_s": 1e-3}
    gathered = {"collective": "all_gather", "size_bytes": 1_000_000, "time_s": 1e-3, "time_max_rank_s": 2e-3}
    found = busbw_figures([{"backend": "gloo", "world_size": 4, "rows": [point, gathered]},
                           {"backend": "gloo", "world_size": 4, "group_size": 2, "rows": [point]}])
    assert found["commbench #1 (gloo, 4 ranks): all_reduce 1000000 B"] == {"algbw_bytes_per_s": 1e9,
                                                                           "busbw_bytes_per_s": 1.5e9}
    assert found["commbench #1 (gloo, 4 ranks): all_gather 1000000 B"] == {
        "algbw_bytes_per_s": 1e9, "busbw_bytes_per_s": 0.75e9, "busbw_max_rank_bytes_per_s": 0.375e9}
    # Groups of 2 of the 4 ranks: each all-reduce ran among 2, 2(2-1)/2 = 1.
    assert found["commbench #2 (gloo, 4 ranks, groups of 2): all_reduce 1000000 B"]["busbw_bytes_per_s"] == 1e9


# ---- the verdict ------------------------------------------------------------------------------------------------


def test_a_figure_changed_against_the_base_and_not_recorded_fails_naming_it_and_its_cells():
    base, head = document(wire=947712.0), document(wire=1421568.0)
    result = judge(head, expected=base, base=base, base_commit="b" * 40)
    assert result.exit_status == 1
    assert [(d.cell, d.figure) for d in result.unacknowledged] == [(DDP, "comm_wire_bytes_per_step"),
                                                                   (HOROVOD, "comm_wire_bytes_per_step")]
    shown = text(result)
    assert "1 figure in 2 cells changed against the base bbbbbbbbbbbb, none acknowledged" in shown
    assert "derive tier: FAILED: 1 figure in 2 cells differ from" in shown
    assert "  comm_wire_bytes_per_step, 2 cells:" in shown
    assert f"    ci-cpu: {DDP}: 947712 -> 1421568 (base 947712)" in shown
    assert f"    ci-cpu: {HOROVOD}: 947712 -> 1421568 (base 947712)" in shown
    assert "python -m harness derive-check --record" in shown


def test_a_change_recorded_in_the_file_passes_listed_as_acknowledged():
    base, head = document(busbw=572201.0), document(busbw=858302.0)
    result = judge(head, expected=head, base=base, base_commit="b" * 40)
    assert result.exit_status == 0
    assert [(d.cell, d.figure, d.acknowledged) for d in result.changed] == [(POINT, "busbw_bytes_per_s", True)]
    shown = text(result)
    assert "1 figure in 1 cell changed against the base bbbbbbbbbbbb; acknowledged in" in shown
    assert f"    ci-cpu: {POINT}: 572201 -> 858302" in shown
    assert "derive tier: pass" in shown


def test_a_figure_that_appears_or_disappears_is_a_difference():
    recorded = document(**{DDP: {"mfu": 0.19}})
    result = judge(document(**{PLAIN: {"mfu": 0.2}}), expected=recorded)
    assert result.exit_status == 1
    assert {(d.cell, d.figure, d.other, d.head) for d in result.unacknowledged} == {
        (DDP, "mfu", 0.19, None), (PLAIN, "mfu", None, 0.2)}
    assert f"ci-cpu: {DDP}: 0.19 -> absent" in text(result)


def test_a_difference_from_the_file_that_the_base_shares_is_not_blamed_on_the_code():
    base = head = document(wire=947712.0)
    result = judge(head, expected=document(wire=900000.0), base=base, base_commit="b" * 40)
    assert result.exit_status == 1 and not result.changed
    assert "the base derives the same: the rows, the file or the libraries changed, not the derive code" in text(result)


def test_a_family_the_base_could_not_derive_is_named_and_left_out_of_the_comparison_with_it():
    head = document(**{DDP: {"parity_tolerance_loss_first_step": 1e-6}})
    base = document()
    base["sets"]["ci-cpu"]["unavailable"] = {"parity": "ImportError: cannot import name 'judge'"}
    result = judge(head, expected=head, base=base, base_commit="b" * 40)
    assert result.exit_status == 0 and not result.changed
    assert ("the base bbbbbbbbbbbb could not derive the parity figures of set ci-cpu (ImportError: cannot import "
            "name 'judge'): not compared with it") in text(result)


def test_without_a_base_the_tier_says_why_and_still_holds_the_file():
    why = "shallow clone: HEAD^1 is not in its history (clone with full history, or `git fetch --unshallow`)"
    passed = judge(document(), expected=document(), base=None, base_skipped=why)
    assert passed.exit_status == 0
    assert f"derive tier: the base is not compared: {why}" in text(passed)
    assert judge(document(wire=1.0), expected=document(), base=None, base_skipped=why).exit_status == 1


def test_a_set_this_checkout_cannot_derive_or_a_missing_file_fails():
    broken = document()
    broken["sets"]["ci-cpu"] = {"files": [], "error": "KeyError: 'label'"}
    result = judge(broken, expected=document())
    assert result.exit_status == 1 and not result.unacknowledged      # one line for the set, not one a figure
    assert "derive tier: FAILED: this checkout could not derive set ci-cpu (KeyError: 'label')" in text(result)
    missing = judge(document(), expected=None)
    assert missing.exit_status == 1 and "no expectations file at" in text(missing)


def test_an_unknown_reference_set_is_bad_input(capsys):
    assert main(["derive-check", "--set", "nosuch"]) == 2
    assert main(["derive-check", "--record", "--set", "nosuch"]) == 2
    assert "--set nosuch: not a reference set; known: ci-cpu" in capsys.readouterr().err


def test_an_out_that_cannot_be_written_is_refused_before_anything_runs(capsys):
    # /proc exists and root passes its permission checks, yet no file can be made there: only trying tells.
    assert main(["derive-check", "--out", "/proc/parbench-derive"]) == 2
    assert "parbench: error: --out /proc/parbench-derive: cannot " in capsys.readouterr().err


def test_the_committed_expectations_are_what_this_checkout_derives():
    derived = snapshot(ROOT)
    result = judge(derived, expected=json.loads((ROOT / EXPECTATIONS).read_text()))
    assert result.exit_status == 0, text(result)
    assert set(derived["sets"]) == set(REFERENCE_SETS)
    assert not any(found.get("unavailable") or found.get("error") for found in derived["sets"].values())


# ---- the tier in a repository: a changed constant of a formula --------------------------------------------------

ALL_REDUCE_FACTOR = "Collective.ALL_REDUCE: lambda n: 2 * (n - 1) / n,"
PLANTED_FACTOR = "Collective.ALL_REDUCE: lambda n: 3 * (n - 1) / n,"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def _tier(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return subprocess.run([sys.executable, "-m", "harness", "derive-check", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """This checkout as a repository of its own: its committed history, then its working tree's code and
    expectations committed on top (tagged `checkout`), so that HEAD^1 is a base with this checkout's code."""
    repo = tmp_path_factory.mktemp("derive") / "repo"
    subprocess.run(["git", "clone", "-q", "--local", str(ROOT), str(repo)], check=True)
    for folder in ("harness", "workloads"):
        shutil.copytree(ROOT / folder, repo / folder, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / EXPECTATIONS, repo / EXPECTATIONS)
    _git(repo, "add", "-A", "harness", "workloads", str(EXPECTATIONS))
    _git(repo, "commit", "-q", "--allow-empty", "-m", "this checkout")
    _git(repo, "tag", "checkout")
    return repo


def _cells_under(output: str, heading: str) -> list[str]:
    """The lines listed under `  heading, N cells:` up to the next heading."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {heading}, "))
    found = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        found.append(line.strip())
    return found


@pytest.mark.launch
def test_a_changed_busbw_factor_fails_the_tier_naming_figures_and_cells_until_re_recorded(repository):
    comm = repository / "harness" / "derive" / "comm.py"
    source = comm.read_text()
    assert ALL_REDUCE_FACTOR in source
    comm.write_text(source.replace(ALL_REDUCE_FACTOR, PLANTED_FACTOR))
    _git(repository, "commit", "-q", "-am", "the all-reduce's busbw factor 3(n-1)/n")

    failed = _tier(repository, "--set", "ci-cpu")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "derive tier: FAILED: " in failed.stdout
    # The cells that all-reduce at 2 ranks (their rows' counter), each at its counted bytes x 2(n-1)/n, now x 3(n-1)/n.
    [full, comm_rows] = (ROOT / path for path in REFERENCE_SETS["ci-cpu"])
    all_reduced = {label(row): row["measurements"]["comm_per_step_by_rank"][0]["all_reduce"]["bytes"]
                   for row in load_rows([full]) if row["spec"]["world_size"] == 2
                   and "all_reduce" in row["measurements"]["comm_per_step_by_rank"][0]}
    assert set(all_reduced) >= {DDP, HOROVOD}
    expected = [f"ci-cpu: {cell}: {size * BUSBW_FACTORS['all_reduce'](2):.0f} -> {size * 1.5:.0f} "
                f"(base {size * BUSBW_FACTORS['all_reduce'](2):.0f})" for cell, size in sorted(all_reduced.items())]
    assert sorted(_cells_under(failed.stdout, "comm_all_reduce_wire_bytes_per_step")) == expected
    # Every all-reduce size of the collective benchmark, and no other collective's.
    sizes = {row["size_bytes"] for run in (json.loads(line) for line in comm_rows.read_text().splitlines())
             for row in run["rows"] if row["collective"] == "all_reduce"}
    busbw = _cells_under(failed.stdout, "busbw_bytes_per_s")
    assert len(busbw) == len(sizes) and all(": all_reduce " in line for line in busbw)

    recorded = _tier(repository, "--set", "ci-cpu", "--record")
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    passed = _tier(repository, "--set", "ci-cpu")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "acknowledged in" in passed.stdout and "derive tier: pass" in passed.stdout
    assert len(_cells_under(passed.stdout, "comm_all_reduce_wire_bytes_per_step")) == len(all_reduced)


@pytest.mark.launch
def test_in_a_shallow_clone_the_tier_says_why_the_base_is_not_compared_and_passes(repository, tmp_path):
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", "--branch", "checkout", f"file://{repository}",
                    str(shallow)], check=True, capture_output=True)
    done = _tier(shallow, "--set", "ci-cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "derive tier: the base is not compared: shallow clone: HEAD^1 is not in its history" in done.stdout
    assert "derive tier: pass" in done.stdout
