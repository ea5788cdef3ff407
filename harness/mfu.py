"""Model FLOPs utilisation: the model's analytic training FLOPs per second over the device's peak.

MFU = (train FLOPs per sample x samples/s per device) / peak FLOP/s of the device at the precision used
(Chowdhery et al. 2022, "PaLM", appendix B). Training FLOPs per sample come from the workload (6N + 12 L H
Q T per token for transformers; 3 x 2 x multiply-accumulates of the layer shapes for ResNets), so
recomputation and padding never count as useful work.

Peaks are the vendors' dense (no sparsity) datasheet figures. fp32 means plain fp32 math (no TF32), which
is how the harness runs fp32. A CPU has no agreed peak, so its MFU is unavailable unless the user states
one (`--peak-tflops`).
"""

from __future__ import annotations

# (substring of torch.cuda.get_device_name, precision) -> peak dense FLOP/s
PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("H200", "bf16"): 989.4e12, ("H200", "fp32"): 66.9e12,        # NVIDIA H200 SXM datasheet
    ("H100 PCIe", "bf16"): 756.5e12, ("H100 PCIe", "fp32"): 51.2e12,
    ("H100", "bf16"): 989.4e12, ("H100", "fp32"): 66.9e12,        # H100 SXM5 (also "H100 80GB HBM3")
    ("A100", "bf16"): 312e12, ("A100", "fp32"): 19.5e12,
    ("L40S", "bf16"): 362.05e12, ("L40S", "fp32"): 91.6e12,
    ("A10", "bf16"): 125e12, ("A10", "fp32"): 31.2e12,
}


def peak_flops(device_name: str, precision: str) -> float | None:
    """The datasheet peak for a device name as torch reports it, or None when the table has none."""
    for (fragment, table_precision), peak in PEAK_FLOPS.items():   # more specific names come first
        if fragment in device_name and table_precision == precision:
            return peak
    return None


def model_flops_utilization(train_flops_per_sample: float, samples_per_s_per_device: float,
                            peak_flops_per_s: float | None) -> float | None:
    if not peak_flops_per_s:
        return None
    return train_flops_per_sample * samples_per_s_per_device / peak_flops_per_s
