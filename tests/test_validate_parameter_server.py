"""The projection's validation of the parameter server (harness.project.validate): its layouts kept apart in the
table, compared at the same number of workers, its dedicated servers left out of the cores that compute, and its
asynchronous cells measured, not predicted. Worked out by hand."""

from __future__ import annotations

from harness.project.projection import Scaling
from harness.project.validate import Checked, Validation, markdown_table, shared_cores_factor


def _checked(strategy, options, world_size, workers, error):
    return Checked(setting="80 Mbit/s", strategy=strategy, label=strategy, world_size=world_size,
                   source_world_size=2, scaling=Scaling.STRONG, measured_s=1.0, predicted_s=1.0 + error,
                   compute_s=0.5, exposed_s=0.5 + error, exposed_fraction=1.0, options=options, workers=workers)


def test_each_layout_is_a_column_of_its_own_at_its_number_of_workers():
    cells = (_checked("ddp", "", 4, 0, 0.10), _checked("ps", "placement=colocated", 4, 0, -0.20),
             _checked("ps", "placement=dedicated,servers=2", 6, 4, 0.05))
    header, _, line = markdown_table(Validation(cells=cells, taus={}, left_out=())).splitlines()
    # ps at 4 ranks colocated and at 6 ranks with 2 dedicated servers both have 4 workers: two columns, one row.
    assert header.startswith("| link | ddp | ps[placement=colocated] | ps[placement=dedicated,servers=2] | median |")
    assert "tau (4 workers)" in header
    # |errors| 0.10, 0.20, 0.05: median 0.10; p90 at position 0.9 x 2 = 1.8 of 0.05, 0.10, 0.20: 0.10 + 0.8 x 0.10.
    assert line.startswith("| 80 Mbit/s | +10% | -20% | +5% | 10.0% | 18.0% |")


def test_one_strategy_with_one_layout_keeps_its_bare_name_and_ranks():
    cells = (_checked("fsdp2-tp", "tp=2", 2, 0, 0.1), _checked("fsdp2-tp", "tp=2", 4, 0, -0.1))
    header = markdown_table(Validation(cells=cells, taus={}, left_out=())).splitlines()[0]
    assert header.startswith("| link | fsdp2-tp | median |") and "tau (2 / 4 ranks)" in header


def _row(world_size, workers, servers):
    return {"spec": {"world_size": world_size, "strategy": "ps"},
            "environment": {"emulated_network": {"shared_machine_cores": 2}},
            "measurements": {"threads_per_rank": 1,
                             "strategy_config": {"workers": workers, "servers_ranks": servers}}}


def test_a_dedicated_servers_rank_waits_on_its_link_and_shares_no_compute():
    # 4 workers and 1 server on 2 cores: 4 ranks compute, 4 / 2 = 2 (not 5 / 2); colocated at 4: 4 / 2 = 2;
    # 2 workers and 1 server: 2 / 2 = 1.
    assert shared_cores_factor(_row(5, [0, 1, 2, 3], [4]), 5) == 2.0
    assert shared_cores_factor(_row(4, [0, 1, 2, 3], [0, 1, 2, 3]), 4) == 2.0
    assert shared_cores_factor(_row(3, [0, 1], [2]), 3) == 1.0


def test_the_parameter_server_table_in_the_docs_is_the_committed_rows_validated():
    # The emulated run (scripts/validate-ps-projection.sh at 50, 200 and 1000 Mbit/s, 6 nodes, a rank on each): the
    # docs show what the committed rows give; ps-async's cells are measured and left out of the prediction.
    from pathlib import Path

    from harness.derive.rows import load_rows
    from harness.project.validate import validate
    from harness.record import COMMBENCH_KIND, read_rows
    from test_validate import _shown

    root = Path(__file__).parent.parent
    reference = root / "results" / "reference" / "emulated-ps"
    rows = load_rows([reference / "cells.jsonl"])
    result = validate(rows, read_rows([reference / "comm.jsonl"], kind=COMMBENCH_KIND))
    assert len(result.cells) == 3 * 8 and {cell.launches for cell in result.cells} == {2}
    assert sorted({(c.strategy, c.options) for c in result.cells}) == [
        ("ddp", ""), ("ps", "placement=colocated"), ("ps", "placement=dedicated,servers=1"),
        ("ps", "placement=dedicated,servers=2")]
    assert {c.ranks_working for c in result.cells} == {2, 4}
    assert len([note for note in result.left_out if "ps-async" in note and "asynchronous" in note]) == 3 * 2
    assert _shown((root / "docs" / "clusters.md").read_text(), "ps-validation-table") == markdown_table(result)
    clusters = " ".join((root / "docs" / "clusters.md").read_text().split())     # lines joined
    assert (f"Over the 24 cells the median |error| is {result.median_abs_error:.1%} and the p90 "
            f"{result.p90_abs_error:.1%}, against the baseline's {result.baseline_median_abs_error:.1%} and "
            f"{result.baseline_p90_abs_error:.1%}") in clusters
