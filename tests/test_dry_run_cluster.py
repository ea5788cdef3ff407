"""A dry run for a GPU cluster (harness.launch.dry_run): judged against the nodes it describes, not this host
(cells they would skip left out and named), with the kept cells' projected wall time, their GPU-hours and the
reservation's in the header, compute at the MFU parbench's plain loop measured on a GPU where it has a row, else the
one fitted on published runs. In-process, nothing launched."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.derive.peaks import PEAKS
from harness.launch.dry_run import describe_plan, left_out_on, project_cells, projected_lines
from harness.launch.placement import LocalPlacement
from harness.machine import Machine
from harness.project.cluster import load_cluster
from harness.project.cells import cell_step
from harness.spec import DeviceKind, RunSpec
from harness.strategies import get_strategy
from workloads import get_workload

H100 = "NVIDIA H100 80GB HBM3"
EIGHT_GPUS = Machine(device=DeviceKind.CUDA, devices_per_node=8, nodes=1)


@pytest.fixture
def no_gpu_here(monkeypatch):
    """This host as the CI machine is: no CUDA device, whatever runs the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def tiny(strategy: str, world_size: int) -> RunSpec:
    return RunSpec(workload="gpt-tiny", strategy=strategy, world_size=world_size, global_batch=65536,
                   micro_batch=512 if world_size == 1 else 64, precision="bf16", device="cuda",
                   warmup_steps=2, timed_steps=998, repeats=3)


def test_a_cells_wall_time_and_gpu_hours_are_the_hand_worked_figures():
    # gpt-tiny: vocabulary 512 (padded: 512), hidden 64, 4 layers of 4 heads (head 16), sequence 64.
    #   N = 512 x 64 + 4 x (12 x 64^2 + 13 x 64) + 2 x 64 = 32768 + 4 x 49984 + 128 = 232832
    #   PaLM's FLOPs a token: 6N + 12 L H Q T = 1396992 + 12 x 4 x 4 x 16 x 64 = 1396992 + 196608 = 1593600
    #   a sample: x 64 tokens = 101,990,400 FLOPs
    assert get_workload("gpt-tiny").train_flops_per_sample == 101_990_400
    assert PEAKS[H100].bf16 == 989.4e12
    # At a compute MFU of 0.4 (given), the plain loop at one GPU, no collectives: a step = 65536 samples x
    # 101,990,400 / (989.4e12 x 0.4)
    #   = 6.68403e12 / 3.9576e14 = 0.0168891 s
    # A launch starts in 9.4 s (harness.ab.LAUNCH_SECONDS["plain"]) and runs 2 + 998 = 1000 steps; 3 repeats:
    #   wall = 3 x (9.4 + 1000 x 0.0168891) = 3 x 26.2891 = 78.8674 s; GPU-hours = 78.8674 x 1 GPU / 3600 = 0.0219076
    cluster = load_cluster("dgx-h100-ib")
    [cell] = project_cells([tiny("plain", 1)], cluster, mfu=0.4)
    assert cell.start_s == 9.4
    assert math.isclose(cell.step_s, 0.0168891, rel_tol=1e-5)
    assert math.isclose(cell.wall_s, 78.8674, rel_tol=1e-5)
    assert math.isclose(cell.gpu_hours, 0.0219076, rel_tol=1e-5)
    # The header sums the cells it can price, the cells' GPU-hours and the reservation's (1 node x 8 GPUs x the wall:
    # 8 x 0.0219076 = 0.175261); the cell's own line shows the formula's terms.
    header = projected_lines([cell], cluster, "a test's", nodes=1)
    assert header[0] == ("projected, not measured: 0.0219 h of launches one after another; 0.0219 GPU-hours in the "
                         "cells (each its own GPUs), 0.175 GPU-hours reserved (1 node(s) x 8 GPUs x the wall time), "
                         "for 1 of the 1 cells")
    assert "cluster dgx-h100-ib (a test's): NVIDIA H100 80GB HBM3" in header[1]
    assert header[2] == "  compute MFU of 1 cell(s): given"


def test_a_cell_parbench_measured_on_a_gpu_is_priced_at_its_measured_step():
    # results/reference/h200/a3663fd/rows.jsonl: the plain loop on one H200 (the H100 SXM's dense peaks), GPT-2
    # small in bf16 at 16 x 1024 tokens: a median step of 72.9 ms; ResNet-50 at 256 images: 104.8 ms (its README).
    # The same cells on an H100 cluster at world size 1 are priced at the MFU those steps measured: the same step.
    cluster = load_cluster("dgx-h100-ib")
    for workload, batch, measured_ms in (("gpt2-small", 16, 72.9), ("resnet50", 256, 104.8)):
        spec = RunSpec(workload=workload, strategy="plain", world_size=1, global_batch=batch, micro_batch=batch,
                       precision="bf16", device="cuda")
        step = cell_step(spec, cluster)
        assert step.compute_from.startswith("its plain loop measured on an H200")
        assert math.isclose(step.step_s * 1e3, measured_ms, abs_tol=0.1)      # the README rounds to 0.1 ms
    # A transformer parbench never ran on a GPU is priced at the fitted compute MFU; a CNN never run is unknown.
    llama = RunSpec(workload="llama3.2-1b", strategy="plain", world_size=1, global_batch=4, micro_batch=4,
                    precision="bf16", device="cuda")
    assert cell_step(llama, cluster).compute_from == "fitted on published runs"
    resnet18 = RunSpec(workload="resnet18", strategy="plain", world_size=1, global_batch=64, micro_batch=64,
                       precision="bf16", device="cuda")
    assert "no GPU row of resnet18 in bf16" in cell_step(resnet18, cluster).unknown


def test_gpu_hours_count_every_gpu_of_the_cell_and_its_collectives_add_to_its_step():
    cluster = load_cluster("dgx-h100-ib")
    one, eight = project_cells([tiny("plain", 1), tiny("ddp", 8)], cluster, mfu=0.4)
    # DDP at 8 ranks: each computes an eighth of the 65536 samples, 0.0168891 / 8 = 0.00211114 s, then its
    # gradients' all-reduce, priced on the cluster's links (> 0); 8 GPUs for its wall time.
    step = cell_step(tiny("ddp", 8), cluster, mfu=0.4)
    assert math.isclose(step.compute_s, 0.0168891 / 8, rel_tol=1e-5) and step.comm_s > 0
    assert eight.step_s == step.compute_s + step.comm_s
    assert math.isclose(eight.wall_s, 3 * (14.8 + 1000 * eight.step_s))       # LAUNCH_SECONDS["ddp"] = 14.8
    assert math.isclose(eight.gpu_hours, eight.wall_s * 8 / 3600)
    header = projected_lines([one, eight], cluster, "a test's", nodes=4)[0]
    wall = one.wall_s + eight.wall_s
    assert f"{wall / 3600:.3g} h" in header
    assert f"{one.gpu_hours + eight.gpu_hours:.3g} GPU-hours in the cells" in header
    # The reservation holds 4 nodes of 8 GPUs for the whole wall time, whatever each cell uses.
    assert f"{4 * 8 * wall / 3600:.3g} GPU-hours reserved (4 node(s) x 8 GPUs x the wall time)" in header


def test_a_tp_cell_the_heads_refuse_is_left_out_and_dataparallel_on_an_8_gpu_node_is_kept(tmp_path, capsys,
                                                                                         no_gpu_here):
    dataparallel = RunSpec(workload="gpt2-small", strategy="dataparallel", world_size=8, global_batch=512,
                           micro_batch=16, precision="bf16", device="cuda")
    assert get_strategy("dataparallel").skip_reason(dataparallel) == "DataParallel needs 8 GPUs, 0 visible"  # here
    assert main(["run", "--matrix", "full", "--workload", "gpt2-small", "--strategy", "tp,dataparallel",
                 "--gpus-per-node", "8", "--nnodes", "4", "--dry-run", "--out", str(tmp_path / "rows.jsonl")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    cells = [line for line in lines if line.startswith("gpt2-small/")]
    assert "gpt2-small/dataparallel/ws8/gb512/mb16/bf16/cuda x5: python, 1 node(s) x 8 rank(s)" in cells
    assert not any(line.startswith("gpt2-small/tp/ws8/") for line in cells)
    # The header counts the kept cells only, and says how many more are left out.
    assert lines[0].startswith(f"parbench dry run: {len(cells)} cells, {5 * len(cells)} launches;")
    left = lines[lines.index("left out: 4 cells the cluster (4 node(s) x 8 GPUs) would skip"):]
    assert "  tensor parallelism of 8 must divide gpt2-small's 12 heads (1): gpt2-small/tp/ws8/gb512/mb16/bf16/cuda" \
        in left
    assert "  DataParallel over one device is not parallel (world size 1) (1): " \
           "gpt2-small/dataparallel/ws1/gb512/mb16/bf16/cuda" in left
    assert "on this machine" not in out                   # this host's skips are not the question here
    # DataParallel's copies are not priced: unknown, and outside the totals, which say so.
    assert f"for {len(cells) - 3} of the {len(cells)} cells (the other 3 unknown, not in these totals)" in out
    assert "  unknown: 3 cell(s): dataparallel's traffic is not modelled" in out
    assert "cluster dgx-h100-ib (assumed: the default" in out


def test_left_out_on_judges_the_nodes_not_this_host(no_gpu_here):
    four = RunSpec(workload="gpt2-small", strategy="dataparallel", world_size=4, global_batch=512, micro_batch=16,
                   precision="bf16", device="cuda")
    kept, left = left_out_on([four, four.replace(world_size=8)], Machine(device=DeviceKind.CUDA, devices_per_node=4))
    assert kept == [four] and left == [(four.replace(world_size=8), "DataParallel needs 8 GPUs, 4 visible")]
    # A CPU node has no CUDA device: a cuda cell is skipped there, as on this host.
    cpu = Machine(device=DeviceKind.CPU, devices_per_node=8, nodes=2)
    ddp = four.replace(strategy="ddp")
    assert left_out_on([ddp], cpu) == ([], [(ddp, "device cuda requested but no CUDA device is visible")])


def test_a_plan_of_this_host_alone_keeps_its_skips_counted_and_projects_nothing(no_gpu_here):
    spec = RunSpec(workload="gpt2-small", strategy="dataparallel", world_size=8, global_batch=512, micro_batch=16,
                   precision="bf16", device="cuda")
    text = describe_plan([spec], LocalPlacement(), results=Path("r.jsonl"), timeout_s=60)
    assert text.startswith("parbench dry run: 1 cells, 1 launches;")
    assert "on this machine 1 of these cells would be skipped: DataParallel needs 8 GPUs, 0 visible" in text
    assert "projected" not in text and "left out" not in text


def test_another_cluster_is_priced_where_named_and_bad_clusters_are_refused_in_one_line(tmp_path, capsys):
    base = ["run", "--matrix", "full", "--workload", "gpt2-small", "--strategy", "ddp", "--dry-run",
            "--out", str(tmp_path / "rows.jsonl")]
    assert main([*base, "--gpus-per-node", "8", "--cluster", "aws-p4d"]) == 0
    assert "cluster aws-p4d (--cluster; 8 GPUs a node as --gpus-per-node says): NVIDIA A100-SXM4-40GB" \
        in capsys.readouterr().out
    gpu_less = tmp_path / "gpu-less.toml"
    gpu_less.write_text("gpus_per_node = 8\nintra_node_latency_us = 1\nintra_node_bandwidth_GBps = 100\n"
                        "inter_node_latency_us = 5\ninter_node_bandwidth_GBps = 25\n")
    smoke_on_cpu = ["run", "--matrix", "smoke", "--device", "cpu", "--cpus-per-node", "2", "--cluster", "aws-p5"]
    for argv, fragment in (([*base, "--gpus-per-node", "8", "--cluster", "nowhere"], "unknown cluster preset 'nowhere'"),
                           ([*base, "--gpus-per-node", "8", "--cluster", str(gpu_less)], "names no GPU"),
                           ([*smoke_on_cpu, "--dry-run"], "allowed only with --dry-run --gpus-per-node N"),
                           (smoke_on_cpu, "allowed only with --dry-run --gpus-per-node N")):    # refused, not run
        assert main(argv) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and fragment in err[0], err
