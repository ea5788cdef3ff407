"""Emulated nodes share one machine's cores (issue 33, finding 11): a cell's host load counts every rank on the
machine, its namespaces included, and the report says the figures are an emulation's. The rows of `run
--emulate-nodes 8 --world-sizes 8` are written here as 260bf91's ranks recorded them (each rank alone on its
namespace: ranks_on_host 1), so the committed rows and rows of that parbench are marked too."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import main
from harness.derive.cells import cell_table, launch_table
from harness.derive.rows import load_rows
from harness.report.verdicts import verdicts

RENO = Path(__file__).resolve().parents[1] / "results" / "reference" / "emulated-reno" / "cells.jsonl"
NETWORK = {"nodes": 8, "link_rate_bits_per_s": 100e6, "shaper": "tc tbf", "tcp_congestion_control": "reno",
           "addresses": [f"10.78.3.{n + 1}" for n in range(8)], "shared_machine_cores": 2}


def _row(strategy: str, world_size: int, step_s: float) -> dict:
    nnodes = world_size      # one rank per emulated node, as --emulate-nodes 8 places world size 8
    return {"schema_version": 2, "run_id": f"{strategy}-{world_size}", "cell_id": "spec-only", "repeat": 0,
            "status": "ok", "message": "",
            "spec": {"workload": "gpt-tiny", "strategy": strategy, "world_size": world_size, "global_batch": 64,
                     "micro_batch": 4, "precision": "fp32", "warmup_steps": 1, "timed_steps": 3, "seed": 0,
                     "device": "cpu", "nnodes": nnodes, "options": {}},
            "environment": {"cpu_model": "AMD EPYC", "cpu_count": 2, "gpus": [], "emulated_network": NETWORK},
            "measurements": {"step_time_s": [step_s] * 3, "host_stalled_step_indices": [],
                             "loss_per_step": [6.0, 5.9, 5.8, 5.7], "shared_device": False,
                             "ranks_on_host_by_rank": [1] * world_size, "threads_by_rank": [1] * world_size,
                             "host_cpu_cores_by_rank": [2] * world_size}}


ROWS = [_row("plain", 1, 0.2), _row("ddp", 1, 0.2), _row("ddp", 8, 2.0)]
# 8 ranks x 1 thread = 8 rank threads on the machine's 2 cores: 4 to a core.
EIGHT = "oversubscribed: 8 ranks x 1 thread on 2 cores (8 emulated nodes, one machine)"


def test_eight_ranks_on_eight_emulated_nodes_are_oversubscribed_in_the_row_the_table_and_the_verdicts():
    [launch] = launch_table(ROWS).query("world_size == 8").to_dict("records")
    assert launch["host_oversubscribed"] is True and launch["host_load"] == EIGHT
    [cell] = cell_table(ROWS).query("world_size == 8").to_dict("records")
    assert cell["host_oversubscribed"] is True and cell["host_load"] == EIGHT
    [group] = [g for g in verdicts(cell_table(ROWS)).groups if g.heading.startswith("gpt-tiny at 8 ranks")]
    assert group.lines[0].startswith("Measured on an emulation: 8 nodes that are network namespaces of one "
                                     "machine, whose 2 cores all their ranks share")
    assert "not a scaling result of 8 nodes" in group.lines[0]
    assert any(line.startswith("The ranks outnumbered the machine's cores for ddp:") for line in group.lines)


def test_one_rank_alone_on_an_emulated_node_of_two_cores_is_not_oversubscribed():
    [cell] = cell_table(ROWS).query("strategy == 'plain'").to_dict("records")
    assert cell["host_oversubscribed"] is False and cell["host_load"] == "1 rank x 1 thread on 2 cores"


def test_the_committed_reno_rows_count_every_rank_on_the_machine():
    cells = cell_table(load_rows([RENO]))
    four = cells.query("strategy == 'ddp' and world_size == 4").iloc[0]
    two = cells.query("strategy == 'ddp' and world_size == 2").iloc[0]
    # 2 ranks on each of 2 namespaces: 4 rank threads on the machine's 2 cores; 1 on each: 2 on 2.
    assert four["host_load"] == "oversubscribed: 4 ranks x 1 thread on 2 cores (2 emulated nodes, one machine)"
    assert not two["host_oversubscribed"] and two["host_load"].startswith("2 ranks x 1 thread on 2 cores")


def test_a_rank_counts_the_cell_s_ranks_on_its_machine_by_its_kernel_s_boot_id():
    from harness.rank.facts import host_load_figures

    loads = [{"ranks": 1, "threads": 1, "cores": 2, "machine": machine} for machine in ("a", "a", "a", "b")]
    figures = host_load_figures(loads)
    assert figures["ranks_on_machine_by_rank"] == [3, 3, 3, 1] and figures["ranks_on_host_by_rank"] == [1] * 4


def test_a_recorded_machine_count_is_what_the_load_is_judged_on():
    row = _row("ddp", 4, 1.0)
    row["environment"] = {"cpu_model": "AMD EPYC", "cpu_count": 2}       # no emulation: containers, say
    row["measurements"]["ranks_on_machine_by_rank"] = [4] * 4
    [cell] = cell_table([row]).to_dict("records")
    assert cell["host_load"] == "oversubscribed: 4 ranks x 1 thread on 2 cores"


def test_run_warns_before_launching_eight_ranks_on_eight_emulated_nodes_of_two_cores(capsys):
    assert main(["run", "--matrix", "full", "--workload", "gpt-tiny", "--strategy", "ddp", "--world-sizes", "8",
                 "--emulate-link", "100mbit", "--emulate-nodes", "8", "--cpus-per-node", "2", "--dry-run"]) == 0
    [warning] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("parbench: warning:")]
    assert "more rank threads on this machine than its 2 core(s), up to 8" in warning
    assert "8 rank(s) on its nodes together x 1 thread(s)" in warning
