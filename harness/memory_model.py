"""Predicted model-state memory per rank: the ZeRO paper's formulas, and DeepSpeed's own estimator.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"), sec.
5.1 and fig. 1: with Psi parameters, mixed-precision Adam keeps 2 Psi bytes of fp16 weights, 2 Psi of fp16
gradients and K Psi = 12 Psi of fp32 optimizer state (master weights, momentum, variance). Over N_d
data-parallel ranks:
    baseline (DDP, Horovod)   (2 + 2 + K) Psi
    ZeRO-1 (P_os)             2 Psi + 2 Psi + K Psi / N_d
    ZeRO-2 (P_os+g)           2 Psi + (2 + K) Psi / N_d
    ZeRO-3 (P_os+g+p)         (2 + 2 + K) Psi / N_d
FSDP2 shards like ZeRO-3. A pipeline of S stages holds about Psi / S of the model per rank (unsharded).

The bytes per parameter follow the precision recipe actually used: fp32 training and torch autocast keep
fp32 weights and gradients and two fp32 Adam moments (4 + 4 + 8 bytes, no master copy); DeepSpeed's bf16
recipe is the paper's (2 + 2 + 12). Activations, buffers and allocator slack are not model states.
"""

from __future__ import annotations

from dataclasses import dataclass

ZERO_STAGE = {"plain": 0, "dataparallel": 0, "ddp": 0, "horovod": 0, "zero1": 1, "zero2": 2, "zero3": 3,
              "fsdp2": 3, "pipeline": 0}


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of weights, gradients and optimizer state."""

    weights: int
    gradients: int
    optimizer: int


FP32_ADAM = StateBytes(weights=4, gradients=4, optimizer=8)
MIXED_PRECISION_ADAM = StateBytes(weights=2, gradients=2, optimizer=12)   # the paper's K = 12

RECIPE_STATE_BYTES = {"fp32": FP32_ADAM, "autocast": FP32_ADAM, "fsdp-mp-policy": FP32_ADAM,
                      "deepspeed-bf16": MIXED_PRECISION_ADAM}


def zero_model_states(parameters: int, data_parallel: int, stage: int,
                      state: StateBytes = MIXED_PRECISION_ADAM) -> dict[str, float]:
    """Per-rank bytes of weights, gradients and optimizer state, and their total, at a ZeRO stage 0-3."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n = data_parallel
    weights = parameters * state.weights / (n if stage >= 3 else 1)
    gradients = parameters * state.gradients / (n if stage >= 2 else 1)
    optimizer = parameters * state.optimizer / (n if stage >= 1 else 1)
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer,
            "total": weights + gradients + optimizer}


def predicted_model_state_bytes(strategy: str, parameters: int, data_parallel: int, pipeline_stages: int,
                                recipe: str) -> float:
    """The ZeRO-paper prediction for one rank of a cell, with the bytes of the recipe it ran."""
    state = RECIPE_STATE_BYTES.get(recipe, FP32_ADAM)
    per_stage = parameters / max(1, pipeline_stages)
    return zero_model_states(round(per_stage), data_parallel, ZERO_STAGE[strategy], state)["total"]


def deepspeed_estimate(stage: int, parameters: int, largest_layer_parameters: int, gpus_per_node: int,
                       nodes: int = 1, offload_optimizer: bool = False,
                       offload_param: bool = False) -> dict[str, float] | None:
    """DeepSpeed's own per-GPU and per-node-CPU estimate (its `estimate_zero{2,3}_model_states_mem_needs`,
    with its default 1.5x buffer factor for the CPU figure), or None where it has none (stage 0 and 1) or
    DeepSpeed is not installed."""
    try:
        if stage == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
            cpu, gpu = estimate_zero2_model_states_mem_needs(parameters, gpus_per_node, nodes,
                                                               cpu_offload=offload_optimizer)
        elif stage == 3:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                parameters, largest_layer_parameters, gpus_per_node, nodes, cpu_offload=offload_optimizer,
                cpu_offload_params=offload_param, zero_init=True)
        else:
            return None
    except ImportError:
        return None
    return {"gpu_bytes": float(gpu), "cpu_bytes_per_node": float(cpu)}
