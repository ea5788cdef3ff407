"""Derived figures against hand-computed values: ZeRO memory and scaling efficiency (MFU:
tests/test_peaks.py; communication: tests/test_comm_derive.py)."""

import math

import pandas as pd
import pytest

from harness.derive.memory import plan_bytes, zero_plan
from harness.derive.scaling import scaling_efficiency


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.40625), (2, 16.640625), (3, 1.875)])
def test_zero_memory_per_stage_reproduces_the_paper_figure_1(stage, expected_gb):
    # Rajbhandari et al. 2020, fig. 1: 7.5B parameters, K = 12, N_d = 64 -> 120, 31.4, 16.6, 1.9 GB.
    states = plan_bytes(zero_plan(stage, 64, 2, 2, 12, basis="the paper's mixed-precision Adam"), 7_500_000_000)
    assert math.isclose(states["total"] / 1e9, expected_gb, rel_tol=1e-9)


def test_fp32_recipe_shards_its_own_bytes():
    # 1M parameters, 4 ranks, (4, 4, 8) bytes: stage 1 keeps 8 MB whole and 8 MB / 4 of Adam moments.
    assert plan_bytes(zero_plan(1, 4, 4, 4, 8, basis="fp32"), 1_000_000)["total"] == 8e6 + 2e6
    assert plan_bytes(zero_plan(3, 4, 4, 4, 8, basis="fp32"), 1_000_000)["total"] == 4e6




def test_strong_and_weak_scaling_efficiency_by_hand():
    common = {"workload": "w", "precision": "fp32", "micro_batch": 4, "device": "cpu", "shared_device": False,
              "options": ""}
    table = pd.DataFrame([
        {**common, "strategy": "plain", "world_size": 1, "global_batch": 16, "samples_per_s": 100.0},
        {**common, "strategy": "plain", "world_size": 1, "global_batch": 8, "samples_per_s": 90.0},
        {**common, "strategy": "ddp", "world_size": 1, "global_batch": 16, "samples_per_s": 95.0},
        {**common, "strategy": "ddp", "world_size": 2, "global_batch": 16, "samples_per_s": 150.0},
        {**common, "strategy": "ddp", "world_size": 4, "global_batch": 16, "samples_per_s": 999.0,
         "shared_device": True},
    ])
    out = scaling_efficiency(table).set_index(["strategy", "world_size", "global_batch"])
    assert math.isclose(out.loc[("ddp", 2, 16), "strong_efficiency_vs_ws1"], 150 / (2 * 95))
    assert math.isclose(out.loc[("ddp", 2, 16), "strong_efficiency_vs_plain"], 150 / (2 * 100))
    assert math.isclose(out.loc[("ddp", 2, 16), "weak_efficiency_vs_plain"], 150 / (2 * 90))
    assert math.isnan(out.loc[("ddp", 2, 16), "weak_efficiency_vs_ws1"])        # no ddp ws1 at batch 8
    assert math.isnan(out.loc[("ddp", 4, 16), "strong_efficiency_vs_ws1"])      # shared GPU: no speed


def test_nccl_overlap_from_kernel_intervals_by_hand():
    from harness.rank.profile_pass import overlap_figures

    kernels = [("ncclDevKernel_AllReduce", 0.0, 4.0), ("ncclDevKernel_AllReduce", 3.0, 6.0),   # union 0-6
               ("volta_sgemm", 1.0, 2.0), ("elementwise", 5.0, 9.0)]                          # hides 1 + 1
    figures = overlap_figures(kernels, steps=2)
    assert figures == {"nccl_kernel_s_per_step": 3.0, "nccl_overlapped_fraction": 2.0 / 6.0}
    assert overlap_figures([("gemm", 0, 1)], 1)["nccl_overlapped_fraction"] is None


@pytest.mark.gpu
def test_profiler_pass_sees_nccl_kernels_of_a_real_all_reduce(tmp_path):
    import torch
    import torch.distributed as dist

    from harness.rank.profile_pass import profile_steps

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        tensor = torch.ones(1 << 24, device="cuda")
        figures = profile_steps(lambda step: dist.all_reduce(tensor), steps=2)
    finally:
        dist.destroy_process_group()
    assert figures["nccl_kernel_s_per_step"] > 0
