"""A GPU cell the plan's memory says cannot fit is skipped before launch, naming the figures (harness.memory_fit),
and one that fits is launched; checked with the GPU's memory faked, against model states counted by hand."""

from __future__ import annotations

import types

import pytest
import torch

from harness.memory_fit import FIT_MARGIN, does_not_fit, skip_reason
from harness.spec import DeviceKind, Precision, RunSpec

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
    assert "over the 79.2 GiB of GPU it has" in reason


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


def test_it_is_skipped_before_launch_on_this_hosts_gpu_and_a_cpu_cell_never_asks(monkeypatch, tmp_path):
    from harness.launch.cell import run_cell
    from harness.spec import Status

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(total_memory=H100_BYTES))
    assert skip_reason(cell("llama3-8b", "ddp")).startswith("does not fit: needs ")
    assert skip_reason(cell("llama3.2-1b", "ddp", micro_batch=4)) is None
    # Two such ranks share the one GPU (gloo): each has half of it, and 49.3 GiB a rank is over 39.6.
    assert "of GPU it has" in skip_reason(cell("llama3.2-1b", "ddp", world_size=2, micro_batch=4))
    row = run_cell(cell("llama3-8b", "ddp"), repeat=0, cell_dir=tmp_path, timeout_s=60, environment={})
    assert row.status is Status.SKIPPED and row.message.startswith("does not fit")      # nothing was launched
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: pytest.fail("a CPU cell asked for a GPU"))
    cpu = RunSpec(workload="llama-tiny", strategy="ddp", world_size=1, global_batch=4, micro_batch=4)
    assert skip_reason(cpu) is None


@pytest.mark.parametrize("spec, strategy, options, recipe, data_parallel, micro_batches", [
    # The plain loop holds what DDP holds at one rank; fp32 computes in fp32.
    (cell("llama3.2-1b", "plain", micro_batch=4), "ddp", {}, "fp32", 1, 1),
    # FSDP2 under its users' MixedPrecisionPolicy, 8 ranks, one micro-batch each.
    (cell("llama3-8b", "fsdp2", world_size=8).replace(options={"mixed_precision": "policy"}), "fsdp2",
     {"mixed_precision": "policy"}, "fsdp-mp-policy", 8, 1),
    # Two pipeline stages over 8 ranks: 4 replicas, each 64 / (1 x 4) = 16 micro-batches a step.
    (cell("llama3-8b", "pipeline", world_size=8).replace(global_batch=64, options={"stages": 2}), "pipeline",
     {"stages": 2}, "autocast", 4, 16),
])
def test_a_cell_is_priced_as_the_layout_written_out_by_hand(spec, strategy, options, recipe, data_parallel,
                                                           micro_batches):
    from harness.memory_fit import planned_need_bytes
    from harness.project.facts import REGISTRY_FACTS
    from harness.project.model import workload_decoder
    from harness.project.rank_memory import layout_memory

    if recipe == "fp32":
        spec = spec.replace(precision=Precision.FP32)
    split = REGISTRY_FACTS.split(strategy, options, data_parallel, spec.world_size)
    assert split.data_parallel == data_parallel
    expected = layout_memory(model=workload_decoder(spec.workload), strategy=strategy, options=options, split=split,
                             recipe=recipe, micro_batch=spec.micro_batch, micro_batches=micro_batches,
                             checkpointed=False, facts=REGISTRY_FACTS)
    assert planned_need_bytes(spec)[0] == pytest.approx(expected.total, rel=1e-12)
