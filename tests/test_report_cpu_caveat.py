"""A CPU group's Fastest verdict carries the caveat that CPU cells prove the machinery, not the speed
(harness.report.verdicts.CPU_SPEED_CAVEAT); a GPU group's does not."""

from __future__ import annotations

import copy

import pytest

from harness.derive.cells import cell_table
from harness.report.verdicts import CPU_SPEED_CAVEAT, verdicts


def rows(device: str) -> list[dict]:
    """Hand-made ok rows of two strategies at one rank: ddp's 10 timed steps of 10 ms, plain's of 12 ms."""
    template = {"status": "ok", "message": "", "measurements": {"loss_per_step": [1.0] * 13},
                "spec": {"workload": "gpt-tiny", "world_size": 1, "global_batch": 16, "micro_batch": 4,
                         "precision": "fp32", "seed": 0, "device": device, "warmup_steps": 3, "timed_steps": 10,
                         "nnodes": 1, "options": {}}}
    found = []
    for index, (strategy, step_s) in enumerate((("ddp", 0.010), ("plain", 0.012))):
        row = copy.deepcopy(template)
        row["spec"]["strategy"], row["run_id"], row["repeat"] = strategy, f"{strategy}-{index}", 0
        row["measurements"]["step_time_s"] = [step_s] * 10
        found.append(row)
    return found


def fastest_line(device: str) -> str:
    [group] = verdicts(cell_table(rows(device))).groups
    [line] = [line for line in group.lines if line.startswith("Fastest:")]
    return line


def test_the_cpu_verdict_says_cpu_cells_prove_the_machinery_not_the_speed():
    line = fastest_line("cpu")
    # 16 samples / 10 ms = 1600 samples/s against 16 / 12 ms = 1333: 20% more.
    assert line.startswith("Fastest: ddp, 1600 samples/s, 20.0% more samples/s than plain")
    assert line.endswith(f"; {CPU_SPEED_CAVEAT}.")
    assert "prove the machinery, not the speed" in CPU_SPEED_CAVEAT


@pytest.mark.parametrize("device", ["cuda"])
def test_a_gpu_verdict_has_no_cpu_caveat(device):
    line = fastest_line(device)
    assert line.startswith("Fastest: ddp, 1600 samples/s") and CPU_SPEED_CAVEAT not in line
