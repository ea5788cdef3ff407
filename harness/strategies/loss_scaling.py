"""fp16 with dynamic loss scaling: one initial scale for every strategy, and what each step did with it.

fp16 keeps 5 exponent bits: gradients of small losses underflow to zero unless the loss is multiplied by a
scale before backward and the gradients divided by it before the update (Micikevicius et al. 2018, "Mixed
Precision Training", sec. 3.2). Dynamic scaling skips a step whose gradients hold an inf or NaN and halves
the scale, and doubles it after `GROWTH_INTERVAL` clean steps. Each library does it its own way:

- torch (plain, DataParallel, DDP, FSDP2, tp, fsdp2-tp): `torch.amp.GradScaler` around autocast fp16, the
  gradients unscaled (`unscale_`) before the reduced gradients are read and the update (torch's AMP recipe);
- Horovod: the same scaler, with `optimizer.synchronize()` before `unscale_` and `skip_synchronize()` around
  the scaler's step (horovod's examples/pytorch/pytorch_mnist.py);
- DeepSpeed on a GPU: its `fp16` section (fp16 weights, fp32 master copies, its own dynamic scaler, set below
  to torch's rule); on a CPU, where DeepSpeed refuses that section, its `torch_autocast` section with
  float16, whose GradScaler DeepSpeed makes itself (torch's default initial scale, 2^16; no setting reaches
  it). Under ZeRO-1/2/3 its overflow check returns before that scaler's `update()`, so the scale never
  falls (deepspeed/runtime/zero/stage_1_and_2.py, 0.19.8, `step`): an overflow that recurred at that scale
  would skip every later step. Measured here, a planted one left the scale at 2^16 and the later steps applied;
  the gradients read between reduction and update still carry the scale, which parity names.

The initial scale is low (2^10, not torch's 2^16) so that a tiny model does not spend its warm-up halving
the scale. Every row of an fp16 cell records, per step (warm-up included, as `loss_per_step`), whether the
optimizer step was applied on every rank and the scale the step's loss was multiplied by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from harness.spec import Precision, RunSpec

INITIAL_SCALE = 2.0 ** 10
GROWTH_INTERVAL = 2000          # torch's default; DeepSpeed's fp16 section's `loss_scale_window` is set to it
BACKOFF_FACTOR = 0.5            # torch's default and DeepSpeed's fixed factor


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did under loss scaling: applied (or skipped on an inf/NaN gradient), and the
    scale that step's losses were multiplied by."""

    applied: bool
    loss_scale: float


def grad_scaler(device: torch.device, mixed_tensors: bool = False) -> torch.amp.GradScaler:
    """torch's dynamic loss scaler with parbench's initial scale and torch's own backoff and growth; for tensor
    parallelism (`mixed_tensors`), the scaler that unscales local tensors and shares its verdict over every rank."""
    kind = LocalTensorGradScaler if mixed_tensors else torch.amp.GradScaler
    return kind(device.type, init_scale=INITIAL_SCALE, growth_factor=2.0, backoff_factor=BACKOFF_FACTOR,
                growth_interval=GROWTH_INTERVAL)


def scaler_for(spec: RunSpec, device: torch.device, mixed_tensors: bool = False) -> torch.amp.GradScaler | None:
    """`grad_scaler` for an fp16 cell, None for every other precision."""
    return grad_scaler(device, mixed_tensors) if spec.precision is Precision.FP16 else None


class LocalTensorGradScaler(torch.amp.GradScaler):
    """torch's GradScaler for tensor parallelism. Its parameters are partly DTensors (the split layers) and, under
    `tp`, partly plain tensors (what it leaves whole), and torch's fused unscale kernel refuses a list mixing the
    two ("got mixed torch.Tensor and DTensor", torch 2.13): each gradient is unscaled through its local tensor.
    The inf/NaN verdict is then summed over every rank, so that an overflow in one rank's shard skips the step on
    all of them (as torch's ShardedGradScaler does for FSDP1); under fsdp2-tp torch's own scaler left the other
    tp rank stepping (measured: `overflow:tensors=*.c_fc.weight:rank=0`)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        stand_ins = []
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                stand_in = _local(parameter).detach()
                stand_in.grad = _local(parameter.grad)      # a view: unscaling it unscales the gradient
                stand_ins.append(stand_in)
        found = super()._unscale_grads_(SimpleNamespace(param_groups=[{"params": stand_ins}]), inv_scale,
                                        found_inf, allow_fp16)
        if torch.distributed.is_initialized():
            for flag in found.values():
                torch.distributed.all_reduce(flag)
        return found


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> StepOutcome:
    """`scaler.step` then `scaler.update`: the step is skipped where `unscale_` found an inf or NaN, and then
    (and only then) the scale falls by BACKOFF_FACTOR (torch.amp.GradScaler.update), which is how a skip is
    read here without the scaler's private state. A scale already at 0 (or not finite) cannot fall: every step
    at it is skipped (a zero scale unscales by inf)."""
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    usable = 0 < before < math.inf
    return StepOutcome(applied=usable and not scaler.get_scale() < before, loss_scale=before)


def deepspeed_fp16_config() -> dict[str, Any]:
    """DeepSpeed's `fp16` section (GPU only) with torch's rule: dynamic (`loss_scale` 0), INITIAL_SCALE,
    growth after GROWTH_INTERVAL clean steps, and the scale lowered at the first overflow (`hysteresis` 1;
    DeepSpeed's default 2 skips the first overflow without lowering it)."""
    return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": int(INITIAL_SCALE).bit_length() - 1,
                     "loss_scale_window": GROWTH_INTERVAL, "hysteresis": 1, "min_loss_scale": 1}}


def deepspeed_step_outcome(engine: Any, skipped_before: int, scale_before: float) -> StepOutcome:
    """What a DeepSpeed engine's step did: skipped where the engine counted a skip (its fp16 and ZeRO
    optimizers' overflow flag, `engine.skipped_steps`) or where the GradScaler it keeps for ZeRO stage 0
    under torch_autocast lowered its scale (that scaler skips without telling the engine)."""
    applied = engine.skipped_steps == skipped_before and not deepspeed_loss_scale(engine) < scale_before
    return StepOutcome(applied=applied, loss_scale=scale_before)


def deepspeed_autocast_scaler(engine: Any) -> Any:
    """The GradScaler of a DeepSpeed engine's torch_autocast section in float16 (ZeRO stage 0's, or the ZeRO
    optimizer's: the CPU's fp16 recipe), else None. It unscales only inside the optimizer's step."""
    return (getattr(engine, "torch_autocast_z0_gradscaler", None)
            or getattr(engine.optimizer, "torch_autocast_gradscaler", None))


def deepspeed_loss_scale(engine: Any) -> float:
    """The scale a DeepSpeed engine multiplies the next loss by: its torch_autocast GradScaler's (ZeRO stage 0,
    or the ZeRO optimizer's), else its fp16 optimizer's `cur_scale`."""
    scaler = deepspeed_autocast_scaler(engine)
    if scaler is not None:
        return float(scaler.get_scale())
    return float(getattr(engine.optimizer, "cur_scale", getattr(engine.optimizer, "loss_scale", 1.0)))
