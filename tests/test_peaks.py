"""Datasheet peaks and MFU (harness.derive.peaks) against figures written out from the vendors' tables.

Dense figures are the datasheets' "with sparsity" tensor-core numbers halved, as the datasheets say.
"""

import math
import subprocess
import sys

import pytest

from harness.derive.peaks import USER_SOURCE, MathMode, mfu, peak_flops_for, tf32_in_use

H100_SXM = "NVIDIA H100 80GB HBM3"
# NVIDIA H100 whitepaper, H100 SXM5: BF16 tensor 989.4 (1978.9 sparse), TF32 tensor 494.7 (989.4 sparse),
# FP32 (no tensor cores) 66.9 TFLOP/s.
H100_SXM_BF16, H100_SXM_TF32, H100_SXM_FP32 = 989.4e12, 494.7e12, 66.9e12
# ResNet-50 (torchvision v1.5, 224x224): 4.09 G multiply-accumulates per image forward (torchvision's
# model table, ResNet50_Weights.IMAGENET1K_V1, "GFLOPS 4.09", which counts one multiply-add as one);
# training = 2 FLOPs per MAC x 3 (forward + backward) = 6 x 4.09e9 = 24.54e9 FLOPs per image.
RESNET50_TRAIN_FLOPS = 3 * 2 * 4.09e9


def h100_resnet_row(**flags):
    """A ResNet fp32 row on an H100 SXM as a rank records it, torch's default flags unless overridden."""
    return {"device_name": H100_SXM, "workload_family": "resnet", "cudnn_allow_tf32": True,
            "matmul_allow_tf32": False, "matmul_precision": "highest", "nvidia_tf32_override": None, **flags}


def test_h100_nvl_does_not_get_the_h100_sxm_peak():
    # H100 datasheet, NVL column: BF16 1,671 TFLOP/s with sparsity -> 835.5 dense (SXM: 989.4).
    peak = peak_flops_for("NVIDIA H100 NVL", "bf16", None, None)
    assert peak.flops_per_s == pytest.approx(835.5e12)
    assert peak.source == "datasheet: NVIDIA H100 NVL bf16"


def test_a_name_that_contains_a100_is_not_an_a100():
    peak = peak_flops_for("NVIDIA RTX A1000", "bf16", None, None)
    assert peak.flops_per_s is None and peak.source is None
    assert peak.reason == "no datasheet peak for device 'NVIDIA RTX A1000'; pass --peak-tflops"


def test_names_match_whole_ignoring_only_case_and_whitespace():
    assert peak_flops_for("  nvidia h100   80gb HBM3 ", "bf16", None, None).flops_per_s == H100_SXM_BF16
    for near_miss in ("NVIDIA H100", "H100 80GB HBM3", "NVIDIA A100-SXM4-40GB MIG 1g.5gb"):
        assert peak_flops_for(near_miss, "bf16", None, None).flops_per_s is None


def test_h100_sxm_bf16_peak_is_the_dense_datasheet_figure():
    peak = peak_flops_for(H100_SXM, "bf16", None, None)
    assert peak.flops_per_s == 989.4e12
    assert (peak.source, peak.math_mode) == ("datasheet: NVIDIA H100 80GB HBM3 bf16", MathMode.BF16)


def test_h100_sxm_fp32_peak_is_the_tf32_figure_with_tf32_and_the_plain_fp32_figure_without():
    with_tf32 = peak_flops_for(H100_SXM, "fp32", True, None)
    assert with_tf32.flops_per_s == 989.4e12 / 2                      # TF32 989.4 sparse -> 494.7 dense
    assert (with_tf32.source, with_tf32.math_mode) == ("datasheet: NVIDIA H100 80GB HBM3 tf32", MathMode.TF32)
    without = peak_flops_for(H100_SXM, "fp32", False, None)
    assert without.flops_per_s == 66.9e12
    assert (without.source, without.math_mode) == ("datasheet: NVIDIA H100 80GB HBM3 fp32", MathMode.FP32)


def test_fp32_row_that_does_not_say_whether_tf32_ran_gets_no_peak():
    old_row = {"device_name": H100_SXM, "shared_device": False}      # written before the flags were recorded
    assert tf32_in_use(old_row) is None
    peak = peak_flops_for(H100_SXM, "fp32", tf32_in_use(old_row), None)
    assert peak.flops_per_s is None and peak.math_mode is None and "TF32" in peak.reason


def test_resnet50_fp32_at_3000_images_per_s_on_an_h100_sxm_is_below_100_percent_mfu():
    # cuDNN runs fp32 convolutions in TF32 by default, so the peak is TF32's 494.7 TFLOP/s:
    # 24.54e9 FLOPs x 3,000 img/s = 73.62 TFLOP/s -> 73.62 / 494.7 = 14.9%. Against the plain fp32 peak
    # (66.9) the same run would read 110%.
    row = h100_resnet_row()
    assert tf32_in_use(row) is True
    peak = peak_flops_for(H100_SXM, "fp32", tf32_in_use(row), None)
    value, why_not = mfu(RESNET50_TRAIN_FLOPS, 3000.0, 1, peak, shared_device=False)
    assert why_not == ""
    assert value == pytest.approx(73.62e12 / 494.7e12) and value < 1
    assert value == pytest.approx(0.1488, abs=1e-4)


def test_mfu_divides_global_throughput_by_devices():
    # GPT-2 small in bf16 on 8 H100 SXM: 876e9 FLOPs per 1024-token sample, 3,200 samples/s -> 400 per
    # device -> 350.4 TFLOP/s per device -> 350.4 / 989.4 = 35.4%.
    peak = peak_flops_for(H100_SXM, "bf16", None, None)
    value, _ = mfu(876e9, 3200.0, 8, peak, shared_device=False)
    assert value == pytest.approx(350.4e12 / 989.4e12)


def test_a_user_peak_is_recorded_as_the_users_on_a_gpu_and_on_a_cpu():
    for device in (H100_SXM, "cpu"):
        peak = peak_flops_for(device, "fp32", False, 100e12)
        assert (peak.flops_per_s, peak.source, peak.math_mode) == (100e12, USER_SOURCE, MathMode.FP32)
    assert peak_flops_for(H100_SXM, "bf16", None, 100e12).to_dict()["peak_flops_source"] == "user (--peak-tflops)"


def test_a_cpu_has_no_table_peak():
    peak = peak_flops_for("cpu", "fp32", False, None)
    assert peak.flops_per_s is None and peak.reason == "a CPU has no datasheet peak; pass --peak-tflops"


def test_ranks_sharing_a_device_get_no_mfu():
    value, why_not = mfu(RESNET50_TRAIN_FLOPS, 100.0, 2, peak_flops_for(H100_SXM, "bf16", None, None),
                         shared_device=True)
    assert value is None and "share one device" in why_not


def test_convolutional_workloads_follow_cudnns_switch_and_transformers_the_matmul_switch():
    assert tf32_in_use(h100_resnet_row(cudnn_allow_tf32=False, matmul_allow_tf32=True)) is False
    assert tf32_in_use(h100_resnet_row(cudnn_allow_tf32=True, matmul_allow_tf32=False)) is True
    gpt = h100_resnet_row(workload_family="gpt")
    assert tf32_in_use(gpt) is False                                   # torch's defaults: matmul TF32 off
    assert tf32_in_use({**gpt, "matmul_precision": "high"}) is True    # torch.set_float32_matmul_precision
    assert tf32_in_use({**gpt, "matmul_allow_tf32": True, "matmul_precision": "high"}) is True
    assert tf32_in_use({**gpt, "cudnn_allow_tf32": False, "matmul_precision": "medium"}) is True


def test_tf32_rule_edge_cases():
    assert tf32_in_use(h100_resnet_row(nvidia_tf32_override="0")) is False   # the libraries' own off switch
    assert tf32_in_use(h100_resnet_row(workload_family="vit")) is None
    assert tf32_in_use({"device_name": "cpu", "workload_family": "resnet"}) is False


def test_fp16_takes_the_datasheets_fp16_tensor_figure_the_same_as_bf16s():
    # H100 SXM5 whitepaper: FP16 and BF16 tensor both 989.4 dense TFLOP/s.
    peak = peak_flops_for(H100_SXM, "fp16", None, None)
    assert (peak.flops_per_s, peak.math_mode.value) == (989.4e12, "fp16")


def test_bad_precision_and_bad_user_peak_are_refused():
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16, got 'fp8'"):
        peak_flops_for(H100_SXM, "fp8", None, None)
    with pytest.raises(ValueError, match="positive"):
        peak_flops_for(H100_SXM, "bf16", None, 0.0)


def test_cli_refuses_a_peak_tflops_that_is_not_positive(tmp_path, monkeypatch, capsys):
    import harness.runner
    from harness.cli import main

    def launch(*args, **kwargs):
        raise AssertionError("cells were launched")

    monkeypatch.setattr(harness.runner, "run_specs", launch)
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--matrix", "smoke", "--workload", "gpt-tiny", "--peak-tflops", "0",
                 "--out", str(tmp_path / "rows.jsonl")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "parbench: error: --peak-tflops must be a positive TFLOP/s figure, got 0"
    assert not (tmp_path / "rows.jsonl").exists()


def test_mfu_is_derived_from_the_row_with_its_peak_source_and_mode():
    from harness.derive.cells import launch_record
    from harness.derive.throughput import Basis

    # 2 H100 SXM ranks, 512 images per step in 512 / 6000 s -> 6,000 img/s, 3,000 per device.
    row = {"status": "ok", "cell_id": "c", "run_id": "r",
           "spec": {"workload": "resnet50", "strategy": "ddp", "world_size": 2, "global_batch": 512,
                    "micro_batch": 256, "precision": "fp32", "warmup_steps": 1, "timed_steps": 1, "seed": 0,
                    "device": "cuda", "nnodes": 1, "options": {}},
           "measurements": {**h100_resnet_row(), "train_flops_per_sample": RESNET50_TRAIN_FLOPS,
                            "step_time_s": [512 / 6000.0], "shared_device": False}}
    figures = launch_record(row, Basis.ALL_STEPS)
    assert figures["peak_flops_per_s"] == 494.7e12 and figures["peak_math_mode"] == "tf32"
    assert figures["peak_flops_source"] == "datasheet: NVIDIA H100 80GB HBM3 tf32"
    assert math.isclose(figures["mfu"], 73.62e12 / 494.7e12) and figures["mfu_unavailable_because"] is None
    shared = {**row, "measurements": {**row["measurements"], "shared_device": True, "user_peak_flops_per_s": 10e12}}
    figures = launch_record(shared, Basis.ALL_STEPS)
    assert figures["mfu"] is None and figures["peak_flops_source"] == USER_SOURCE
    assert "share one device" in figures["mfu_unavailable_because"]


@pytest.mark.launch
def test_derive_peaks_imports_no_torch():
    code = "import sys, harness.derive.peaks; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
