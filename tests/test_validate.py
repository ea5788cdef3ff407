"""harness.project.validate: hand-written rows of an emulated cluster, each multi-rank cell's prediction worked
out in the test from the alpha-beta ring formulas (Thakur, Rabenseifner and Gropp 2005), not copied from the
code; the ranking check and the bars tripped on purpose."""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.project.validate import validate
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


def _comm(rate=RATE):
    # A 2-rank ring all-reduce: 2(p-1) = 2 steps and 2(p-1)/p = 1 byte through a link per byte reduced.
    rows = [{"collective": "all_reduce", "size_bytes": n, "time_s": 2 * ALPHA + n * BETA}
            for n in (1e3, 1e4, 1e5, 1e6, 4e6)]
    return {"kind": COMMBENCH_KIND, "world_size": 2, "backend": "gloo", "device": "cpu", "rows": rows,
            "environment": {"emulated_network": {"link_rate_bits_per_s": rate}}}


def _by(result, strategy, world_size):
    [cell] = [c for c in result.cells if c.strategy == strategy and c.world_size == world_size]
    return cell


def test_each_cell_is_predicted_from_world_size_1_and_the_comm_rows_by_hand():
    rows = [_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.5), _cell("ddp", 4, 0.7)]
    result = validate(rows, [_comm()])
    # World size 2, strong scaling of the global batch 16: compute = the world-size-1 step (0.2 s, not its
    # compute-only 0.05 s) x 8/16 = 0.1 s; two ranks on the machine's 2 cores share nothing. Ring all-reduce
    # of 4 MB among 2: 2 alpha + 2 (1/2) 4 MB beta = 0.402 s, none overlapped beyond backward's bound
    # (0.402 - 2/3 x 0.1 < 0.402): step 0.502 s.
    ws2 = _by(result, "ddp", 2)
    assert ws2.compute_s == pytest.approx(0.1)
    assert ws2.predicted_s == pytest.approx(0.1 + 2 * ALPHA + GRADIENTS * BETA)
    assert ws2.error == pytest.approx(0.502 / 0.5 - 1)
    # World size 4: 0.2 x 4/16 = 0.05 s, time-sliced 4 ranks on 2 cores: x 2 = 0.1 s. Ring among 4:
    # 6 alpha + 2 (3/4) 4 MB beta = 0.606 s.
    ws4 = _by(result, "ddp", 4)
    assert ws4.compute_s == pytest.approx(0.1)
    assert ws4.predicted_s == pytest.approx(0.1 + 6 * ALPHA + 1.5 * GRADIENTS * BETA)
    assert ws4.predicted_s == pytest.approx(0.706)


def test_the_bars_and_the_ranking_can_fail():
    # Horovod is slower than DDP at world size 1 (0.3 s), so it is predicted slower at 2 ranks; measured
    # faster, the ranking of the two is reversed: tau = -1.
    rows = [_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.502), _cell("horovod", 1, 0.3), _cell("horovod", 2, 0.45)]
    reversed_ = validate(rows, [_comm()])
    assert reversed_.taus == {("80 Mbit/s", 2): pytest.approx(-1.0)}
    assert not reversed_.passes
    rows[-1] = _cell("horovod", 2, 0.552)                 # measured as predicted: 0.15 + 0.402
    agreeing = validate(rows, [_comm()])
    assert agreeing.taus[("80 Mbit/s", 2)] == pytest.approx(1.0)
    assert agreeing.median_abs_error == pytest.approx(0.0, abs=1e-9) and agreeing.passes
    rows[1] = _cell("ddp", 2, 0.502 / 1.25)               # 25% off: over the median bar
    assert not validate(rows, [_comm()]).passes


def test_settings_are_calibrated_apart_and_a_setting_without_comm_rows_is_named():
    fast = 8e9
    rows = [_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.5), _cell("ddp", 1, 0.2, rate=fast),
            _cell("ddp", 2, 0.5, rate=fast)]
    result = validate(rows, [_comm()])
    assert [c.setting for c in result.cells] == ["80 Mbit/s"]
    assert result.left_out == ("8000 Mbit/s: no `harness comm` rows of this setting to calibrate on",)


def test_validate_from_the_command_line_and_its_bad_input(tmp_path, capsys):
    cells, comm = tmp_path / "cells.jsonl", tmp_path / "comm.jsonl"
    for row in (_cell("ddp", 1, 0.2), _cell("ddp", 2, 0.5)):
        append_line(cells, row)
    append_line(comm, _comm())
    assert main(["project", "--validate", str(cells), "--comm", str(comm)]) == 0
    printed = capsys.readouterr().out
    assert "80 Mbit/s      ddp        2 strong        500.0        502.0   +0.4%" in printed
    for argv, message in ((["project", "--validate", str(cells)], "--validate needs measured ROWS and the --comm"),
                          (["project", "--validate", str(cells), "--comm", str(comm), "--cluster", "aws-p5"],
                           "--cluster has no meaning")):
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error
    assert_one_line_error(lambda: validate([_cell("ddp", 2, 0.5)], [_comm()]), ["nothing to validate"])
