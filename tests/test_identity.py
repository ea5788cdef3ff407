"""A cell's identity includes the conditions it was measured under (issue 33, finding 1): the committed
reno rows (results/reference/emulated-reno/cells.jsonl: 19 specs, each launched 3 times at each of 4 link
rates) read as 76 cells everywhere rows are grouped: the cell table, compare, resume, the launch folders and
the projection. Expected figures are read from the raw rows by hand, never from the code under test. (The
tests of what 260bf91 got wrong use only what it had, so that they fail there on their assertions.)"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from statistics import median

import pytest

from harness import runner
from harness.cli import main
from harness.derive.cells import cell_table
from harness.derive.gate import gate
from harness.derive.rows import load_rows
from harness.emulate.network import EmulatedNetwork
from harness.launch.placement import PLACEMENTS, EmulatedPlacement
from harness.project.facts import REGISTRY_FACTS
from harness.project.projection import bases_from_rows
from harness.record import append_row, read_results
from harness.runner import RunOptions, run_specs
from harness.spec import RunResult, RunSpec, Status

RENO = Path(__file__).resolve().parents[1] / "results" / "reference" / "emulated-reno"
RATES = (50e6, 100e6, 200e6, 1000e6)


@pytest.fixture(scope="module")
def reno_rows():
    return load_rows([RENO / "cells.jsonl"])


def _rate(row) -> float:
    return row["environment"]["emulated_network"]["link_rate_bits_per_s"]


def _is(row, strategy, world_size, rate) -> bool:
    return (row["spec"]["strategy"] == strategy and row["spec"]["world_size"] == world_size
            and _rate(row) == rate)


def test_the_reno_rows_are_76_cells_in_the_cell_table_19_at_each_rate(reno_rows):
    # Written by one parbench: every row stored the same 19 spec-only cell ids across the 4 rates.
    assert len({row["cell_id"] for row in reno_rows}) == 19 and len(reno_rows) == 228
    cells = cell_table(reno_rows)
    assert len(cells) == 76
    for rate in RATES:
        tag = f"@{rate / 1e6:g}Mbit/s"
        assert sum(cells["label"].str.endswith(tag)) == 19, tag
    # DDP at 2 ranks, 50 Mbit/s: its own 3 launches, not 12 launches of 4 rates.
    ddp = [row for row in reno_rows if _is(row, "ddp", 2, 50e6)]
    [line] = cells[cells["label"] == "gpt-tiny/ddp/ws2x2nodes/gb32/mb4/fp32/cpu@50Mbit/s"].to_dict("records")
    assert line["launches"] == len(ddp) == 3
    assert line["step_time_median_s"] == pytest.approx(median(median(r["measurements"]["step_time_s"]) for r in ddp))
    assert line["step_time_median_s"] > 0.2      # the 50 Mbit/s cell's 207 ms, not the 4 rates' 116 ms


def test_scaling_efficiency_takes_its_world_size_1_reference_at_the_cell_s_own_rate(reno_rows):
    cells = cell_table(reno_rows).set_index("label")
    for rate in (50e6, 1000e6):
        tag = f"@{rate / 1e6:g}Mbit/s"
        # E_strong(2) = X(2) / (2 X(1)), X = global batch / step: both cells' medians at this rate only.
        two = cells.loc[f"gpt-tiny/ddp/ws2x2nodes/gb32/mb4/fp32/cpu{tag}"]
        one = cells.loc[f"gpt-tiny/ddp/ws1/gb32/mb4/fp32/cpu{tag}"]
        assert two["strong_efficiency_vs_ws1"] == pytest.approx(two["samples_per_s"] / (2 * one["samples_per_s"]))


def test_compare_never_matches_launches_measured_at_another_rate(reno_rows):
    at_50 = [row for row in reno_rows if _rate(row) == 50e6]
    result = gate(at_50, reno_rows)
    # The 19 cells at 50 Mbit/s meet their own 3 launches on both sides; the other 57 are not compared.
    assert {len(j.new) for j in result.judgements} == {3} and {len(j.base) for j in result.judgements} == {3}
    assert {j.label.rsplit("@", 1)[1] for j in result.judgements} == {"50Mbit/s"}
    assert len({j.label for j in result.judgements}) == 19
    assert len(result.not_compared) == 57
    assert all("no launch on the base side" in why and "link_rate_bits_per_s" in why
               for _, why in result.not_compared)


def test_resume_relaunches_a_cell_recorded_only_at_another_rate(tmp_path, monkeypatch):
    spec = RunSpec(workload="gpt-tiny", strategy="ddp", world_size=2, global_batch=16, micro_batch=4, nnodes=2)
    out = tmp_path / "rows.jsonl"
    launched = []

    def launch(spec, *, repeat, cell_dir, environment, **kwargs):
        launched.append((environment["emulated_network"]["link_rate_bits_per_s"], cell_dir))
        return RunResult(spec=spec, status=Status.OK, run_id=uuid.uuid4().hex, repeat=repeat,
                         environment=environment, artifacts_dir=str(cell_dir))

    monkeypatch.setattr(runner, "run_cell", launch)
    monkeypatch.setattr(runner, "capture_environment", lambda freeze_dir: {"cpu_model": "test", "cpu_count": 2})

    def run_at(rate: str) -> None:
        network = EmulatedNetwork.planned(rate)
        run_specs([spec], RunOptions(results=out, resume=True, placement=EmulatedPlacement.of(network),
                                     emulated_network=network.record()))

    run_at("50mbit")
    run_at("100mbit")          # recorded at 50 Mbit/s only: another cell, launched
    run_at("100mbit")          # recorded now: not launched again
    assert [rate for rate, _ in launched] == [50e6, 100e6]
    # Each rate's launch has its own folder: a second rate no longer overwrites the first one's logs.
    assert launched[0][1] != launched[1][1] and launched[1][1].name.startswith("gpt-tiny_ddp_ws2x2nodes")
    assert "100Mbit_s" in launched[1][1].name
    assert [row.environment["emulated_network"]["link_rate_bits_per_s"] for row in read_results([out])] == [50e6, 100e6]


def test_resuming_the_reno_file_at_one_of_its_rates_reuses_that_rate_s_57_launches_alone(tmp_path, monkeypatch,
                                                                                         reno_rows):
    out = tmp_path / "cells.jsonl"
    out.write_text((RENO / "cells.jsonl").read_text())
    specs = list({row["cell_id"]: RunSpec.from_dict(row["spec"]) for row in reno_rows}.values())
    assert len(specs) == 19 and {spec.repeats for spec in specs} == {3}
    launched, plans = [], []
    monkeypatch.setattr(runner, "run_cell", lambda spec, *, repeat, **kwargs: launched.append(spec) or RunResult(
        spec=spec, status=Status.FAILED, message="not launched in a test", run_id=uuid.uuid4().hex, repeat=repeat))
    # The machine the reno rows were measured on (environment.cpu_model, cpu_count and gpus of every row).
    monkeypatch.setattr(runner, "capture_environment",
                        lambda freeze_dir: {"cpu_model": "AMD EPYC", "cpu_count": 2, "gpus": []})
    for rate in ("100mbit", "400mbit"):
        network = EmulatedNetwork.planned(rate)
        run_specs(specs, RunOptions(results=out, resume=True, placement=EmulatedPlacement.of(network),
                                    emulated_network=network.record()), on_plan=plans.append)
    # At 100 Mbit/s the file holds every launch (19 cells x 3); at 400 Mbit/s, which it never ran, none.
    assert [(plan.recorded, plan.launches) for plan in plans] == [(57, 0), (0, 57)]
    assert len(launched) == 57


def test_the_projection_takes_one_basis_per_strategy_and_rate(reno_rows):
    bases, skipped = bases_from_rows(reno_rows, REGISTRY_FACTS)
    # 6 data-parallel strategies x 4 rates (the plain loop has nothing to project).
    assert len(bases) == 24
    by_run = {row["run_id"]: row for row in reno_rows}
    for basis in bases:
        rates = {_rate(by_run[run_id]) for run_id in basis.run_ids}
        assert len(rates) == 1 and basis.label.endswith(f"@{rates.pop() / 1e6:g}Mbit/s")
    [ddp] = [b for b in bases if b.strategy == "ddp" and b.label.endswith("@50Mbit/s")]
    # Its schedule and overlap come from DDP's 3 launches at 2 ranks and 50 Mbit/s alone: its 4 ranks shared
    # the machine's 2 cores (8 namespaces' ranks counted on one machine), which measures their sharing.
    assert {by_run[run_id]["run_id"] for run_id in ddp.run_ids} == \
        {row["run_id"] for row in reno_rows if _is(row, "ddp", 2, 50e6)}
    assert "gpt-tiny/ddp@50Mbit/s: world size 4 left out of the basis: its ranks outnumbered their host's cores" \
        in "\n".join(skipped)


def test_project_refuses_rows_of_several_networks_against_one_network_s_comm_rows(tmp_path, capsys):
    comm = tmp_path / "comm-50.jsonl"
    comm.write_text("".join(line + "\n" for line in (RENO / "comm.jsonl").read_text().splitlines()
                            if json.loads(line)["environment"]["emulated_network"]["link_rate_bits_per_s"] == 50e6))
    assert main(["project", str(RENO / "cells.jsonl"), "--comm", str(comm), "--cluster", "dgx-h100-ib"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "4 networks" in err and "@1000Mbit/s" in err


def test_the_host_type_is_part_of_a_cell_and_its_name_is_not():
    from harness.derive.identity import identity_of

    spec = {"workload": "gpt-tiny", "strategy": "ddp", "world_size": 2, "repeats": 1, "nnodes": 1}
    vm = {"cpu_model": "AMD EPYC", "cpu_count": 2, "gpus": [], "host": "vm", "git_sha": "a"}
    # Another machine of the same kind, other software, another namespace subnet: the same cell.
    assert identity_of(spec, vm) == identity_of({**spec, "repeats": 3}, {**vm, "host": "ci-runner", "git_sha": "b"})
    for change in ({"cpu_model": "Intel(R) Xeon(R) Processor"}, {"cpu_count": 4}, {"gpus": ["NVIDIA H100"]},
                   {"placement": "slurm"}):
        assert identity_of(spec, vm) != identity_of(spec, {**vm, **change}), change
    network = {"nodes": 2, "link_rate_bits_per_s": 5e7, "tcp_congestion_control": "reno", "addresses": ["10.78.1.1"]}
    emulated = {**vm, "emulated_network": network}
    assert identity_of(spec, emulated) == identity_of(spec, {**vm, "emulated_network": {
        **network, "addresses": ["10.78.9.1"], "note": "another run"}})
    assert identity_of(spec, emulated) != identity_of(spec, {**vm, "emulated_network": {
        **network, "tcp_congestion_control": "bbr"}})


def test_placements_of_rows_that_did_not_record_one_are_inferred():
    from harness.derive.identity import EMULATED, LOCAL, MULTI_HOST_UNRECORDED, conditions_of

    assert {LOCAL, EMULATED} <= set(PLACEMENTS)
    assert conditions_of({"nnodes": 1}, {})["placement"] == LOCAL
    assert conditions_of({"nnodes": 2}, {"emulated_network": {"nodes": 2}})["placement"] == EMULATED
    assert conditions_of({"nnodes": 2}, {})["placement"] == MULTI_HOST_UNRECORDED


def test_a_row_stores_its_identity_and_readers_recompute_it(reno_rows):
    from harness.derive.identity import cell_identity

    spec = RunSpec(workload="gpt-tiny", strategy="plain", world_size=1, global_batch=16, micro_batch=4)
    row = RunResult(spec=spec, status=Status.OK, run_id="r", environment={"cpu_model": "x", "placement": "local"})
    assert row.to_dict()["cell_id"] == cell_identity(row.to_dict()) != spec.cell_id
    # Older rows stored the spec's alone: the reader's grouping never trusts it.
    renamed = [{**r, "cell_id": "stale"} for r in reno_rows[:6]]
    assert len(cell_table(renamed)) == len({cell_identity(r) for r in reno_rows[:6]})


def test_cells_of_one_spec_on_two_host_types_are_labelled_apart(reno_rows):
    row = next(r for r in reno_rows if _is(r, "plain", 1, 50e6))
    other = {**row, "run_id": "other", "environment": {**row["environment"], "cpu_model": "Intel(R) Xeon(R)"}}
    labels = sorted(cell_table([row, other])["label"])
    assert labels == ["gpt-tiny/plain/ws1/gb32/mb4/fp32/cpu@50Mbit/s [cpu_model=AMD EPYC]",
                      "gpt-tiny/plain/ws1/gb32/mb4/fp32/cpu@50Mbit/s [cpu_model=Intel(R) Xeon(R)]"]


def test_the_console_shows_every_label_whole_with_its_link_rate(reno_rows):
    # The longest reno label, "gpt-tiny/horovod/ws4x2nodes/gb32/mb4/fp32/cpu@1000Mbit/s", is 56 characters: a
    # column cut at 52 dropped the rate it ends with, and two rates' lines read alike.
    printed = runner.summary_table(reno_rows).splitlines()
    for rate in ("50", "100", "200", "1000"):
        lines = [line for line in printed if line.startswith("gpt-tiny/") and line.split()[0].endswith(f"@{rate}Mbit/s")]
        assert len(lines) == 19, (rate, len(lines))
