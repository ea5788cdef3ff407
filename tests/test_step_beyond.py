"""One name per figure of the step beyond a baseline (issue 33, finding 3): exposed communication (beyond the
compute-only pass, >= 2 ranks), the framework's overhead (the same at 1 rank, where nothing is communicated)
and the step beyond the strategy's own world-size-1 step (what the projection starts from). Figures by hand
from raw step times, on made-up rows and on the committed ones."""

import json
import statistics
from pathlib import Path

import pytest

from harness.derive.beyond_ws1 import step_beyond_ws1
from harness.derive.cells import cell_table
from harness.derive.rows import load_rows
from harness.project.facts import REGISTRY_FACTS
from harness.project.projection import bases_from_rows
from harness.project.validate import network_key, calibrations_by_network, setting_of
from harness.record import COMMBENCH_KIND, read_rows
from harness.runner import summary_table

RESULTS = Path(__file__).resolve().parent.parent / "results" / "reference"
FULL = RESULTS / "ci-cpu" / "full.jsonl"
RENO = RESULTS / "emulated-reno"


def _row(strategy, world_size, steps, *, global_batch=16, stalled=(), run="", rate=None, cores=(2,)):
    ranks = world_size
    measurements = {"step_time_s": list(steps), "host_stalled_step_indices": list(stalled),
                    "loss_per_step": [6.0, 5.9], "shared_device": False,
                    "ranks_on_host_by_rank": [ranks] * ranks, "threads_by_rank": [1] * ranks,
                    "host_cpu_cores_by_rank": list(cores) * ranks}
    environment = {"emulated_network": {"link_rate_bits_per_s": rate}} if rate else {}
    return {"schema_version": 2, "run_id": f"{strategy}-{world_size}-{global_batch}-{run}", "repeat": 0,
            "cell_id": f"{strategy}-{world_size}-{global_batch}-{rate}", "status": "ok", "message": "",
            "spec": {"workload": "w", "strategy": strategy, "world_size": world_size, "global_batch": global_batch,
                     "micro_batch": 4, "precision": "fp32", "warmup_steps": 1, "timed_steps": len(steps), "seed": 0,
                     "device": "cpu", "nnodes": 1, "options": {}},
            "measurements": measurements, "environment": environment}


def test_the_step_beyond_the_world_size_1_step_by_hand():
    # ZeRO-3 at 1 rank: 200 ms for 16 samples; at 2 ranks 150 ms (step 1, 900 ms, host-stalled, left out)
    # for 8 samples a rank. Its own step for 8 samples: 200 x 8 / 16 = 100 ms; beyond it 50 ms, 1/3 of 150.
    one = _row("zero3", 1, [0.2, 0.21, 0.19])
    two = _row("zero3", 2, [0.15, 0.9, 0.14, 0.16], stalled=[1])
    found = step_beyond_ws1([two], [one, two])
    assert found["step_beyond_ws1_s"] == pytest.approx(0.05)
    assert found["step_beyond_ws1_share"] == pytest.approx(0.05 / 0.15)
    assert "200 ms at 16 samples, scaled to 8 samples per rank: 100 ms" in found["step_beyond_ws1_note"]


def test_a_world_size_1_cell_at_the_same_samples_per_rank_is_preferred_unscaled():
    # Beside the 16-sample one, a world-size-1 cell of 8 samples at 110 ms: the same work per rank as the
    # 2-rank cell's, so no scaling: 150 - 110 = 40 ms.
    rows = [_row("zero3", 1, [0.2]), _row("zero3", 1, [0.11], global_batch=8), _row("zero3", 2, [0.15])]
    found = step_beyond_ws1([rows[2]], rows)
    assert found["step_beyond_ws1_s"] == pytest.approx(0.04) and "scaled" not in found["step_beyond_ws1_note"]


def test_the_world_size_1_step_is_taken_from_the_same_network_setting():
    # Emulated rows: each link rate has its own world-size-1 launches (the namespaces, the time of day).
    rows = [_row("ddp", 1, [0.2], rate=1e9), _row("ddp", 1, [0.3], rate=1e8), _row("ddp", 2, [0.125], rate=1e9)]
    assert step_beyond_ws1([rows[2]], rows)["step_beyond_ws1_s"] == pytest.approx(0.025)


def test_no_world_size_1_cell_or_an_oversubscribed_host_gives_no_figure_and_says_why():
    two = _row("zero3", 2, [0.15])
    assert step_beyond_ws1([two], [two])["step_beyond_ws1_share"] is None
    assert "no ok world-size-1 cell" in step_beyond_ws1([two], [two])["step_beyond_ws1_note"]
    rows = [_row("zero3", 1, [0.2]), _row("zero3", 2, [0.15], cores=(1,))]
    [line] = cell_table(rows)[lambda c: c["world_size"] == 2].to_dict("records")
    assert line["host_oversubscribed"] and line["step_beyond_ws1_share"] is None
    assert "outnumbered" in line["step_beyond_ws1_note"]


def test_at_world_size_1_the_figure_is_the_framework_s_overhead_not_exposed_communication():
    # Issue 33, finding 3: the console's `exposed` column showed ZeRO-3 at 1 rank at 67% (full.jsonl): its
    # own work beyond the compute-only pass, with nothing communicated. By hand: 1 - compute / step.
    rows = [json.loads(line) for line in FULL.read_text().splitlines()]
    [zero3] = [r for r in rows if r["spec"]["strategy"] == "zero3" and r["spec"]["world_size"] == 1]
    m = zero3["measurements"]
    assert not m["host_stalled_step_indices"]
    overhead = 1 - statistics.median(m["compute_only_step_time_s"]) / statistics.median(m["step_time_s"])
    assert overhead > 0.5
    cells = cell_table(rows).set_index("label")
    line = cells.loc["gpt-tiny/zero3/ws1/gb16/mb4/fp32/cpu"]
    assert line["exposed_comm_share"] is None or line["exposed_comm_share"] != line["exposed_comm_share"]
    assert line["framework_overhead_share"] == pytest.approx(overhead)
    console = {line.split()[0]: line.split() for line in summary_table(rows).splitlines() if line.startswith("gpt")}
    # Columns: cell, status, step ms, samples/s, stalled, exposed, overhead, ...
    assert console["gpt-tiny/zero3/ws1/gb16/mb4/fp32/cpu"][5:7] == ["-", f"{overhead:.0%}"]
    assert console["gpt-tiny/zero3/ws2/gb16/mb4/fp32/cpu"][6] == "-"


def test_both_figures_at_two_ranks_on_the_emulated_cluster_and_the_projection_names_its_own():
    # Issue 33, finding 3: ZeRO-3 at 1 Gbit/s and 2 ranks, 72% beyond the compute-only pass (the report's
    # "exposed") and 40% beyond its own world-size-1 step (the projection's basis); FSDP2 69% and 55%. By
    # hand from the raw rows: medians of each launch's step times (no step stalled), then across launches.
    rows = [r for r in load_rows([RENO / "cells.jsonl"]) if setting_of(r) == "1000 Mbit/s" and r["spec"]["world_size"] <= 2]

    def median_step(strategy, world_size):
        launches = [r["measurements"] for r in rows if r["spec"]["strategy"] == strategy
                    and r["spec"]["world_size"] == world_size]
        assert len(launches) == 3 and not any(m["host_stalled_step_indices"] for m in launches)
        return statistics.median(statistics.median(m["step_time_s"]) for m in launches)

    cells = cell_table(rows).set_index(["strategy", "world_size"])
    comm = read_rows([RENO / "comm.jsonl"], kind=COMMBENCH_KIND)
    bases, _ = bases_from_rows(rows, REGISTRY_FACTS, calibrations_by_network(comm)[network_key(rows[0])])
    sources = {basis.strategy: basis.overlap_source for basis in bases}
    for strategy, exposed, beyond in (("zero3", 0.72, 0.40), ("fsdp2", 0.69, 0.55)):
        step, one = median_step(strategy, 2), median_step(strategy, 1)
        # Per launch the exposed share is 1 - compute / step; the cell's is the median of the launches'.
        launches = [r["measurements"] for r in rows if r["spec"]["strategy"] == strategy and r["spec"]["world_size"] == 2]
        shares = [1 - statistics.median(max(ranks) for ranks in zip(*m["compute_only_step_time_s_by_rank"]))
                  / statistics.median(m["step_time_s"]) for m in launches]
        line = cells.loc[(strategy, 2)]
        assert line["exposed_comm_share"] == pytest.approx(statistics.median(shares))
        assert round(line["exposed_comm_share"], 2) == exposed
        # 32 samples at 1 rank, 16 a rank at 2.
        assert line["step_beyond_ws1_s"] == pytest.approx(step - one * 16 / 32)
        assert round(line["step_beyond_ws1_share"], 2) == beyond
        # The projection's basis is this same figure, under this same name.
        assert f"measured step beyond the strategy's world-size-1 step {(step - one / 2) * 1e3:.3g} ms" in sources[strategy]
        assert "exposed" not in sources[strategy]


def test_a_projected_row_names_the_step_beyond_compute_and_where_compute_came_from():
    # Projected rows carried the step beyond their compute as `exposed_comm_*`, a measured row's name for the
    # step beyond the compute-only pass, whatever compute was. full.jsonl holds world-size-1 cells (compute is
    # the strategy's own step there); smoke.jsonl only DDP at 2 ranks (compute is its compute-only pass).
    from harness.project.collectives import ClusterModel
    from harness.project.cluster import load_cluster
    from harness.project.projection import Scaling, projected_record
    from harness.project.run import project_rows

    model = ClusterModel(load_cluster(None, {"gpus_per_node": 8, "intra_node_bandwidth_GBps": 100.0,
                                             "intra_node_latency_us": 2.0, "inter_node_bandwidth_GBps": 25.0,
                                             "inter_node_latency_us": 10.0}))
    for source, compute_from in ((FULL, "the strategy's world-size-1 step"),
                                 (RESULTS / "ci-cpu" / "smoke.jsonl", "compute-only pass at world size 2")):
        points, _ = project_rows(load_rows([source]), model, [16], [Scaling.WEAK])
        ddp = next(p for p in points if p.basis.strategy == "ddp")
        record = projected_record(ddp, model)
        assert not {key for key in record if key.startswith("exposed_comm")}
        assert record["step_beyond_compute_s"] == pytest.approx(record["step_time_s"] - record["compute_s"])
        assert record["step_beyond_compute_share"] == pytest.approx(record["step_beyond_compute_s"] / record["step_time_s"])
        assert record["inputs"]["basis"]["compute_source"].startswith(compute_from)
