"""What a memory technique bought and cost, from a row's raw figures: activation checkpointing's saved-for-backward
bytes and its recompute cost, activation offload's traffic to the host, and fp16's skipped steps.

    saved-for-backward bytes = max over ranks of the census's peak (harness.rank.saved_activations)
    host bytes per step      = 2 x max over ranks of the bytes save_on_cpu packed in a step (out in forward,
                               back in backward; harness.strategies.offload)
    skipped steps            = optimizer steps not applied on every rank (fp16, harness.strategies.loss_scaling)
    activations by allocator = max over ranks of (peak allocated - model states allocated)     (GPU only)
    recompute cost           = median over pairs of (checkpointed_i / kept_i) - 1     (harness.rank.recompute_pass)

Each pair i of the recompute pass ran the same micro-batches forward and backward with the cell's checkpointing
and without it, back to back, so the ratio of a pair cancels what the host did to both; the median over pairs and
their range are reported, never a single pair. A checkpointed block runs its forward twice: with every block
checkpointed, the cost is about the blocks' forward over the whole forward and backward, a third where backward
costs twice forward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": one extra forward).
"""

from __future__ import annotations

from statistics import median
from typing import Any, Mapping


def techniques_on(m: Mapping[str, Any]) -> tuple[str, ...]:
    """The memory techniques a row ran with (its recorded settings; none in rows from before they existed): parity
    holds the plain loop with one on against the loop without (harness.derive.parity)."""
    settings = {name: m.get(name) or "none" for name in ("activation_checkpointing", "activation_offload")}
    return tuple(f"{name}={value}" for name, value in settings.items() if value != "none")


def saved_activation_bytes(m: Mapping[str, Any]) -> int | None:
    """The largest rank's saved-for-backward peak, or None where the row has none."""
    by_rank = m.get("saved_activation_bytes_by_rank")
    if not by_rank or any(value is None for value in by_rank):
        return None
    return max(by_rank)


def allocator_activation_bytes(m: Mapping[str, Any]) -> float | None:
    """On a GPU, what the allocator's peak over the timed steps held beyond the model states it held at
    gradients_ready, the largest rank's: activations, plus whatever else the step allocates (communication buffers,
    the allocator's rounding); None off a GPU or where either reading is missing."""
    peaks, states = m.get("peak_allocated_bytes_by_rank"), m.get("model_state_bytes_measured_by_rank")
    if not peaks or not states or len(peaks) != len(states) or any(v is None for v in (*peaks, *states)):
        return None
    return max(peak - state for peak, state in zip(peaks, states))


def recompute_cost(m: Mapping[str, Any]) -> dict[str, float | None]:
    """{"recompute_cost": median of the pairs' extra fraction, "recompute_cost_low"/"_high": their range}; all None
    where the row checkpoints nothing or its pass did not run."""
    checkpointed, kept = m.get("recompute_checkpointed_step_time_s"), m.get("recompute_kept_step_time_s")
    if not checkpointed or not kept or len(checkpointed) != len(kept) or min(kept) <= 0:
        return {"recompute_cost": None, "recompute_cost_low": None, "recompute_cost_high": None}
    extra = [with_ / without - 1 for with_, without in zip(checkpointed, kept)]
    return {"recompute_cost": median(extra), "recompute_cost_low": min(extra), "recompute_cost_high": max(extra)}


def host_bytes_per_step(m: Mapping[str, Any]) -> int | None:
    """Activation offload's traffic between device and host in a step, the busiest rank's; None without it."""
    by_rank = m.get("activation_offload_bytes_by_rank")
    if not by_rank or any(value is None for value in by_rank):
        return None
    return 2 * max(by_rank)


def skipped_steps(m: Mapping[str, Any]) -> int | None:
    """fp16: optimizer steps (warm-up included) some rank skipped; None for rows without loss scaling."""
    applied = m.get("optimizer_step_applied")
    return None if applied is None else sum(1 for done in applied if not done)


def technique_columns(m: Mapping[str, Any]) -> dict[str, Any]:
    """A launch's technique figures, as `harness.derive.cells` tables them."""
    return {"activation_checkpointing": m.get("activation_checkpointing", "none"),
            "activation_offload": m.get("activation_offload", "none"),
            "saved_activation_bytes": saved_activation_bytes(m),
            "allocator_activation_bytes": allocator_activation_bytes(m), **recompute_cost(m),
            "host_bytes_per_step": host_bytes_per_step(m), "optimizer_steps_skipped": skipped_steps(m)}
