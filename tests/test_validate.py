"""harness.project.validate: hand-written rows of an emulated cluster, each multi-rank cell's prediction worked
out in the test from the alpha-beta ring formulas (Thakur, Rabenseifner and Gropp 2005), not copied from the
code; the ranking check and the bars tripped on purpose."""

from __future__ import annotations

import numpy as np
import pytest

from harness.cli import main
from harness.project.projection import Scaling
from harness.project.validate import Checked, Design, Validation, term_errors, validate
from harness.record import COMMBENCH_KIND, append_line
from one_line import assert_one_line_error
from test_projection import _counted, _row

ALPHA, BETA = 1e-3, 1e-7                  # the emulated link: 1 ms a step, 10 MB/s
RATE = 80e6                               # the rate the rows record (bits/s); only its grouping matters here
GRADIENTS = 4e6                           # one all-reduce of 10**6 fp32 gradients per step


def _emulated(row, rate=RATE, cores=2):
    row["environment"] = {"emulated_network": {"link_rate_bits_per_s": rate, "shared_machine_cores": cores}}
    row["measurements"]["threads_per_rank"] = 1
    return row


def _cell(strategy, world_size, step_s, *, compute_only_s=0.05, rate=RATE):
    row = _row(strategy, world_size, _counted("all_reduce", GRADIENTS, 1, world_size), compute=compute_only_s,
               exposed=step_s - compute_only_s)
    row["run_id"] = f"{strategy}-{world_size}-{rate}"
    return _emulated(row, rate)


def _comm(rate=RATE, beta=BETA):
    # A 2-rank ring all-reduce: 2(p-1) = 2 steps and 2(p-1)/p = 1 byte through a link per byte reduced.
    rows = [{"collective": "all_reduce", "size_bytes": n, "time_s": 2 * ALPHA + n * beta}
            for n in (1e3, 1e4, 1e5, 1e6, 4e6)]
    return {"kind": COMMBENCH_KIND, "world_size": 2, "backend": "gloo", "device": "cpu", "rows": rows,
            "environment": {"emulated_network": {"link_rate_bits_per_s": rate}}}


def _by(result, strategy, world_size):
    [cell] = [c for c in result.cells if c.strategy == strategy and c.world_size == world_size]
    return cell


def test_each_cell_is_predicted_from_world_size_1_its_other_cell_and_the_comm_rows_by_hand():
    rows = [_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.4), _cell("ddp", 4, 0.7)]
    result = validate(rows, [_comm()])
    # Strong scaling of the global batch 16. Compute = the world-size-1 step (0.2 s, not its compute-only
    # 0.05 s) in proportion to the samples a rank runs, times max(1, N x 1 thread / 2 cores):
    # 0.1 s at 2 ranks (8 samples), 0.2 x 4/16 x 2 = 0.1 s at 4. Ring all-reduce of 4 MB:
    # among 2, 2 alpha + 2 (1/2) 4 MB beta = 0.402 s; among 4, 6 alpha + 2 (3/4) 4 MB beta = 0.606 s.
    comm2, comm4 = 2 * ALPHA + GRADIENTS * BETA, 6 * ALPHA + 1.5 * GRADIENTS * BETA
    assert (comm2, comm4) == (pytest.approx(0.402), pytest.approx(0.606))
    # World size 4 from the cell at 2: f = (0.4 - 0.1) / 0.402 = 0.746; exposed at 4 = max(f x 0.606,
    # 0.606 - 2/3 x 0.1) = 0.539 (backward's bound: more than f's share cannot hide behind 0.1 s).
    ws4 = _by(result, "ddp", 4)
    assert ws4.source_world_size == 2 and ws4.compute_s == pytest.approx(0.1)
    assert ws4.exposed_fraction == pytest.approx(0.3 / 0.402)
    assert ws4.predicted_s == pytest.approx(0.1 + comm4 - 2 / 3 * 0.1)
    # World size 2 from the cell at 4: f = (0.7 - 0.1) / 0.606 = 0.990, exposed at 2 = 0.990 x 0.402.
    ws2 = _by(result, "ddp", 2)
    assert ws2.predicted_s == pytest.approx(0.1 + 0.6 / 0.606 * comm2)
    assert ws2.error == pytest.approx(ws2.predicted_s / 0.4 - 1)


def test_a_cell_launched_three_times_is_one_cell_judged_on_its_median():
    # The rows of the test above, each cell launched three times around the same median: the world-size-1
    # cell at 0.15, 0.2 and 0.3 s (median 0.2), at 2 ranks 0.45, 0.35, 0.4 (median 0.4), at 4 ranks 0.7,
    # 0.6 and 0.9 (median 0.7, mean 0.733). Medians give the predictions worked out there; the first launch
    # or the mean would not.
    def launched(strategy, world_size, steps):
        rows = [_cell(strategy, world_size, step) for step in steps]
        for repeat, row in enumerate(rows):
            row["repeat"], row["run_id"] = repeat, f"{row['run_id']}-r{repeat}"
        return rows

    rows = [*launched("ddp", 1, (0.15, 0.2, 0.3)), *launched("ddp", 2, (0.45, 0.35, 0.4)),
            *launched("ddp", 4, (0.7, 0.6, 0.9))]
    result = validate(rows, [_comm()])
    assert [(c.world_size, c.launches) for c in result.cells] == [(2, 3), (4, 3)]
    comm2, comm4 = 2 * ALPHA + GRADIENTS * BETA, 6 * ALPHA + 1.5 * GRADIENTS * BETA
    ws4, ws2 = _by(result, "ddp", 4), _by(result, "ddp", 2)
    assert ws4.measured_s == pytest.approx(0.7) and ws2.measured_s == pytest.approx(0.4)
    assert ws4.predicted_s == pytest.approx(0.1 + comm4 - 2 / 3 * 0.1)
    assert ws2.predicted_s == pytest.approx(0.1 + 0.6 / 0.606 * comm2)


def test_a_reversed_ranking_is_tau_minus_one():
    # World size 1: Horovod 0.3 s, DDP 0.2 s. Worked out as above, DDP is predicted at 0.498 s (2 ranks) and
    # 0.639 s (4), Horovod at 0.581 s and 0.656 s from cells measured at 0.45 and 0.8 s: the same order.
    rows = [_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.4), _cell("ddp", 4, 0.7),
            _cell("horovod", 1, 0.3), _cell("horovod", 2, 0.45), _cell("horovod", 4, 0.8)]
    agreeing = validate(rows, [_comm()])
    assert _by(agreeing, "horovod", 2).predicted_s == pytest.approx(0.15 + 0.65 / 0.606 * 0.402)
    assert agreeing.taus == {("80 Mbit/s", 2): pytest.approx(1.0), ("80 Mbit/s", 4): pytest.approx(1.0)}
    # Horovod measured at 0.65 s at 4 ranks, faster than DDP's 0.7: predicted 0.656 s, slower than DDP's
    # 0.639; and from it, 0.15 + 0.5/0.606 x 0.402 = 0.482 s at 2 ranks, faster than DDP's 0.498 where
    # it was measured slower.
    rows[-1] = _cell("horovod", 4, 0.65)
    reversed_ = validate(rows, [_comm()])
    assert reversed_.taus == {("80 Mbit/s", 2): pytest.approx(-1.0), ("80 Mbit/s", 4): pytest.approx(-1.0)}
    assert not reversed_.passes


def _checked(error, world_size=2, strategy="ddp"):
    return Checked(setting="80 Mbit/s", strategy=strategy, label=strategy, world_size=world_size,
                   source_world_size=6 - world_size, scaling=Scaling.STRONG, measured_s=1.0, predicted_s=1.0 + error,
                   compute_s=0.5, exposed_s=0.5 + error, exposed_fraction=1.0)


def test_the_bars_by_hand():
    # |errors| 0.01 ... 0.10 and one 0.30, 11 in all: the median is the 6th smallest, 0.06; the p90 sits at
    # position 0.9 x (11 - 1) = 9 of the sorted values (numpy's linear rule), the 10th smallest: 0.10.
    errors = [0.01 * k * (-1) ** k for k in range(1, 11)] + [0.30]
    result = Validation(cells=tuple(_checked(e) for e in errors), taus={("80 Mbit/s", 2): 0.8}, left_out=())
    assert result.median_abs_error == pytest.approx(0.06)
    assert result.p90_abs_error == pytest.approx(0.10)
    assert result.passes
    assert not Validation(cells=result.cells, taus={("80 Mbit/s", 2): 0.79}, left_out=()).passes
    worse = Validation(cells=result.cells + (_checked(0.4), _checked(0.5)), taus=result.taus, left_out=())
    assert worse.p90_abs_error > 0.2 and not worse.passes


def test_settings_are_calibrated_apart_and_a_setting_without_comm_rows_is_named():
    fast = 8e9
    rows = [_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.4), _cell("ddp", 4, 0.7), _cell("ddp", 1, 0.2, rate=fast),
            _cell("ddp", 2, 0.5, rate=fast), _cell("ddp", 4, 0.5, rate=fast)]
    result = validate(rows, [_comm()])
    assert [c.setting for c in result.cells] == ["80 Mbit/s", "80 Mbit/s"]
    assert result.left_out == ("8000 Mbit/s: no `harness comm` rows of this setting to calibrate on",)


def test_validate_from_the_command_line_and_its_bad_input(tmp_path, capsys):
    cells, comm = tmp_path / "cells.jsonl", tmp_path / "comm.jsonl"
    for row in (_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.4), _cell("ddp", 4, 0.7)):
        append_line(cells, row)
    append_line(comm, _comm())
    assert main(["project", "--validate", str(cells), "--comm", str(comm)]) == 0
    printed = capsys.readouterr().out
    assert ("80 Mbit/s      ddp        4 2 ranks                strong         1       700.0        639.3   -8.7%   -42.9%"
            in printed), printed
    for argv, message in ((["project", "--validate", str(cells)], "--validate needs measured ROWS and the --comm"),
                          (["project", "--validate", str(cells), "--comm", str(comm), "--cluster", "aws-p5"],
                           "--cluster has no meaning")):
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error
    assert_one_line_error(lambda: validate([_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.5)], [_comm()]),
                          ["nothing to validate", "no other multi-rank cell"])


def _shown(text, marker):
    """The table a page shows between `<!-- marker: ... -->` and `<!-- /marker -->`."""
    return text.split(f"<!-- {marker}:", 1)[1].split("-->", 1)[1].split(f"<!-- /{marker} -->")[0].strip()


def test_the_interpolation_table_in_the_docs_is_the_committed_rows_validated():
    # The README and docs/clusters.md show the validation measured on the emulated cluster; this keeps it what the committed
    # rows give, so a change to the model shows up as a change to the documented table.
    from pathlib import Path

    from harness.derive.rows import load_rows
    from harness.project.validate import markdown_table
    from harness.record import read_rows

    root = Path(__file__).parent.parent
    clusters_doc = (root / "docs" / "clusters.md").read_text()
    # The run made after the model's last change, with the nodes' TCP on reno, each cell launched 3 times:
    # interpolation on the settings the model was developed against (the earlier runs under BBR beside it).
    reference = root / "results" / "reference" / "emulated-reno"
    cells = read_rows([reference / "cells.jsonl"])
    result = validate(load_rows([reference / "cells.jsonl"]),
                      read_rows([reference / "comm.jsonl"], kind=COMMBENCH_KIND))
    assert len(result.cells) == 48 and not result.left_out
    assert {cell.launches for cell in result.cells} == {3}
    assert {row["environment"]["emulated_network"]["tcp_congestion_control"] for row in cells} == {"reno"}
    # The docs say the bars are met on this run; so must the rows.
    assert result.passes and "is met" in clusters_doc
    for page in ("README.md", "docs/clusters.md"):
        text = (root / page).read_text()
        assert _shown(text, "validation-table") == markdown_table(result), page
        assert f"median |error| is {result.median_abs_error:.1%} and the p90 {result.p90_abs_error:.1%}" in text, page
    readme = (root / "README.md").read_text()
    assert (f"(baseline {result.baseline_median_abs_error:.1%}, {result.baseline_p90_abs_error:.1%}, tau down to\n"
            f"{min(result.baseline_taus.values()):.2f})") in readme
    # The earlier run under BBR, still quoted for what changed.
    earlier = root / "results" / "reference" / "emulated-repeats"
    bbr = validate(load_rows([earlier / "cells.jsonl"]), read_rows([earlier / "comm.jsonl"], kind=COMMBENCH_KIND))
    assert f"`emulated-repeats` gives median {bbr.median_abs_error:.1%}, p90 {bbr.p90_abs_error:.1%}" in clusters_doc


def test_the_extrapolation_table_in_the_docs_is_the_frozen_commit_s_rows_validated():
    # Issue 33: 8 ranks on 8 emulated nodes from cells at <= 2 ranks, and each link rate from the other, run once
    # from a clean commit after the model was frozen, at a rate (400 Mbit/s) never used while it was written.
    from pathlib import Path
    from statistics import median

    from harness.derive.rows import load_rows
    from harness.project.validate import markdown_table
    from harness.record import read_rows

    root = Path(__file__).parent.parent
    reference = root / "results" / "reference" / "extrapolation"
    rows = load_rows([reference / "cells.jsonl"])
    comm = read_rows([reference / "comm.jsonl"], kind=COMMBENCH_KIND)
    # Every row from one clean commit, every launch ok, 3 launches of each of 19 cells at each of 2 rates.
    assert len(rows) == 114 and {row["status"] for row in rows} == {"ok"}
    assert {(row["environment"]["git_sha"], row["environment"]["git_dirty"]) for row in rows + comm} == \
        {("7ad29f23ce539f50f73ed575c08dae4cddb1af8f", False)}
    networks = {(row["environment"]["emulated_network"]["link_rate_bits_per_s"],
                 row["environment"]["emulated_network"]["nodes"]) for row in rows + comm}
    assert networks == {(100e6, 8), (400e6, 8)}
    assert {row["spec"]["world_size"] for row in rows} == {1, 2, 8}
    larger, across = (validate(rows, comm, design=Design.LARGER), validate(rows, comm, design=Design.ACROSS_SETTINGS))
    assert (len(larger.cells), len(across.cells)) == (12, 24) and not larger.left_out and not across.left_out
    assert {(c.world_size, c.source_world_size) for c in larger.cells} == {(8, 2)}
    both = larger.cells + across.cells
    errors = sorted(abs(c.error) for c in both)
    copied = sorted(abs(c.baseline_error) for c in both)
    figures = (f"median |error| is {np.median(errors):.1%} and the p90 {np.percentile(errors, 90):.1%} (baseline "
               f"{np.median(copied):.1%}, {np.percentile(copied, 90):.1%}")
    # The table in docs/clusters.md, its figures in both (the README's front page has no room for the table).
    assert _shown((root / "docs/clusters.md").read_text(), "extrapolation-table") == markdown_table(larger, across)
    for page in ("README.md", "docs/clusters.md"):
        assert figures in (root / page).read_text().replace("\n", " "), page
    # Eight ranks on eight emulated nodes of this 2-core machine: each row counts them on one machine, and
    # the cell table and the verdicts say they took turns on its cores (issue 33, finding 11).
    from harness.derive.cells import cell_table
    from harness.report.verdicts import verdicts

    assert {tuple(r["measurements"]["ranks_on_machine_by_rank"]) for r in rows if r["spec"]["world_size"] == 8} \
        == {(8,) * 8}
    cells = cell_table(rows)
    assert set(cells[cells["world_size"] == 8]["host_oversubscribed"]) == {True}
    assert set(cells[cells["world_size"] == 2]["host_oversubscribed"]) == {False}
    assert set(cells[cells["world_size"] == 8]["host_load"]) == \
        {"oversubscribed: 8 ranks x 1 thread on 2 cores (8 emulated nodes, one machine)"}
    at_8 = [group for group in verdicts(cells).groups if group.heading.startswith("gpt-tiny at 8 ranks")]
    assert len(at_8) == 2 and all("not a scaling result of 8 nodes" in group.lines[0] for group in at_8)
    # The miss the pages explain: FSDP2's 8-rank step barely moves with the link.
    def step(rate):
        launches = [r for r in rows if r["spec"]["strategy"] == "fsdp2" and r["spec"]["world_size"] == 8
                    and r["environment"]["emulated_network"]["link_rate_bits_per_s"] == rate]
        return median(median(r["measurements"]["step_time_s"]) for r in launches)
    assert (round(step(100e6) * 1e3, 1), round(step(400e6) * 1e3, 1)) == (686.7, 658.7)


# ---- the baseline, and the designs that extrapolate (issue 33) ---------------------------------------------


def test_the_baseline_copies_the_source_cells_measured_step_by_hand():
    rows = [_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.4), _cell("ddp", 4, 0.7),
            _cell("horovod", 1, 0.3), _cell("horovod", 2, 0.45), _cell("horovod", 4, 0.65)]
    result = validate(rows, [_comm()])
    # Each cell's baseline is its source cell's measured step: 4 ranks from 2 and 2 from 4.
    ddp4, ddp2 = _by(result, "ddp", 4), _by(result, "ddp", 2)
    assert ddp4.baseline_s == pytest.approx(0.4) and ddp4.baseline_error == pytest.approx(0.4 / 0.7 - 1)
    assert ddp2.baseline_error == pytest.approx(0.7 / 0.4 - 1)
    # |errors| of the copies: ddp 3/7 = 0.4286 and 0.75, horovod 0.2/0.65 = 0.3077 and 0.2/0.45 = 0.4444;
    # median of four = (0.4286 + 0.4444) / 2.
    assert result.baseline_median_abs_error == pytest.approx((0.2 / 0.45 + 0.3 / 0.7) / 2)
    # The copies keep each world size's order of its source: at 2 ranks DDP (copied 0.7) below Horovod
    # (copied 0.65) where DDP was measured faster (0.4 < 0.45): tau -1; at 4 ranks copied 0.4 < 0.45 and
    # measured 0.7 > 0.65: tau -1.
    assert result.baseline_taus == {("80 Mbit/s", 2): pytest.approx(-1.0), ("80 Mbit/s", 4): pytest.approx(-1.0)}


def test_larger_predicts_8_ranks_from_2_and_never_from_a_larger_cell_by_hand():
    rows = [_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.4), _cell("ddp", 4, 0.7), _cell("ddp", 8, 1.0)]
    result = validate(rows, [_comm()], design=Design.LARGER)
    # Held out: the cells above 2 ranks, each from the 2-rank cell (never from 4 for 8, nor 8 for 4).
    assert sorted((c.world_size, c.source_world_size) for c in result.cells) == [(4, 2), (8, 2)]
    # At 8 ranks: compute = 0.2 s x (16 / 8) / 16 samples x max(1, 8 x 1 thread / 2 cores) = 0.1 s; the
    # ring all-reduce of 4 MB among 8: 2 x 7 alpha + 2 x (7/8) x 4 MB x beta = 0.014 + 0.7 = 0.714 s; f from
    # the 2-rank cell = (0.4 - 0.1) / 0.402; exposed = max(f x 0.714, 0.714 - 2/3 x 0.1) = 0.6473.
    comm8 = 14 * ALPHA + 2 * 7 / 8 * GRADIENTS * BETA
    assert comm8 == pytest.approx(0.714)
    ws8 = _by(result, "ddp", 8)
    assert ws8.compute_s == pytest.approx(0.1)
    assert ws8.predicted_s == pytest.approx(0.1 + comm8 - 2 / 3 * 0.1)
    assert ws8.baseline_s == pytest.approx(0.4)
    assert_one_line_error(lambda: validate(rows[:1] + rows[2:], [_comm()], design=Design.LARGER),
                          ["nothing to validate (larger)", "no multi-rank cell at or below 2 ranks"])
    assert_one_line_error(lambda: validate(rows, [_comm()], design=Design.LARGER, max_source_world_size=1),
                          ["largest source world size", ">= 2"])


def test_across_settings_takes_f_on_the_source_network_and_prices_on_the_target_by_hand():
    slow, fast = 80e6, 800e6
    rows = [_cell("ddp", 1, 0.2, rate=slow), _cell("ddp", 2, 0.4, rate=slow),
            _cell("ddp", 1, 0.21, rate=fast), _cell("ddp", 2, 0.15, rate=fast)]
    comm = [_comm(slow), _comm(fast, beta=BETA / 10)]
    result = validate(rows, comm, design=Design.ACROSS_SETTINGS)
    assert sorted((c.setting, c.source_setting) for c in result.cells) == [("80 Mbit/s", "800 Mbit/s"),
                                                                            ("800 Mbit/s", "80 Mbit/s")]
    [to_fast] = [c for c in result.cells if c.setting == "800 Mbit/s"]
    # From the slow network: compute from its world-size-1 step, 0.2 x 8/16 = 0.1 s; f against the slow
    # calibration, (0.4 - 0.1) / (2 alpha + 4 MB x beta) = 0.3 / 0.402. Priced on the fast one: 2 alpha +
    # 4 MB x beta / 10 = 0.042 s; exposed = max(f x 0.042, 0.042 - 2/3 x 0.1) = 0.3 / 0.402 x 0.042.
    assert to_fast.predicted_s == pytest.approx(0.1 + 0.3 / 0.402 * 0.042)
    assert to_fast.baseline_error == pytest.approx(0.4 / 0.15 - 1)
    assert to_fast.source == "2 ranks at 80 Mbit/s"
    # Pricing on the source's network instead would give 0.4 s; on the target's with f from it, 0.15 s.
    assert abs(to_fast.predicted_s - 0.4) > 0.1 and abs(to_fast.predicted_s - 0.15) > 0.01


def test_term_errors_split_an_error_into_compute_and_exposed_by_hand():
    rows = [_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.4), _cell("ddp", 4, 0.7)]
    ws4 = _by(validate(rows, [_comm()]), "ddp", 4)
    # The compute rule carries the world-size-1 compute-only pass (0.05 s at 16 samples) to 4 ranks:
    # 0.05 x 4/16 x max(1, 4/2) = 0.025 s, where the cell's own pass took 0.05: r_c = -0.5. The model's
    # compute (0.1 s, from the world-size-1 step) corrected: 0.1 / 0.5 = 0.2 s, leaving 0.7 - 0.2 = 0.5 s
    # of exposed time to predict, against the 0.606 - 2/3 x 0.1 = 0.5393 s predicted.
    assert ws4.rule_compute_s == pytest.approx(0.025) and ws4.measured_compute_s == pytest.approx(0.05)
    terms = term_errors([ws4])
    assert terms["compute"] == pytest.approx(-0.5)
    assert terms["beyond compute"] == pytest.approx((0.606 - 0.2 / 3) / 0.5 - 1)


def test_design_from_the_command_line_and_its_bad_input(tmp_path, capsys):
    cells, comm = tmp_path / "cells.jsonl", tmp_path / "comm.jsonl"
    for row in (_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.4), _cell("ddp", 8, 1.0)):
        append_line(cells, row)
    append_line(comm, _comm())
    assert main(["project", "--validate", "--design", "larger", str(cells), "--comm", str(comm)]) == 0
    printed = capsys.readouterr().out
    assert "(larger)" in printed and "baseline (the source cell's step copied): median |error| 60.0%" in printed
    for argv, message in ((["project", "--validate", "--design", "bigger", str(cells), "--comm", str(comm)],
                           "--design 'bigger' is not one of: interpolate, larger, across-settings"),
                          (["project", "--design", "larger", str(cells), "--comm", str(comm)],
                           "--design chooses how --validate predicts")):
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error


def test_world_size_1_launches_at_another_batch_do_not_move_the_prediction():
    # The rows of the first test, and DDP at world size 1 measured again at global batch 8, the 2-rank cell's
    # samples per rank, at exactly half the work (0.1 s step, 0.025 s compute-only). The basis takes its
    # compute from the launches at the same samples per rank (0.1 s, unscaled), the compute rule from their
    # compute-only pass (0.025 x 1 at 2 ranks, 0.025 x 4/8 x 2 = 0.025 at 4): the same figures as from the
    # batch-16 cell alone (0.2 x 8/16; 0.05 x 8/16 and 0.05 x 4/16 x 2), not a mixture of the two batches.
    half = _row("ddp", 1, _counted("all_reduce", GRADIENTS, 1, 1), compute=0.025, exposed=0.075, global_batch=8)
    half = _emulated(half)
    half["run_id"] = "ddp-1-half"
    rows = [_cell("ddp", 1, 0.2), half, _cell("ddp", 2, 0.4), _cell("ddp", 4, 0.7)]
    alone = validate([rows[0], *rows[2:]], [_comm()])
    both = validate(rows, [_comm()])
    for n in (2, 4):
        assert _by(both, "ddp", n).predicted_s == pytest.approx(_by(alone, "ddp", n).predicted_s)
        assert _by(both, "ddp", n).rule_compute_s == pytest.approx(0.025)
