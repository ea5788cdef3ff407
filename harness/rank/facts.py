"""What every row says of its cell beside its timings: the model and its shape, the layout and recipe the strategy ran,
the device and its math modes, the hosts' load and each rank's peak memory. Read inside a rank by both of its
programs, the measuring worker (harness.rank.worker) and the bare loop (harness.rank.bare_loop), so that their rows
describe the same things the same way.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch

from harness.rank.memory_model import PeakRssSince, peak_memory
from harness.strategies.base import RankContext, Trainer
from workloads import Workload
from workloads.base import memory_format_name


def cell_facts(workload: Workload, layout, context: RankContext, trainer: Trainer, parameters: int) -> dict[str, Any]:
    """The cell as it ran: model, layout, recipe, configuration, device, threads (the same on every rank)."""
    facts: dict[str, Any] = {
        "tokens_per_sample": workload.tokens_per_sample,
        "parameters": parameters,
        "train_flops_per_sample": workload.train_flops_per_sample,
        "data_parallel": layout.data_parallel,
        "pipeline_stages": layout.pipeline_stages,
        "micro_batches_per_step": layout.micro_batches,
        "precision_recipe": trainer.precision_recipe.value,
        "strategy_config": trainer.config,
        "backend": context.backend,
        "shared_device": context.shared_device,
        "device_name": torch.cuda.get_device_name(context.device) if context.device.type == "cuda" else "cpu",
        "workload_family": workload.family.value,    # decides which TF32 switch governs (harness.derive.peaks)
        "workload_description": workload.describe(),   # its shape: layers, width, heads (harness.derive.activations)
        # The inputs' layout on this device (channels_last for ResNet on CUDA): it changes which kernels run.
        "input_memory_format": memory_format_name(workload.input_memory_format(context.device.type)),
        "threads_per_rank": torch.get_num_threads(),
    }
    if context.device.type == "cuda":
        # Whether fp32 convolutions / matmuls ran on the TF32 tensor cores: MFU's peak depends on it.
        facts["cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
        facts["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        facts["matmul_precision"] = torch.get_float32_matmul_precision()
        facts["nvidia_tf32_override"] = os.environ.get("NVIDIA_TF32_OVERRIDE")
    return facts


def rank_memory(context: RankContext, peak_rss_since: PeakRssSince) -> list[Any]:
    """[peak RSS, peak CUDA allocated, peak CUDA reserved, where the peak RSS starts] of this process, in
    bytes, since the reset before the first timed step (harness.rank.memory_model)."""
    peaks = peak_memory(context.device, peak_rss_since)
    return [peaks["peak_rss"], peaks.get("peak_allocated", 0.0), peaks.get("peak_reserved", 0.0),
            peak_rss_since.value]


def memory_figures(context: RankContext, memory_by_rank: list[list[Any]]) -> dict[str, Any]:
    """Every rank's `rank_memory` as a row's figures."""
    figures: dict[str, Any] = {"peak_rss_bytes_by_rank": [m[0] for m in memory_by_rank],
                               "peak_rss_since": _common_or_mixed([m[-1] for m in memory_by_rank])}
    if context.device.type == "cuda":
        figures["peak_allocated_bytes_by_rank"] = [m[1] for m in memory_by_rank]
        figures["peak_reserved_bytes_by_rank"] = [m[2] for m in memory_by_rank]
    return figures


def _common_or_mixed(values: list[str]) -> str:
    """The value every rank reported, or "mixed: ..." naming each rank's."""
    return values[0] if len(set(values)) == 1 else "mixed: " + ", ".join(values)


def host_load(context: RankContext) -> dict[str, Any]:
    """What this rank's host carries: the cell's ranks on it (as its launcher told the strategy:
    LOCAL_WORLD_SIZE, LOCAL_SIZE, Horovod's local size; 1 for a single process), this rank's CPU threads,
    the host's cores, which machine it is, and its 1-minute load average as the timed steps end (read after
    them): what else ran there meanwhile, a library building beside the first cells of a GPU's reference set
    (scripts/gpu-reference.sh) for one. harness.derive.hosts says from these whether the ranks oversubscribed the
    machine."""
    return {"ranks": context.local_world_size, "threads": torch.get_num_threads(), "cores": os.cpu_count() or 1,
            "machine": _machine_id(), "loadavg_1min": os.getloadavg()[0]}


def _machine_id() -> str:
    """The running kernel's boot id: the same in every network namespace of one machine (an emulated
    cluster's nodes), different on another machine; the host name where Linux does not give one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def host_load_figures(loads: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's `host_load` as a row's figures."""
    machines = [load["machine"] for load in loads]
    return {"ranks_on_host_by_rank": [load["ranks"] for load in loads],
            # Every rank of the cell on the rank's machine, whatever node its launcher counted it on.
            "ranks_on_machine_by_rank": [machines.count(machine) for machine in machines],
            "threads_by_rank": [load["threads"] for load in loads],
            "host_cpu_cores_by_rank": [load["cores"] for load in loads],
            "host_loadavg_1min_by_rank": [load.get("loadavg_1min") for load in loads]}
