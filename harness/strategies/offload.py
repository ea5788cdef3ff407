"""Offload to the host: activations (every strategy that runs its own forward), and model states where a library
offers it (ZeRO's `offload_optimizer` and `offload_param`, FSDP2's `offload_policy`), each named as its library
names it.

    activation_offload=cpu      tensors saved for backward wait in pinned host memory (torch.autograd.graph.save_on_cpu)
    offload_optimizer=cpu       ZeRO-Offload: the fp32 master partition, AdamW's moments, the step and the
                                reduced gradients on the host (Ren et al. 2021)             [zero1, zero2, zero3]
    offload_param=cpu           ZeRO-Infinity's CPU tier: the parameter shards too (Rajbhandari et al. 2021) [zero3]
    offload_policy=cpu          FSDP2's CPUOffloadPolicy: sharded parameters, gradients and the step on the host [fsdp2]

All of them move bytes from a GPU to its host; on a CPU device the bytes are on the host already and nothing
would be measured, so such a cell is skipped there with that reason (`offload_refusal`), while its memory plan
(harness.derive.memory: `on_host` components) and the projection still say what each would keep on the device.
ZeRO's two run there all the same (`RUN_ON_A_CPU_DEVICE`): they change the code that steps and fetches, whose
arithmetic a CPU cell checks.
`save_on_cpu` is torch's pack hook: it copies each tensor saved for backward (parameters a matmul saves
included) to the host in forward and back in backward; the bytes it packs are counted here (`packed_bytes`), and
a step moves them twice. Being the innermost hook it hides those tensors from the saved-for-backward census
(harness.rank.saved_activations), whose figure such a row leaves out, saying why. DeepSpeed's pipeline runs
forward and backward inside `train_batch`, where no hook of ours reaches (its own `cpu_checkpointing` needs its
reentrant checkpointing), and DataParallel runs replicas in threads that a thread-local pack hook does not
reach: both refuse `activation_offload` in one line before launch.
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch

from harness.spec import DeviceKind, OptionValue, RunSpec
from harness.strategies.option import Option

ACTIVATION_OFFLOAD_NAME = "activation_offload"
ACTIVATION_OFFLOAD = Option("none", "keep tensors saved for backward in pinned host memory until backward "
                                    "(torch.autograd.graph.save_on_cpu; GPU only)", choices=("none", "cpu"))
# Every offload option, and what it moves: a cell with any of them at "cpu" is skipped on a CPU device, but for
# those that run other code there too (RUN_ON_A_CPU_DEVICE).
OFFLOAD_OPTIONS = {ACTIVATION_OFFLOAD_NAME: "saved activations", "offload_optimizer": "optimizer states",
                   "offload_param": "parameters", "offload_policy": "parameters, gradients and optimizer states"}
# ZeRO-Offload steps with DeepSpeed's CPU Adam (harness.strategies.zero.zero_offload_adam), not the common torch
# AdamW, and ZeRO-3's offloaded parameters go through DeepSpeed's own fetch path: on a CPU device no byte crosses a
# bus, but that arithmetic is still checked (parity, the census); DeepSpeed 0.19.8 runs both on its CPU accelerator.
RUN_ON_A_CPU_DEVICE = ("offload_optimizer", "offload_param")


def offloaded(options: Mapping[str, OptionValue]) -> dict[str, str]:
    """{option: what it moves} of the offload options a cell turns on."""
    return {name: what for name, what in OFFLOAD_OPTIONS.items() if options.get(name, "none") not in ("none", None)}


def offload_refusal(spec: RunSpec, options: Mapping[str, OptionValue]) -> str | None:
    """Why an offloading cell cannot be measured on this device (a CPU), or None."""
    moved = {name: what for name, what in offloaded(options).items() if name not in RUN_ON_A_CPU_DEVICE}
    if moved and spec.device is DeviceKind.CPU:
        names = ", ".join(f"{name}={options[name]}" for name in moved)
        return (f"{names} moves {' and '.join(moved.values())} from a GPU to its host; on a CPU device they are "
                "there already and nothing would be measured (its memory plan still says what it keeps)")
    return None


_packed = [0]        # bytes this process's `saved_on_host` hooks have copied to the host so far


def packed_bytes() -> int:
    """Bytes copied to the host by activation offload in this process so far (read before and after a step)."""
    return _packed[0]


class CountedSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu (pinned), counting the bytes its pack hook copies to the host."""

    def __init__(self) -> None:
        super().__init__(pin_memory=True)
        pack = self.pack_hook

        def counted(tensor: torch.Tensor):
            _packed[0] += tensor.numel() * tensor.element_size()
            return pack(tensor)

        self.pack_hook = counted


def saved_on_host(spec: RunSpec) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward and backward: `save_on_cpu` where the cell offloads activations."""
    if spec.options_dict.get(ACTIVATION_OFFLOAD_NAME, "none") == "cpu":
        return CountedSaveOnCpu()
    return contextlib.nullcontext()
