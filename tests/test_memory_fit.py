"""A GPU cell the plan's memory says cannot fit is skipped before launch, naming the figures (harness.memory_fit),
and one that fits is launched; checked with the GPU's memory faked, against model states counted by hand."""

from __future__ import annotations

import types

import pytest
import torch

from harness.memory_fit import FIT_MARGIN, does_not_fit
from harness.spec import DeviceKind, Precision, RunSpec
from harness.strategies import get_strategy

GIB = 2 ** 30
H100_BYTES = 79.2 * GIB          # what an H100 80GB reports to torch
LLAMA3_8B, LLAMA32_1B = 8_030_261_248, 1_235_814_400      # the released weights' counts (tests/test_llama.py)
# fp32 weights and gradients and AdamW's two moments under torch.autocast: 4 + 4 + 8 bytes a parameter.
STATE_BYTES = 16


def cell(workload: str, strategy: str, world_size: int = 1, micro_batch: int = 1) -> RunSpec:
    return RunSpec(workload=workload, strategy=strategy, world_size=world_size, global_batch=micro_batch * world_size,
                   micro_batch=micro_batch, precision=Precision.BF16, device=DeviceKind.CUDA)


def test_an_8b_llama_on_one_gpu_is_refused_naming_its_model_states():
    states_gib = LLAMA3_8B * STATE_BYTES / GIB                    # 119.66 GiB, over 79.2 before anything else
    reason = does_not_fit(cell("llama3-8b", "ddp"), H100_BYTES)
    assert reason.startswith("does not fit: needs ") and f"{states_gib:.1f} model states" in reason
    assert "over this GPU's 79.2 GiB" in reason


def test_a_1b_llama_at_four_samples_fits_an_80_gb_gpu():
    assert LLAMA32_1B * STATE_BYTES / GIB == pytest.approx(18.4, abs=0.05)    # the states; the rest is under 61 GiB
    assert does_not_fit(cell("llama3.2-1b", "ddp", micro_batch=4), H100_BYTES) is None


def test_only_a_need_well_over_the_memory_is_refused():
    # An 8B's ZeRO-3 over 8 GPUs needs 99.4 GiB by the plan: refused on an 80 GB GPU, launched on an H200's 139.8 GiB
    # and on a GPU whose memory is within FIT_MARGIN of the need.
    spec = cell("llama3-8b", "zero3", world_size=8)
    assert does_not_fit(spec, H100_BYTES) is not None
    assert does_not_fit(spec, 139.8 * GIB) is None
    need = float(does_not_fit(spec, H100_BYTES).split("needs ")[1].split(" GiB")[0]) * GIB
    assert does_not_fit(spec, need / (1 + FIT_MARGIN) * 1.001) is None
    assert does_not_fit(spec, need / (1 + FIT_MARGIN) * 0.99) is not None


def test_a_cell_the_plan_does_not_describe_is_launched():
    assert does_not_fit(cell("resnet50", "ddp", micro_batch=256), 1 * GIB) is None


def test_the_strategy_skips_it_before_launch_on_this_hosts_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(total_memory=H100_BYTES))
    assert get_strategy("ddp").skip_reason(cell("llama3-8b", "ddp")).startswith("does not fit: needs ")
    assert get_strategy("ddp").skip_reason(cell("llama3.2-1b", "ddp", micro_batch=4)) is None
