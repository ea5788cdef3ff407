"""What a `checkpoint` cell's row says (harness.strategies.state_checkpoint): did the resumed steps reproduce the
uninterrupted run, what did saving and loading cost, and does the checkpoint hold the bytes the model-state plan says.

Resume. The resumed launch's losses of steps K, K+1, ... and its norms of step K (gradient, parameters after, update,
and each tensor's) are held against the uninterrupted launch's, with parity's quantities and tolerances
(harness.derive.parity: `deviations`, `TOLERANCE` of the row's arithmetic). A checkpoint that forgets AdamW's moments
gives step K another update; one that forgets the data position another gradient and loss.

Cost. A save blocks the job until its slowest rank returns: save_s = max over ranks of the blocking save time, and
GB/s = checkpoint bytes (all files, every rank's) / save_s / 1e9; load_s likewise. DCP's async_save (in the
uninterrupted launch) gives the time it blocked the loop (staging the state) and the time until its files were written,
each the slowest rank's. Recovery after a kill: from the
killed rank's last clock to the first step after the restart completing on every rank.

Size. A checkpoint holds weights and optimizer state once over the job, however the strategy spreads them (its
`holds`: ZeRO-3's holds the optimizer's fp32 partitions alone, which are its weights). From the plan (harness.derive
.memory: b_c bytes per parameter of component c) and the model's Psi parameters:

    expected = Psi x b_weights                      (where the checkpoint holds the weights)
             + Psi x b_optimizer                    (DCP, torch.save: each parameter's state once)
               or sum over ranks r of Psi_r x b_optimizer / s / (data_parallel / s)
                                                    (DeepSpeed: each rank's optimizer writes the state of the Psi_r
                                                     parameters it holds, a tied weight's on each pipeline stage)
             + tied x b_weights                     (DCP: a tied weight under each of its two names; torch.save keeps
                                                     a shared storage once, DeepSpeed's pipeline skips the tied copy)

The check holds the tensor bytes the files hold (`tensor_bytes_by_rank`: DCP's .metadata, torch.save's storages read
back) to within SIZE_TOLERANCE of that; the rest of the files' bytes is the formats' own overhead (headers, pickles,
DeepSpeed's zero_to_fp32.py, DCP's .metadata), reported beside it.
"""

from __future__ import annotations

from typing import Any, Mapping

from harness.derive.parity import TOLERANCE, Quantity, arithmetic, deviations, loss_deviations

SIZE_TOLERANCE = 0.05
MATCH, MISMATCH, NOT_JUDGED = "match", "mismatch", "not judged"


def resume_check(row: Mapping[str, Any]) -> dict[str, Any]:
    """{verdict, failed, deviations, note}: the resumed steps against the uninterrupted run's. `not judged` where the
    row resumed nothing (a planted kill that never fired, a row without its reference); `mismatch` where a quantity is
    beyond parity's tolerance, or the uninterrupted run read step K's norms and the resumed launch did not."""
    m = row["measurements"]
    record, reference = m.get("checkpoint") or {}, m.get("resume_reference") or {}
    at = record.get("resumed_from_step")
    if at is None or not reference.get("loss_per_step"):
        return _not_judged("no resumed launch in this row, or no uninterrupted run beside it")
    if record.get("role") == "restart" and record.get("killed_at_step") is None:
        return _not_judged("the planted kill never fired: nothing was restarted")
    probe, expected_probe = m.get("checkpoint_probe") or {}, reference.get("probe") or {}
    resumed = {"spec": row["spec"], "measurements": {**_norms(probe), "loss_per_step": m["loss_per_step"][at:],
                                                     "precision_recipe": m.get("precision_recipe"),
                                                     "gradient_reduce_dtypes": m.get("gradient_reduce_dtypes")}}
    uninterrupted = {"spec": row["spec"], "measurements": {**_norms(expected_probe),
                                                           "loss_per_step": reference["loss_per_step"][at:]}}
    tolerance = TOLERANCE[arithmetic(resumed)]
    found = deviations(resumed, uninterrupted)
    # Every resumed step, not parity's first four: a resume that drifts late is caught too.
    by_step = loss_deviations(resumed, uninterrupted, steps=len(resumed["measurements"]["loss_per_step"]))
    if by_step:
        found[Quantity.FIRST_LOSS] = by_step[0]
    if len(by_step) >= 2:
        found[Quantity.LATER_LOSSES] = max(by_step[1:])
    failed = [q.value for q, value in found.items() if q in tolerance and not value <= tolerance[q]]
    notes = []
    missing = sorted(set(_norms(expected_probe)) - set(_norms(probe)))
    if missing and not probe.get("norms_unavailable_because"):
        failed.append("norms missing")
        notes.append(f"the resumed launch did not read step {at}'s {', '.join(missing)}")
    if probe.get("norms_unavailable_because"):
        notes.append(f"losses alone: {probe['norms_unavailable_because']}")
    sizes = {record.get("saved_at_world_size"), record.get("resumed_at_world_size"), row["spec"]["world_size"]} - {None}
    if len(sizes) > 1:
        notes.append(f"saved at {record.get('saved_at_world_size')} ranks, resumed at "
                     f"{record.get('resumed_at_world_size')}, held against the uninterrupted run at "
                     f"{reference.get('world_size')}")
    if not found:
        return _not_judged("nothing to compare")
    return {"verdict": MISMATCH if failed else MATCH, "failed": failed,
            "deviations": {q.value: value for q, value in found.items()}, "note": "; ".join(notes)}


def _not_judged(note: str) -> dict[str, Any]:
    return {"verdict": NOT_JUDGED, "failed": [], "deviations": {}, "note": note}


def _norms(probe: Mapping[str, Any]) -> dict[str, Any]:
    keys = {q.value for q in Quantity} - {Quantity.FIRST_LOSS.value, Quantity.LATER_LOSSES.value}
    return {key: value for key, value in probe.items() if key in keys}


def expected_checkpoint_bytes(measurements: Mapping[str, Any]) -> float | None:
    """The tensor bytes the checkpoint should hold, from the row's plan (the module docstring's formula); None where the
    row has no plan, no parameter count or no checkpoint."""
    record, plan = measurements.get("checkpoint"), measurements.get("model_state_plan")
    held, parameters = measurements.get("parameters_held_by_rank"), measurements.get("parameters")
    if not record or not plan or not held or not parameters:
        return None
    holds = record.get("holds", ("weights", "optimizer"))
    weights, optimizer = plan["weights"]["bytes_per_parameter"], plan["optimizer"]
    total = parameters * weights if "weights" in holds else 0.0
    if "optimizer" in holds:
        if record.get("method") == "deepspeed":
            data_parallel = measurements.get("data_parallel") or len(held)
            copies = data_parallel / optimizer["sharded_over"]
            total += sum(psi * optimizer["bytes_per_parameter"] / optimizer["sharded_over"] / copies for psi in held)
        else:
            total += parameters * optimizer["bytes_per_parameter"]
    if record.get("method") == "dcp" and "weights" in holds:
        total += record.get("tied_parameters", 0) * weights
    return total


def checkpoint_size_check(measurements: Mapping[str, Any]) -> dict[str, Any] | None:
    """{measured, expected, written, overhead, holds}: the tensor bytes the checkpoint holds against the plan's, within
    SIZE_TOLERANCE, and the files' bytes beyond them (the formats' overhead); None where either side is missing."""
    record = measurements.get("checkpoint") or {}
    expected = expected_checkpoint_bytes(measurements)
    if expected is None or not record.get("tensor_bytes_by_rank"):
        return None
    measured = sum(record["tensor_bytes_by_rank"])
    written = sum(record.get("bytes_by_rank") or [0])
    return {"measured": measured, "expected": expected, "written": written, "overhead": written - measured,
            "holds": abs(measured - expected) <= SIZE_TOLERANCE * expected}


def checkpoint_columns(row: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint figures of a row's table line (harness.derive.cells); empty where it has no checkpoint."""
    m = row.get("measurements") or {}
    record = m.get("checkpoint")
    if not record:
        return {}
    save = [s for s in record.get("save_s_by_rank") or [] if s is not None]
    load = [s for s in record.get("load_s_by_rank") or [] if s is not None]
    written = sum(record.get("bytes_by_rank") or [0])
    save_s = max(save) if save else None
    size = checkpoint_size_check(m)
    check = resume_check(row)
    # DCP's async_save ran in the uninterrupted launch, beside its loop: what it blocked, and how long it wrote.
    saved_async = ((m.get("resume_reference") or {}).get("checkpoint") or {}) if "async_blocked_s_by_rank" not in record \
        else record
    return {"checkpoint_method": record.get("method"), "checkpoint_bytes": written,
            "checkpoint_files": sum(record.get("files_by_rank") or [0]),
            "checkpoint_save_s": save_s, "checkpoint_load_s": max(load) if load else None,
            "checkpoint_save_GBps": written / save_s / 1e9 if save_s else None,
            "checkpoint_tensor_bytes": size["measured"] if size else None,
            "checkpoint_bytes_expected": size["expected"] if size else None,
            "checkpoint_size_holds": size["holds"] if size else None,
            "resume": check["verdict"], "resume_failed": ", ".join(check["failed"]),
            "recovery_s": record.get("recovery_s"), "steps_recomputed": record.get("steps_recomputed"),
            "restarts": record.get("restarts"),
            "checkpoint_async_blocked_s": _slowest(saved_async.get("async_blocked_s_by_rank")),
            "checkpoint_async_write_s": _slowest(saved_async.get("async_write_s_by_rank"))}


def _slowest(values: list[float | None] | None) -> float | None:
    """A synchronous job waits for its slowest rank."""
    present = [v for v in values or [] if v is not None]
    return max(present) if present else None
