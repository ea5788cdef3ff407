"""The exact gates (harness.derive.expectations, `harness expect`): each figure of a cell that does not depend on
the machine, held to an expectation, one line per difference naming the cell and the figure; the losses to
parity's tolerance; versions as part of the key. Rows here are written out by hand."""

import copy
import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.derive.expectations import (DIFFERENT, SAME, VERSIONS_CHANGED, ExpectationsError, check, dumps, figures,
                                         load, record)
from harness.matrix import Machine, build_matrix
from harness.spec import DeviceKind

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "reference" / "ci-expectations"
VERSIONS = {"python": "3.11.7", "torch": "2.13.0+cpu", "deepspeed": "0.19.8", "horovod": "0.28.1", "cuda": None,
            "cudnn": None, "nccl": None}
DDP = "gpt-tiny/ddp/ws2/gb16/mb4/fp32/cpu"
PLAIN = "gpt-tiny/plain/ws1/gb16/mb4/fp32/cpu"
LLAMA_PLAIN = "llama-tiny/plain/ws1/gb16/mb4/fp32/cpu"
LOSSES = [6.0, 5.9, 5.7, 5.6, 5.5]      # the plain loop's: its largest move over steps 0-3 is 0.2 (5.9 -> 5.7)


def all_reduce(size: float, calls: float = 1.0, group: str = "2", dtype: str = "float32") -> dict:
    return {"bytes": size, "calls": calls, "dtypes": {dtype: {"bytes": size, "element_bytes": 4}},
            "bytes_by_group_size": {group: size}}


def row(strategy: str = "ddp", world_size: int = 2, **measured) -> dict:
    """A row as harness.record writes it, of a 1,000-parameter model: fp32 weights and gradients (4,000 bytes
    each), AdamW's moments and a 4-byte step for each of 2 tensors (8,008 bytes), two 4-byte losses outside the
    census, no memory flagged outside it; DDP all-reduces the gradients."""
    ranks = range(world_size)
    measurements = {
        "loss_per_step": list(LOSSES), "parameters": 1000, "data_parallel": world_size,
        "parameters_held_by_rank": [1000 for _ in ranks], "weights_kept_whole_parameters_by_rank": [0 for _ in ranks],
        "model_state_census_bytes_by_rank": [{"weights": 4000, "gradients": 4000, "optimizer": 8008} for _ in ranks],
        "untracked_tensor_bytes_by_rank": [8 for _ in ranks], "memory_outside_census_flagged": False,
        "comm_per_step_by_rank": [{"all_reduce": all_reduce(4000.0)} if world_size > 1 else {} for _ in ranks],
    }
    measurements.update(measured)
    return {"schema_version": 2, "run_id": f"{strategy}-{world_size}", "status": "ok", "message": "",
            "spec": {"workload": "gpt-tiny", "strategy": strategy, "world_size": world_size, "global_batch": 16,
                     "micro_batch": 4, "precision": "fp32", "warmup_steps": 2, "timed_steps": 3, "seed": 0,
                     "device": "cpu", "nnodes": 1, "options": {}},
            "measurements": measurements, "environment": {**VERSIONS, "env": {}}}


def honest() -> list[dict]:
    return [row("plain", 1), row("ddp", 2)]


def expected() -> dict:
    return record(honest())


def differences(rows) -> list[str]:
    return list(check(rows, expected()).differences)


def test_a_rows_figures_are_its_counts_census_parameters_verdict_and_first_losses():
    # A pipeline-like rank 0: an all-reduce of 3,000 bytes among 1 rank (its stage's own copy: nothing on the
    # wire) and of 1,000 among 2 (ring: 2 x (2 - 1) / 2 x 1,000 = 1,000 sent), a send of 500 (500 sent) and a
    # recv of 500 (received, not in its total): 1,500 wire bytes per step.
    counted = {"all_reduce": {"bytes": 4000.0, "calls": 2.0, "dtypes": {"float32": {"bytes": 4000.0, "element_bytes": 4}},
                              "bytes_by_group_size": {"1": 3000.0, "2": 1000.0}},
               "send": all_reduce(500.0, calls=4.0), "recv": all_reduce(500.0, calls=4.0)}
    pipeline = row("pipeline", 2, comm_per_step_by_rank=[counted], model_state_census_bytes_by_rank=[
        {"weights": 2000, "gradients": None, "optimizer": 4004}], parameters_held_by_rank=[500],
        weights_kept_whole_parameters_by_rank=[0], untracked_tensor_bytes_by_rank=[4008])
    assert figures(pipeline, "match") == {
        "status": "ok", "warm-up steps": 2, "timed steps": 3, "seed": 0, "parameters": 1000, "parity verdict": "match",
        "losses of steps 0-3": [6.0, 5.9, 5.7, 5.6],
        "parameters held on rank 0": 500, "parameters kept whole on rank 0": 0,
        "census bytes of weights on rank 0": 2000, "census bytes of gradients on rank 0": None,
        "census bytes of optimizer on rank 0": 4004,
        "untracked tensor bytes on rank 0": 4008, "memory outside the census flagged": False,
        "all_reduce calls per step on rank 0": 2, "all_reduce bytes per step on rank 0": 4000,
        "all_reduce bytes per step in groups of 1 on rank 0": 3000,
        "all_reduce bytes per step in groups of 2 on rank 0": 1000, "all_reduce bytes per step in float32 on rank 0": 4000,
        "send calls per step on rank 0": 4, "send bytes per step on rank 0": 500,
        "send bytes per step in groups of 2 on rank 0": 500, "send bytes per step in float32 on rank 0": 500,
        "recv calls per step on rank 0": 4, "recv bytes per step on rank 0": 500,
        "recv bytes per step in groups of 2 on rank 0": 500, "recv bytes per step in float32 on rank 0": 500,
        "wire bytes per step on rank 0": 1500}


def test_honest_rows_meet_their_own_expectations():
    outcome = check(honest(), expected())
    assert outcome.exit_status == SAME and outcome.differences == ()
    assert outcome.lines("UPDATE") == [f"2 cells, {outcome.figures} figures: as expected"]


def with_rank0(**change) -> dict:
    """The DDP row with rank 0's comm, census, parameters or tensors outside the census changed, or its flag."""
    changed = row()
    m = changed["measurements"]
    if "comm" in change:
        m["comm_per_step_by_rank"][0] = {"all_reduce": change["comm"]}
    if "census" in change:
        m["model_state_census_bytes_by_rank"][0] = change["census"]
    if "held" in change:
        m["parameters_held_by_rank"][0] = change["held"]
    if "untracked" in change:
        m["untracked_tensor_bytes_by_rank"][0] = change["untracked"]
    if "flagged" in change:
        m["memory_outside_census_flagged"] = change["flagged"]
    return changed


@pytest.mark.parametrize("planted, lines", [
    # One extra all-reduce call of no bytes: the calls alone.
    (with_rank0(comm=all_reduce(4000.0, calls=2.0)), ["all_reduce calls per step on rank 0 1 -> 2"]),
    # An extra all-reduce of 96 bytes: calls, bytes (whole, by group, by dtype) and the wire bytes.
    (with_rank0(comm=all_reduce(4096.0, calls=2.0)),
     ["all_reduce bytes per step in float32 on rank 0 4000 -> 4096",
      "all_reduce bytes per step in groups of 2 on rank 0 4000 -> 4096", "all_reduce bytes per step on rank 0 4000 -> 4096",
      "all_reduce calls per step on rank 0 1 -> 2", "wire bytes per step on rank 0 4000 -> 4096"]),
    # The same bytes among 1 rank instead of 2: nothing on the wire.
    (with_rank0(comm=all_reduce(4000.0, group="1")),
     ["all_reduce bytes per step in groups of 1 on rank 0 absent -> 4000",
      "all_reduce bytes per step in groups of 2 on rank 0 4000 -> absent", "wire bytes per step on rank 0 4000 -> 0"]),
    # Reduced in bf16 instead of fp32, as the dtype's bytes say (the same byte count planted to isolate it).
    (with_rank0(comm=all_reduce(4000.0, dtype="bfloat16")),
     ["all_reduce bytes per step in bfloat16 on rank 0 absent -> 4000",
      "all_reduce bytes per step in float32 on rank 0 4000 -> absent"]),
    # An fp32 copy of the weights kept in the optimizer's state: 4 bytes x 1,000 more.
    (with_rank0(census={"weights": 4000, "gradients": 4000, "optimizer": 12008}),
     ["census bytes of optimizer on rank 0 8008 -> 12008"]),
    (with_rank0(held=500), ["parameters held on rank 0 1000 -> 500"]),
    # The same copy kept outside the optimizer's state: the census as it was, 4,000 bytes more outside it.
    (with_rank0(untracked=4008), ["untracked tensor bytes on rank 0 8 -> 4008"]),
    (with_rank0(flagged=True), ["memory outside the census flagged false -> true"]),
])
def test_each_changed_figure_is_one_line_naming_the_cell_and_the_figure(planted, lines):
    assert differences([row("plain", 1), planted]) == [f"{DDP}: {line} (expected -> measured)" for line in lines]


def test_losses_within_parity_tolerance_pass_and_beyond_it_name_the_step():
    # fp32: step 0 within 1e-6 of its loss (6e-6 here), steps 1-3 within 1e-3 of the largest move, 0.2: 2e-4.
    near = row("plain", 1, loss_per_step=[6.0 + 5e-6, 5.9, 5.7 + 1e-4, 5.6, 9.9])   # step 4 is not compared
    assert check([near], record([row("plain", 1)])).differences == ()
    far = row("plain", 1, loss_per_step=[6.0, 5.9, 5.7 + 5e-4, 5.6, 5.5])
    [line] = check([far], record([row("plain", 1)])).differences
    assert line == (f"{PLAIN}: losses of steps 0-3: step 2 5.7 -> 5.7005 (2.5 parity tolerances off) "
                    "(expected -> measured)")
    first = row("plain", 1, loss_per_step=[6.0 * (1 + 2e-6)] + LOSSES[1:])
    [line] = check([first], record([row("plain", 1)])).differences
    assert "step 0 6 -> 6.000012 (2 parity tolerances off)" in line
    short = row("plain", 1, loss_per_step=LOSSES[:2])
    assert check([short], record([row("plain", 1)])).differences == (
        f"{PLAIN}: losses of steps 0-3: 4 -> 2 steps (expected -> measured)",)


def test_a_learning_rate_change_is_a_loss_line_and_a_parity_mismatch():
    # One update further along at step 1 (5.9 -> 5.8): half the largest move, 500 tolerances.
    planted = row(loss_per_step=[6.0, 5.8, 5.7, 5.6, 5.5])
    assert differences([row("plain", 1), planted]) == [
        f"{DDP}: losses of steps 0-3: step 1 5.9 -> 5.8 (500 parity tolerances off) (expected -> measured)",
        f'{DDP}: parity verdict "match" -> "mismatch" (expected -> measured)']


def test_a_cell_that_stops_running_is_one_status_line_with_its_message():
    failed = {**row(), "status": "failed", "message": "rank 1: RuntimeError: boom", "measurements": {}}
    assert differences([row("plain", 1), failed]) == [
        f"{DDP}: status ok -> failed (rank 1: RuntimeError: boom) (expected -> measured)"]


def test_a_cell_missing_from_the_rows_or_from_the_expectations_is_a_difference():
    assert differences([row("plain", 1)]) == [f"{DDP}: expected, but no row of this cell among the rows read"]
    extra = row("zero2", 2)
    assert differences(honest() + [extra]) == [
        "gpt-tiny/zero2/ws2/gb16/mb4/fp32/cpu: no expectation recorded for this cell (a new cell? re-record them)"]


def test_other_versions_are_reported_as_an_upgrade_with_exit_3_not_as_a_regression():
    upgraded = honest()
    for each in upgraded:
        each["environment"]["torch"] = "2.14.0+cpu"
    outcome = check(upgraded, expected())
    assert outcome.exit_status == VERSIONS_CHANGED and outcome.differences == ()
    assert outcome.lines("CMD") == ["versions changed: torch 2.13.0+cpu -> 2.14.0+cpu; the expectations were recorded "
                                    "under the old ones: every figure is as recorded; re-record them: CMD"]
    upgraded[1]["measurements"]["parameters"] = 999
    outcome = check(upgraded, expected())
    assert outcome.exit_status == VERSIONS_CHANGED
    head, line = outcome.lines("CMD")
    assert "1 difference(s) below are what the upgrade changed, not regressions" in head
    assert line == f"  under the new versions: {DDP}: parameters 1000 -> 999 (expected -> measured)"
    same_versions = honest()
    same_versions[1]["measurements"]["parameters"] = 999
    assert check(same_versions, expected()).exit_status == DIFFERENT


def test_rows_of_different_versions_are_refused():
    mixed = honest()
    mixed[1]["environment"]["deepspeed"] = "0.19.9"
    with pytest.raises(ExpectationsError, match="deepspeed 0.19.8 and 0.19.9"):
        check(mixed, expected())


def test_recording_refuses_a_planted_fault_a_failed_cell_and_repeats_that_disagree():
    faulty = honest()
    faulty[1]["environment"]["env"] = {"PARBENCH_FAULT": "lr-scale:factor=2:rank=all:step=0"}
    with pytest.raises(ExpectationsError, match="PARBENCH_FAULT=lr-scale"):
        record(faulty)
    failed = honest() + [{**row(), "status": "timeout", "message": "all ranks killed", "measurements": {}}]
    with pytest.raises(ExpectationsError, match="timeout"):
        record(failed)
    again = row()
    again["measurements"]["model_state_census_bytes_by_rank"][1]["optimizer"] = 9000
    with pytest.raises(ExpectationsError, match="launches disagree .*census bytes of optimizer on rank 1"):
        record(honest() + [again])
    assert record(honest() + [row()]) == expected()          # a repeat that agrees is the same cell
    skipped = {**row("dataparallel", 2), "status": "skipped", "message": "DataParallel replicates over CUDA devices only",
               "measurements": {}}
    assert record(honest() + [skipped])["cells"]["gpt-tiny/dataparallel/ws2/gb16/mb4/fp32/cpu"] == {"status": "skipped"}


def test_the_file_has_sorted_keys_one_figure_per_line_and_reads_back(tmp_path):
    text = dumps(expected())
    data = json.loads(text)
    assert list(data) == sorted(data) and list(data["cells"][DDP]) == sorted(data["cells"][DDP])
    lines = text.splitlines()
    assert '   "all_reduce calls per step on rank 0": 1,' in lines
    assert "    6.0," in lines                                    # a loss per line
    path = tmp_path / "ci.json"
    path.write_text(text)
    assert load(path) == expected()
    assert data["versions"] == VERSIONS


@pytest.mark.parametrize("content, fragment", [
    (None, "no such expectations file; record one with --write"),
    ("{not json", "not an expectations file"),
    ('{"format": 1, "cells": []}', "format, versions and cells"),
])
def test_a_bad_expectations_file_is_a_one_line_error(tmp_path, content, fragment):
    path = tmp_path / "ci.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ExpectationsError) as error:
        load(path)
    assert len(str(error.value).splitlines()) == 1 and fragment in str(error.value)


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(each) + "\n" for each in rows))
    return path


def test_the_command_records_checks_and_exits_0_1_3_or_2(tmp_path, capsys):
    rows = write_rows(tmp_path / "rows.jsonl", honest())
    against = tmp_path / "expectations" / "ci.json"
    assert main(["expect", str(rows), "--against", str(against)]) == 2
    assert capsys.readouterr().err.strip() == (f"parbench: error: {against}: no such expectations file; record one "
                                               "with --write")
    assert main(["expect", str(rows), "--against", str(against), "--write"]) == 0
    assert json.loads(against.read_text()) == expected()
    capsys.readouterr()
    assert main(["expect", str(rows), "--against", str(against)]) == 0
    assert capsys.readouterr().out.strip().endswith("figures: as expected")

    planted = with_rank0(comm=all_reduce(4000.0, calls=2.0))
    assert main(["expect", str(write_rows(tmp_path / "planted.jsonl", [row("plain", 1), planted])),
                 "--against", str(against)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{DDP}: all_reduce calls per step on rank 0 1 -> 2 (expected -> measured)"
    assert out[1].endswith(f"re-record them: python -m harness expect {tmp_path / 'planted.jsonl'} --against "
                           f"{against} --write")

    upgraded = honest()
    upgraded[0]["environment"]["python"] = upgraded[1]["environment"]["python"] = "3.12.1"
    assert main(["expect", str(write_rows(tmp_path / "new.jsonl", upgraded)), "--against", str(against)]) == 3
    assert capsys.readouterr().out.startswith("versions changed: python 3.11.7 -> 3.12.1;")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["expect", str(empty), "--against", str(against)]) == 2
    assert capsys.readouterr().err.strip() == f"parbench: error: {empty} holds no cell rows: nothing to hold to expectations"


# ---- the committed expectations --------------------------------------------------------------------------

TWO_CORES = Machine(device=DeviceKind.CPU, devices_per_node=2)


@pytest.mark.parametrize("matrix", ["ci"])       # the smoke matrix's 2 cells are two of ci's, at more steps
def test_the_committed_expectations_hold_every_cell_of_their_matrix_on_cpu(matrix):
    committed = load(COMMITTED / f"{matrix}.json")
    assert set(committed["cells"]) == {spec.label for spec in build_matrix(matrix, TWO_CORES)}
    # Recorded where every library ran: a cell skipped for a missing one would be expected to stay skipped.
    assert all(committed["versions"][name] for name in ("python", "torch", "deepspeed", "horovod"))
    assert {spec.label: "skipped" for spec in build_matrix(matrix, TWO_CORES) if spec.strategy == "dataparallel"} == {
        name: cell["status"] for name, cell in committed["cells"].items() if cell["status"] != "ok"}
    assert dumps(committed) == (COMMITTED / f"{matrix}.json").read_text()     # as --write lays it out


def test_the_committed_ci_figures_agree_with_the_model_by_hand():
    cells = load(COMMITTED / "ci.json")["cells"]
    parameters = 236_928                       # gpt-tiny (workloads/gpt.py), 52 tensors
    plain, ddp = cells[PLAIN], cells[DDP]
    assert plain["parameters"] == ddp["parameters"] == parameters
    # fp32 weights and gradients, AdamW's two fp32 moments and a 4-byte step per tensor.
    assert (plain["census bytes of weights on rank 0"], plain["census bytes of gradients on rank 0"],
            plain["census bytes of optimizer on rank 0"]) == (4 * parameters, 4 * parameters, 8 * parameters + 4 * 52)
    # DDP all-reduces every fp32 gradient once per step (one 25 MB bucket holds them all); a ring all-reduce
    # among 2 ranks sends 2 x (2 - 1) / 2 of it.
    for rank in (0, 1):
        assert ddp[f"all_reduce calls per step on rank {rank}"] == 1
        assert ddp[f"all_reduce bytes per step on rank {rank}"] == 4 * parameters
        assert ddp[f"wire bytes per step on rank {rank}"] == 4 * parameters
    # Horovod all-reduces each of the 52 gradients on its own (its fusion happens below the counted calls).
    assert cells["gpt-tiny/horovod/ws2/gb16/mb4/fp32/cpu"]["all_reduce calls per step on rank 0"] == 52
    assert {cell["parity verdict"] for name, cell in cells.items() if name not in (PLAIN, LLAMA_PLAIN)
            and cell["status"] == "ok"} == {"match"}
    # llama-tiny (tests/test_llama_cells.py works its count by hand): fp32 weights and gradients on the plain loop.
    llama = cells[LLAMA_PLAIN]
    assert llama["parameters"] == 262_720 and llama["parity verdict"] == "reference"
    assert llama["census bytes of weights on rank 0"] == llama["census bytes of gradients on rank 0"] == 4 * 262_720
    assert cells["gpt-tiny/dataparallel/ws2/gb16/mb4/fp32/cpu"] == {"status": "skipped"}


def test_the_fault_variable_recording_refuses_is_the_one_faults_are_planted_with():
    from harness.derive.expectations import FAULT_VARIABLE
    from harness.rank.faults import FAULT_ENV

    assert FAULT_VARIABLE == FAULT_ENV


def _strategies_by_workload(cells) -> dict[str, set[str]]:
    """{workload: strategies} of cell keys such as 'gpt-tiny/autotp[tp=2]/ws2/gb16/mb4/fp32/cpu'."""
    found: dict[str, set[str]] = {}
    for key in cells:
        workload, strategy = key.split("/")[:2]
        found.setdefault(workload, set()).add(strategy.split("[")[0])
    return found


def test_the_streams_the_exact_tier_reads_launch_the_ci_matrix_cells_and_no_others():
    # .ci/run's exact tier holds every row of these streams to the committed expectations: a strategy the streams
    # run that the ci matrix leaves out (a new one that skips gpt-tiny, as expert parallelism does) fails CI as
    # 'no expectation recorded', and one the matrix has that they leave out goes unjudged.
    from conftest import GPT_TINY, LLAMA_TINY

    streamed: dict[str, set[str]] = {}
    for stream in (*GPT_TINY, LLAMA_TINY):
        flags = dict(zip(stream.selection[::2], stream.selection[1::2]))
        streamed.setdefault(flags["--workload"], set()).update(flags["--strategy"].split(","))
    ci = _strategies_by_workload(f"{s.workload}/{s.strategy}" for s in build_matrix("ci", Machine(device=DeviceKind.CPU,
                                                                                              devices_per_node=2)))
    assert streamed == ci
    assert _strategies_by_workload(load(COMMITTED / "ci.json")["cells"]) == ci
