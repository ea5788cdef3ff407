"""Datasheet peak FLOP/s per device and math mode, and model FLOPs utilisation (MFU) against them.

    python -c "import harness.derive.peaks as p; print(p.peak_flops_for('NVIDIA H100 NVL', 'fp32', True))"

MFU = train FLOPs per sample x samples/s per device / peak FLOP/s of the device in the math mode the
matmuls and convolutions ran in (Chowdhery et al. 2022, "PaLM", appendix B). Training FLOPs per sample
come from the workload (recorded in the row as `train_flops_per_sample`), so recomputation and padding
never count as useful work.

This module owns three decisions, each made so that a peak can never be matched to the wrong device or
mode:
- Devices are looked up by their FULL name exactly as `torch.cuda.get_device_name()` reports it
  (whitespace and case normalised, nothing else): "NVIDIA H100 NVL" is not "NVIDIA H100 80GB HBM3", and
  "NVIDIA RTX A1000" is not an A100. A name not in the table (a MIG slice included: its name carries
  the slice and it has a fraction of the whole GPU's units) has no peak, and the reason says so.
- fp32 training runs its matmuls and convolutions either on the tensor cores in TF32 or on the plain
  fp32 units, with peaks ~7x apart, so the row must record which (see `tf32_in_use`); a row that does
  not say gets no MFU rather than a guess.
- A peak the user gives (`--peak-tflops`) is recorded as the user's, never mixed with the table.

Nothing here imports torch or the workloads: rows carry the device name, the TF32 flags and the
workload family, recorded by the rank (harness.rank.worker).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping


class MathMode(enum.StrEnum):
    """The arithmetic the dominant FLOPs (matmuls, convolutions) ran in."""

    BF16 = "bf16"     # bf16 tensor cores (autocast or DeepSpeed's bf16), fp32 accumulate
    FP16 = "fp16"     # fp16 tensor cores (autocast or DeepSpeed's fp16), fp32 accumulate
    TF32 = "tf32"     # fp32 tensors on the tensor cores, inputs rounded to a 10-bit mantissa
    FP32 = "fp32"     # plain fp32 on the CUDA cores, no tensor cores


@dataclass(frozen=True, kw_only=True, slots=True)
class DevicePeaks:
    """Dense (no 2:4 sparsity) peaks of one device, in FLOP/s, and the document they come from."""

    bf16: float
    tf32: float
    fp32: float
    document: str                 # the vendor document the figures come from

    @property
    def fp16(self) -> float:
        """Each datasheet below prints the same dense FP16 and BF16 tensor-core figure (fp32 accumulate)."""
        return self.bf16

    def __post_init__(self) -> None:
        for mode in MathMode:
            if not getattr(self, mode.value) > 0:
                raise ValueError(f"DevicePeaks.{mode.value} must be a positive FLOP/s figure")

    def for_mode(self, mode: MathMode) -> float:
        return getattr(self, mode.value)


# NVIDIA datasheets print tensor-core figures "with sparsity" and say the dense figure is half; the
# values below are the dense ones, in FLOP/s. Each was checked against public copies of the vendor tables
# (searched Nov 2026), as noted per entry: "confirmed" means a copy of the vendor's table showing the
# same figures was found; "not confirmed here" means the figure is the datasheet's as read, no copy found.
_H100_SXM5 = DevicePeaks(
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper (v1.0x), table "NVIDIA H100 SXM5": FP32 66.9,
    # TF32 tensor 494.7 / 989.4 sparse, BF16 tensor 989.4 / 1978.9 sparse. The H100 datasheet's SXM column
    # rounds these: FP32 67, TF32 989*, BF16 1,979* (* with sparsity). Confirmed (both tables).
    bf16=989.4e12, tf32=494.7e12, fp32=66.9e12,
    document="NVIDIA H100 whitepaper, H100 SXM5")
_H100_PCIE = DevicePeaks(
    # NVIDIA H100 datasheet, PCIe column: FP32 51, TF32 756*, BF16 1,513*; the whitepaper gives FP32 51.2.
    # Confirmed (datasheet table).
    bf16=756.5e12, tf32=378e12, fp32=51.2e12,
    document="NVIDIA H100 datasheet, H100 PCIe")
_H100_NVL = DevicePeaks(
    # NVIDIA H100 datasheet, NVL column (one 94 GB GPU, 350-400 W): FP32 60, TF32 835*, BF16 1,671*.
    # BF16 835 dense matches several public peak tables; the TF32 and FP32 figures are not confirmed here.
    bf16=835.5e12, tf32=417.5e12, fp32=60e12,
    document="NVIDIA H100 datasheet, H100 NVL")
_H200_SXM = DevicePeaks(
    # NVIDIA H200 datasheet, SXM column: FP32 67, TF32 989*, BF16 1,979*: the same GH100 die, SM count and
    # clocks as the H100 SXM5 and the same rounded figures, so the whitepaper's unrounded ones apply.
    # BF16 989 dense confirmed; TF32 and FP32 not confirmed here.
    bf16=989.4e12, tf32=494.7e12, fp32=66.9e12,
    document="NVIDIA H200 datasheet, H200 SXM (H100 SXM5 whitepaper figures)")
_H200_NVL = DevicePeaks(
    # NVIDIA H200 datasheet, NVL column: FP32 60, TF32 835*, BF16 1,671*. Not confirmed here.
    bf16=835.5e12, tf32=417.5e12, fp32=60e12,
    document="NVIDIA H200 datasheet, H200 NVL")
_A100 = DevicePeaks(
    # NVIDIA A100 datasheet (all four boards list the same peaks): FP32 19.5, TF32 156 | 312*,
    # BF16 312 | 624*. Confirmed.
    bf16=312e12, tf32=156e12, fp32=19.5e12,
    document="NVIDIA A100 datasheet")
_L40S = DevicePeaks(
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183 | 366*, BF16 362.05 | 733*. Confirmed.
    bf16=362.05e12, tf32=183e12, fp32=91.6e12,
    document="NVIDIA L40S datasheet")
_L40 = DevicePeaks(
    # NVIDIA L40 datasheet: FP32 90.5, TF32 90.5 | 181*, BF16 181.05 | 362.1*. Confirmed.
    bf16=181.05e12, tf32=90.5e12, fp32=90.5e12,
    document="NVIDIA L40 datasheet")
_L4 = DevicePeaks(
    # NVIDIA L4 datasheet: FP32 30.3, TF32 120*, BF16 242*. TF32 120* confirmed; the others not here.
    bf16=121e12, tf32=60e12, fp32=30.3e12,
    document="NVIDIA L4 datasheet")
_A40 = DevicePeaks(
    # NVIDIA A40 datasheet: FP32 37.4, TF32 74.8 | 149.6*, BF16 149.7 | 299.4*. Confirmed.
    bf16=149.7e12, tf32=74.8e12, fp32=37.4e12,
    document="NVIDIA A40 datasheet")
_A10 = DevicePeaks(
    # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5 | 125*, BF16 125 | 250*. FP32 (31.24) confirmed; the
    # tensor-core figures not confirmed here.
    bf16=125e12, tf32=62.5e12, fp32=31.2e12,
    document="NVIDIA A10 datasheet")

# Full device name, as torch.cuda.get_device_name() reports it, -> dense peaks. Names as NVIDIA's driver
# reports them (the same strings cloud providers list as GPU type ids).
PEAKS: dict[str, DevicePeaks] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM5,
    "NVIDIA H100 PCIe": _H100_PCIE,
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H200": _H200_SXM,
    "NVIDIA H200 NVL": _H200_NVL,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": _L40S,
    "NVIDIA L40": _L40,
    "NVIDIA L4": _L4,
    "NVIDIA A40": _A40,
    "NVIDIA A10": _A10,
}

USER_SOURCE = "user (--peak-tflops)"
PRECISIONS = ("fp32", "bf16", "fp16")


def normalise_device_name(name: str) -> str:
    """Case and runs of whitespace do not distinguish devices; every other character does."""
    return " ".join(name.split()).casefold()


_BY_NORMALISED_NAME = {normalise_device_name(name): (name, peaks) for name, peaks in PEAKS.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Peak:
    """The peak an MFU is computed against, where it came from, and why there is none when there is none."""

    flops_per_s: float | None
    source: str | None            # "datasheet: <device> <mode>", USER_SOURCE, or None
    math_mode: MathMode | None    # the arithmetic the peak is for; None where unknown
    reason: str = ""              # set exactly when flops_per_s is None
    document: str | None = None   # the datasheet behind a table peak

    def to_dict(self) -> dict[str, Any]:
        """The row's fields (units in the names)."""
        return {"peak_flops_per_s": self.flops_per_s, "peak_flops_source": self.source,
                "peak_math_mode": self.math_mode.value if self.math_mode else None,
                "peak_unavailable_because": self.reason or None, "peak_flops_document": self.document}


def math_mode_for(precision: str, tf32_in_use: bool | None) -> MathMode | None:
    """bf16 runs on bf16 tensor cores; fp32 on TF32 tensor cores or plain fp32 units; None if unknown."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision in ("bf16", "fp16"):
        return MathMode(precision)
    if tf32_in_use is None:
        return None
    return MathMode.TF32 if tf32_in_use else MathMode.FP32


def peak_flops_for(device_name: str, precision: str, tf32_in_use: bool | None,
                   user_peak_flops: float | None = None) -> Peak:
    """The peak FLOP/s for a run at `precision` ("fp32", "bf16" or "fp16") on the device torch named.

    For fp32, `tf32_in_use` picks the TF32 tensor-core peak (True) or the plain fp32 peak (False); None
    (the row does not say) gives no peak. A user peak is returned as the user's whatever the table says.
    """
    mode = math_mode_for(precision, tf32_in_use)
    if user_peak_flops is not None:
        if not user_peak_flops > 0:
            raise ValueError(f"a user peak must be a positive FLOP/s figure, got {user_peak_flops!r}")
        return Peak(flops_per_s=float(user_peak_flops), source=USER_SOURCE, math_mode=mode)
    if normalise_device_name(device_name) == "cpu":
        return Peak(flops_per_s=None, source=None, math_mode=mode,
                    reason="a CPU has no datasheet peak; pass --peak-tflops")
    entry = _BY_NORMALISED_NAME.get(normalise_device_name(device_name))
    if entry is None:
        return Peak(flops_per_s=None, source=None, math_mode=mode,
                    reason=f"no datasheet peak for device {device_name!r}; pass --peak-tflops")
    if mode is None:
        return Peak(flops_per_s=None, source=None, math_mode=None,
                    reason="an fp32 row that does not record whether TF32 was in use (cudnn_allow_tf32, "
                           "matmul_allow_tf32, workload_family): its math mode, and so its peak, is unknown")
    name, peaks = entry
    return Peak(flops_per_s=peaks.for_mode(mode), source=f"datasheet: {name} {mode.value}", math_mode=mode,
                document=peaks.document)


# Which of torch's TF32 switches governs a workload's dominant FLOPs, by workload family:
# - "resnet": convolutions, which cuDNN runs under torch.backends.cudnn.allow_tf32 (default True). The
#   final linear layer goes through cuBLAS under the matmul switch, but it is ~0.05% of ResNet-50's
#   multiply-accumulates (2048 x 1000 of 4.09 G), so the convolution switch decides the peak.
# - "gpt": matmuls (cuBLAS), under torch.backends.cuda.matmul.allow_tf32 (default False since torch 1.12)
#   and torch.set_float32_matmul_precision: "high" or "medium" let cuBLAS use TF32 on CUDA, "highest"
#   does not. Either setting on means TF32.
# NVIDIA_TF32_OVERRIDE=0 in the environment turns TF32 off inside cuBLAS and cuDNN whatever torch asks.
# (PyTorch docs, notes/cuda.rst, "TensorFloat-32 (TF32) on Ampere (and later) devices".)
CONVOLUTION_FAMILIES = ("resnet",)
MATMUL_FAMILIES = ("gpt", "llama")
TF32_MATMUL_PRECISIONS = ("high", "medium")


def tf32_in_use(measurements: Mapping[str, Any]) -> bool | None:
    """Whether an fp32 run's dominant FLOPs ran in TF32, from the flags its rank recorded; None when the
    row does not record them (rows before they were recorded) or names an unknown workload family.
    On CPU TF32 does not exist: False."""
    if measurements.get("device_name", "cpu") == "cpu":
        return False
    if measurements.get("nvidia_tf32_override") == "0":
        return False
    family = measurements.get("workload_family")
    if family in CONVOLUTION_FAMILIES:
        flag = measurements.get("cudnn_allow_tf32")
        return None if flag is None else bool(flag)
    if family in MATMUL_FAMILIES:
        flag, precision = measurements.get("matmul_allow_tf32"), measurements.get("matmul_precision")
        if flag is None or precision is None:
            return None
        return bool(flag) or precision in TF32_MATMUL_PRECISIONS
    return None


def mfu(train_flops_per_sample: float, samples_per_s: float, devices: int, peak: Peak,
        shared_device: bool) -> tuple[float | None, str]:
    """(MFU, why it is None): train FLOPs per sample x samples/s per device / peak FLOP/s (Chowdhery et
    al. 2022, "PaLM", appendix B). Ranks sharing one device split it, so no per-device peak applies."""
    if shared_device:
        return None, "several ranks share one device, so no per-device peak applies"
    if peak.flops_per_s is None:
        return None, peak.reason
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return train_flops_per_sample * samples_per_s / devices / peak.flops_per_s, ""
