"""Memory a rank holds outside its model states, flagged where a reader looks: the sizes each reading is judged
against (harness.rank.memory_model), the planted leaks (harness.rank.faults), and the console, report.md and
rows.csv (harness.derive.memory_flags) on real launches of the plain loop with a leak planted and without.

Sizes by hand: gpt-tiny's census is 236,928 parameters x (4 + 4 + 8) bytes + 52 AdamW step counters x 4 bytes
= 3,791,056 bytes (3.6 MiB; tests/test_memory.py), far under any figure below.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from harness.cli import main
from harness.derive.memory_flags import SECTION, flag_columns, flag_lines, verdict_lines
from harness.rank import faults, memory_model
from harness.rank.faults import Fault
from harness.rank.memory_model import (HONEST_OUTSIDE_CENSUS_CPU_MIB, HONEST_TIMED_GROWTH_CPU_MIB, MIB,
                                       OUTSIDE_CENSUS_FLAG_BYTES, OUTSIDE_CENSUS_MARGIN_BYTES, GrowthLimit,
                                       TimedStepsGrowth, outside_census, outside_census_flag_bytes,
                                       timed_growth_flag_bytes, timed_growth_flagged)
from harness.report.document import markdown_report
from harness.strategies import STRATEGIES

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
LEAK = 100 * MIB
PLAIN = "gpt-tiny/plain/ws1/gb16/mb4/fp32/cpu"


# ---- the gap at the last warm-up step: a size per strategy ------------------------------------------------------


def test_a_strategys_gap_is_flagged_above_its_highest_honest_gap_plus_the_margin(monkeypatch):
    monkeypatch.setattr(memory_model, "HONEST_OUTSIDE_CENSUS_CPU_MIB", {"ddp": (7.5, 16.0), "zero2": (50.0, 59.0)})
    monkeypatch.setattr(memory_model, "OUTSIDE_CENSUS_MARGIN_BYTES", 32 * MIB)
    census = 4 * MIB
    # ddp: 16 + 32 = 48 MiB. At it, not above it: not flagged; a byte more is.
    assert outside_census_flag_bytes(CPU, "ddp") == 48 * MIB
    assert outside_census(census + 48 * MIB, census, CPU, "ddp") == (48 * MIB, False)
    assert outside_census(census + 48 * MIB + 1, census, CPU, "ddp")[1]
    # A 100 MiB leak on ddp's lowest honest gap: 107.5 MiB, flagged (the one 256 MiB line of before passed it).
    assert outside_census(census + int(107.5 * MIB), census, CPU, "ddp") == (107.5 * MIB, True)
    # zero2 (59 + 32 = 91 MiB): DeepSpeed's engine's honest 59 MiB is not flagged, where ddp's size would flag it.
    assert outside_census_flag_bytes(CPU, "zero2") == 91 * MIB
    assert not outside_census(census + 59 * MIB, census, CPU, "zero2")[1]
    assert outside_census(census + 59 * MIB, census, CPU, "ddp")[1]
    # A strategy not measured: the device's size; on CUDA one size for every strategy (the allocator counts tensors).
    assert outside_census_flag_bytes(CPU, "newcomer") == OUTSIDE_CENSUS_FLAG_BYTES["cpu"]
    assert outside_census_flag_bytes(CPU) == OUTSIDE_CENSUS_FLAG_BYTES["cpu"]
    assert outside_census_flag_bytes(CUDA, "zero2") == OUTSIDE_CENSUS_FLAG_BYTES["cuda"] == 64 * MIB


def test_a_100_mib_leak_clears_every_measured_strategys_size_with_a_margin_to_spare():
    # Each size is the highest honest gap + the margin; a leak of 100 MiB on the lowest honest gap must be above it
    # even if another machine's honest gaps came in a whole margin lower: lowest + 100 MiB > highest + 2 x margin.
    for strategy, (lowest, highest) in HONEST_OUTSIDE_CENSUS_CPU_MIB.items():
        size = outside_census_flag_bytes(CPU, strategy)
        assert size == int(highest * MIB) + OUTSIDE_CENSUS_MARGIN_BYTES, strategy
        assert lowest * MIB + LEAK > size + OUTSIDE_CENSUS_MARGIN_BYTES, (strategy, lowest, highest)
    # The device's size for a strategy not measured is the largest measured one's: no measured strategy is above it.
    measured = HONEST_OUTSIDE_CENSUS_CPU_MIB
    assert OUTSIDE_CENSUS_FLAG_BYTES["cpu"] == max(outside_census_flag_bytes(CPU, strategy) for strategy in measured)


def test_every_strategy_that_reads_its_model_states_on_cpu_has_its_honest_gap_measured():
    # The bare loop reads no model states; DataParallel and torch's ring attention (cp) run on CUDA alone (skipped on
    # CPU).
    assert set(STRATEGIES) - {"bare", "dataparallel", "cp"} <= set(HONEST_OUTSIDE_CENSUS_CPU_MIB)


# ---- the growth over the timed steps: a fixed part and a part per step -------------------------------------------


def test_the_growth_is_flagged_above_a_fixed_part_and_a_part_per_step(monkeypatch):
    monkeypatch.setattr(memory_model, "TIMED_GROWTH_FLAG_BYTES", {
        "resident": GrowthLimit(fixed_bytes=4 * MIB, per_step_bytes=MIB // 4),
        "allocated": GrowthLimit(fixed_bytes=MIB, per_step_bytes=MIB // 4)})
    # The last warm-up step and 10 timed steps: 4 + 11 / 4 = 6.75 MiB. At it: not flagged; a byte more is.
    assert timed_growth_flag_bytes("resident", 11) == 7_077_888
    assert not timed_growth_flagged(7_077_888, None, 11)
    assert timed_growth_flagged(7_077_888 + 1, None, 11)
    # A leak of 1 MiB a step: 11 MiB over those 11 steps is flagged; over ci's 3 timed steps (4 steps), 4 MiB is
    # under 4 + 1 = 5 MiB: a leak of 1 MiB a step is flagged from 6 steps on (n MiB > 4 + n / 4 MiB).
    assert timed_growth_flagged(11 * MIB, None, 11)
    assert not timed_growth_flagged(4 * MIB, None, 4) and timed_growth_flagged(6 * MIB, None, 6)
    # An honest 85 KiB a step (tp's) over 31 steps, 2.6 MiB, is far under 4 + 31 / 4 = 11.75 MiB.
    assert not timed_growth_flagged(31 * 85 * 1024, None, 31)
    # The allocator's (CUDA), 1 + 11 / 4 = 3.75 MiB, flags on its own; a growth not read flags nothing.
    assert timed_growth_flagged(0.0, 3.75 * MIB + 1, 11) and not timed_growth_flagged(0.0, 3.75 * MIB, 11)
    assert not timed_growth_flagged(None, None, 11)
    with pytest.raises(ValueError, match="per_step_bytes must be >= 0"):
        GrowthLimit(fixed_bytes=MIB, per_step_bytes=-1)


def test_every_honest_growth_measured_is_under_half_its_size_and_1_mib_a_step_over_10_timed_steps_above_it():
    for steps, highest in HONEST_TIMED_GROWTH_CPU_MIB.items():
        assert 2 * highest * MIB < timed_growth_flag_bytes("resident", steps), (steps, highest)
    assert 11 * MIB > timed_growth_flag_bytes("resident", 10 + 1)


def steps_of_a_rank(growth: TimedStepsGrowth, kept: list) -> None:
    """Two warm-up steps and ten timed ones, each making and freeing 40 MiB of tensors, as a step's activations are,
    and adding to `kept` what the rank holds on to."""
    for step in range(12):
        growth.before_step(step)
        scratch = [torch.ones(256, 1024) for _ in range(40)]
        del scratch
        kept.append(np.ones(MIB, dtype=np.uint8) if len(kept) < 12 else None)
        growth.after_step(step)


def test_a_rank_keeping_a_mebibyte_more_every_step_grows_by_as_many_mebibytes_as_steps_and_is_flagged():
    growth = TimedStepsGrowth(CPU, warmup_steps=2, timed_steps=10)
    kept: list = []
    steps_of_a_rank(growth, kept)
    # From the start of step 1 (the last warm-up step) to the end of step 11: 11 of the 12 MiB kept.
    assert growth.steps == 11 and not growth.unavailable_because
    assert 10.5 * MIB < growth.resident < 11.5 * MIB, growth.resident / MIB
    assert growth.flagged and growth.allocated is None


def test_memory_made_and_freed_in_every_step_is_no_growth():
    growth = TimedStepsGrowth(CPU, warmup_steps=2, timed_steps=10)
    steps_of_a_rank(growth, kept=[None] * 12)      # keeps nothing
    assert abs(growth.resident) < MIB, growth.resident / MIB
    assert not growth.flagged


def test_the_growth_needs_two_warm_up_steps_and_a_run_from_the_last_one():
    assert "warmup_steps >= 2" in TimedStepsGrowth(CPU, warmup_steps=1, timed_steps=10).unavailable_because
    resumed = TimedStepsGrowth(CPU, warmup_steps=2, timed_steps=3)
    for step in (2, 3, 4):        # a launch resumed at step 2, past the start
        resumed.before_step(step)
        resumed.after_step(step)
    assert resumed.resident is None and not resumed.flagged and resumed.unavailable_because


# ---- planted leaks --------------------------------------------------------------------------------------------


def test_a_leak_is_parsed_with_its_size_and_what_holds_it():
    leak = Fault.parse("leak:bytes=100MiB:in=numpy:rank=all:step=0")
    assert (leak.kind, leak.leak_bytes, leak.leak_in, leak.onward) == ("leak", 104_857_600, "numpy", False)
    each = Fault.parse("leak-per-step:bytes=1MiB:rank=1:step=2")
    assert (each.leak_bytes, each.leak_in, each.onward) == (1_048_576, "tensor", True)      # every step from 2
    assert Fault.parse("leak:bytes=3KiB:rank=0:step=0").leak_bytes == 3072
    assert Fault.parse("leak:bytes=4096:rank=0:step=0").leak_bytes == 4096
    for bad in ("leak:bytes=0:rank=0:step=0", "leak:bytes=1MB:rank=0:step=0", "leak:rank=0:step=0",
                "leak:bytes=1MiB:in=list:rank=0:step=0", "kill:bytes=1MiB:rank=0:step=0"):
        with pytest.raises(ValueError, match="PARBENCH_FAULT="):
            Fault.parse(bad)


def test_a_leak_holds_its_bytes_from_its_step_and_a_leak_per_step_in_every_step_after(monkeypatch):
    monkeypatch.setattr(faults, "LEAKED", [])
    once = Fault.parse("leak:bytes=3KiB:in=numpy:rank=1:step=2")
    for rank, step in ((0, 2), (1, 1), (1, 2), (1, 3)):
        once.in_step(rank, step, CPU)
    [held] = faults.LEAKED          # rank 1's step 2 alone
    assert isinstance(held, np.ndarray) and held.nbytes == 3072 and held.min() == 1     # written: resident
    monkeypatch.setattr(faults, "LEAKED", [])
    each = Fault.parse("leak-per-step:bytes=2KiB:rank=all:step=1")
    for step in range(4):
        each.in_step(0, step, CPU)
    assert [type(t) for t in faults.LEAKED] == [torch.Tensor] * 3                         # steps 1, 2 and 3
    assert all(t.numel() == 2048 and t.dtype == torch.uint8 and int(t.min()) == 1 for t in faults.LEAKED)


# ---- what a reader sees: rows.csv's columns, the lines ------------------------------------------------------------


def row(repeat: int = 0, gap: tuple = (10 * MIB,), gap_flagged: bool = False, growth: tuple | None = (0.5 * MIB,),
        growth_flagged: bool = False, status: str = "ok") -> dict:
    """An ok row of the plain loop with the two readings: gaps (limit 48 MiB), growths (limit 6 MiB over 11 steps)."""
    m = {"memory_outside_census_bytes_by_rank": list(gap), "memory_outside_census_flag_bytes": 48 * MIB,
         "memory_outside_census_flagged": gap_flagged}
    if growth is not None:
        m.update({"memory_growth_timed_steps_bytes_by_rank": list(growth),
                  "memory_growth_timed_steps_flag_bytes": 6 * MIB, "memory_growth_timed_steps_flagged": growth_flagged,
                  "memory_growth_steps": 11})
    return {"spec": {"workload": "gpt-tiny", "strategy": "plain", "world_size": 1, "global_batch": 16,
                     "micro_batch": 4, "precision": "fp32", "device": "cpu", "timed_steps": 10},
            "repeat": repeat, "status": status, "measurements": m}


def test_rows_csv_columns_say_whether_a_launch_was_flagged_and_by_how_much():
    flagged = flag_columns(row(gap=(110 * MIB, 9 * MIB), gap_flagged=True)["measurements"])
    assert flagged["memory_flagged"] is True
    assert flagged["memory_outside_census_bytes_max"] == 110 * MIB
    assert flagged["memory_outside_census_flag_bytes"] == 48 * MIB
    assert (flagged["memory_growth_timed_steps_bytes_max"], flagged["memory_growth_timed_steps_flagged"]) == (
        0.5 * MIB, False)
    assert flag_columns(row()["measurements"])["memory_flagged"] is False
    # A row from before the readings, or a failed launch's: nothing to say, not "not flagged".
    assert flag_columns({})["memory_flagged"] is None


def test_a_flagged_launch_is_one_line_naming_its_ranks_figures_and_sizes():
    gap = row(gap=(110 * MIB, 9 * MIB), gap_flagged=True)
    assert flag_lines([gap]) == [
        f"{PLAIN} r0: rank 0 held 110.0 MiB outside the model-state census at the last warm-up step (the resident "
        "growth since the model was built, less the census; flagged above 48.0 MiB). Flagged, not failed: the row "
        "stays ok (docs/methodology.md, 'Memory outside the census')."]
    # 11 x 1 MiB over the last warm-up step and 10 timed steps on rank 1; rank 0's 0.2 MiB is not above 6 MiB.
    grew = row(repeat=2, growth=(0.2 * MIB, 11 * MIB), growth_flagged=True)
    assert flag_lines([row(), grew]) == [
        f"{PLAIN} r2: on rank 1, resident memory (RssAnon) grew by 11.0 MiB over the last warm-up step and 10 timed "
        "steps, 1.0 MiB a step (flagged above 6.0 MiB). Flagged, not failed: the row stays ok (docs/methodology.md, "
        "'Memory outside the census')."]
    both = row(gap=(110 * MIB, 107.5 * MIB), gap_flagged=True, growth=(12.1 * MIB, 11 * MIB), growth_flagged=True)
    assert flag_lines([both])[0].startswith(
        f"{PLAIN} r0: ranks 0, 1 held 110.0, 107.5 MiB outside the model-state census at the last warm-up step (the "
        "resident growth since the model was built, less the census; flagged above 48.0 MiB); on ranks 0, 1, "
        "resident memory (RssAnon) grew by 12.1, 11.0 MiB over the last warm-up step and 10 timed steps, 1.1, 1.0 MiB "
        "a step (flagged above 6.0 MiB). Flagged, not failed")


def test_the_reports_section_names_the_flagged_launches_or_says_none_was_and_is_absent_without_readings():
    assert verdict_lines([row(), row(repeat=1)]) == [
        "None flagged: 2 launches read, each rank's memory beyond its model-state census at the last warm-up step and "
        "its growth over the timed steps below the sizes their ranks were judged against (docs/methodology.md, "
        "'Memory outside the census')."]
    lines = verdict_lines([row(), row(repeat=1, gap=(110 * MIB,), gap_flagged=True)])
    assert lines[0] == ("Flagged: 1 of 2 launches held memory outside their model states above the sizes their ranks "
                        "were judged against.")
    assert lines[1].startswith(f"{PLAIN} r1: rank 0 held 110.0 MiB")
    assert verdict_lines([{**row(), "measurements": {}}]) == []        # rows written before the readings
    assert verdict_lines([row(gap_flagged=True, status="failed")]) == []


def test_report_md_opens_its_verdicts_on_the_flagged_launches():
    text = markdown_report(pd.DataFrame(), [], [Path("rows.jsonl")], raw_rows=[row(gap=(110 * MIB,), gap_flagged=True)])
    verdicts = text.split("## Verdicts\n\n", 1)[1]
    assert verdicts.startswith(f"### {SECTION}\n\n- Flagged: 1 of 1 launch held memory outside their model states")
    assert f"- {PLAIN} r0: rank 0 held 110.0 MiB" in verdicts


# ---- real launches: the plain loop with a leak planted, and without ----------------------------------------------


def run_plain(tmp_path: Path, capsys, monkeypatch, fault: str | None, timed_steps: int) -> tuple[int, str, dict, str]:
    """`harness run` of the plain loop on gpt-tiny (2 warm-up steps, `timed_steps` timed), then `harness report`:
    (exit status, the console, the launch's rows.csv line, report.md)."""
    if fault:
        monkeypatch.setenv("PARBENCH_FAULT", fault)
    else:
        monkeypatch.delenv("PARBENCH_FAULT", raising=False)
    out = tmp_path / "rows.jsonl"
    code = main(["run", "--matrix", "smoke", "--device", "cpu", "--workload", "gpt-tiny", "--strategy", "plain",
                 "--warmup-steps", "2", "--timed-steps", str(timed_steps), "--out", str(out)])
    console = capsys.readouterr().out
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    with open(tmp_path / "report" / "rows.csv", newline="") as handle:
        [line] = csv.DictReader(handle)
    return code, console, line, (tmp_path / "report" / "report.md").read_text()


@pytest.mark.launch
def test_a_100_mib_numpy_leak_held_from_the_warm_up_is_flagged_where_a_reader_looks(tmp_path, capsys, monkeypatch):
    # No tensor: only the resident growth can see it. The plain loop's honest gap is 6-14 MiB (its size: 45.5 MiB).
    code, console, line, report = run_plain(tmp_path, capsys, monkeypatch,
                                            "leak:bytes=100MiB:in=numpy:rank=all:step=0", timed_steps=3)
    assert code == 0                                        # flagged, not failed
    assert line["status"] == "ok" and line["memory_flagged"] == "True"
    assert line["memory_outside_census_flagged"] == "True"
    assert float(line["memory_outside_census_bytes_max"]) > 100 * MIB
    assert line["memory_growth_timed_steps_flagged"] == "False"      # held before the growth's start
    [flagged] = [text for text in console.splitlines() if text.startswith("MEMORY FLAGGED: ")]
    assert flagged.startswith(f"MEMORY FLAGGED: {PLAIN} r0: rank 0 held ")
    assert "outside the model-state census at the last warm-up step" in flagged and "the row stays ok" in flagged
    assert f"### {SECTION}\n\n- Flagged: 1 of 1 launch held memory outside their model states" in report
    assert f"- {PLAIN} r0: rank 0 held " in report


@pytest.mark.launch
def test_a_leak_of_1_mib_a_step_over_10_timed_steps_is_flagged_by_the_growth(tmp_path, capsys, monkeypatch):
    # From step 0: 11 MiB over the last warm-up step and 10 timed steps; 2 MiB by the gap's reading, far under its size.
    code, console, line, report = run_plain(tmp_path, capsys, monkeypatch, "leak-per-step:bytes=1MiB:rank=all:step=0",
                                            timed_steps=10)
    assert code == 0 and line["status"] == "ok" and line["memory_flagged"] == "True"
    assert line["memory_growth_timed_steps_flagged"] == "True"
    assert line["memory_outside_census_flagged"] == "False"
    assert 10.5 * MIB < float(line["memory_growth_timed_steps_bytes_max"]) < 12 * MIB
    [flagged] = [text for text in console.splitlines() if text.startswith("MEMORY FLAGGED: ")]
    assert flagged.startswith(f"MEMORY FLAGGED: {PLAIN} r0: on rank 0, resident memory (RssAnon) grew by ")
    assert "over the last warm-up step and 10 timed steps" in flagged
    assert f"- {PLAIN} r0: on rank 0, resident memory (RssAnon) grew by " in report


@pytest.mark.launch
def test_an_honest_cell_is_flagged_nowhere_and_the_report_says_so(tmp_path, capsys, monkeypatch):
    code, console, line, report = run_plain(tmp_path, capsys, monkeypatch, None, timed_steps=10)
    assert code == 0 and line["status"] == "ok"
    assert (line["memory_flagged"], line["memory_outside_census_flagged"],
            line["memory_growth_timed_steps_flagged"]) == ("False", "False", "False")
    assert "MEMORY FLAGGED" not in console
    assert f"### {SECTION}\n\n- None flagged: 1 launch read" in report
