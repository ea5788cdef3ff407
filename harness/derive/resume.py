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
.memory), a component of b bytes per parameter that each of the data-parallel ranks holds 1/s of is held
data_parallel / s times over, so the job's unique bytes are

    expected = sum over ranks r, components c held of  Psi_r x b_c / s_c / (data_parallel / s_c)

(Psi_r: the parameters rank r holds; a pipeline's stages hold different ones), plus, for DCP, the tied weight once
more: DCP writes every name of the state dict, and a tied weight has two (torch.save keeps a shared storage once).
The files add a fixed overhead per file and per tensor (pickle and zip headers, DCP's .metadata), measured here and
allowed as OVERHEAD_PER_FILE + OVERHEAD_PER_TENSOR x the model's tensors x 4 (a weight, two moments and a step
count) x the ranks that write a piece of each where the weights are sharded. The check holds where
|measured - expected| <= 5% of expected + that overhead.
"""

from __future__ import annotations

from typing import Any, Mapping

from harness.derive.parity import TOLERANCE, Quantity, arithmetic, deviations

SIZE_TOLERANCE = 0.05
# Measured on gpt-tiny (53 tensors, 236,928 parameters): torch.save 48 KB over the payload in one file; DeepSpeed
# 62-93 KB over 6-7 files (zero_to_fp32.py, zero_to_torch.py, `latest`, pickles); DCP 1.4-1.7 KB per written tensor
# piece and a 61 KB .metadata (docs/reliability.md).
OVERHEAD_PER_FILE = 64 * 1024
OVERHEAD_PER_TENSOR = 2 * 1024
STATE_TENSORS_PER_MODEL_TENSOR = 4      # a weight, AdamW's two moments and its step count
MATCH, MISMATCH, NOT_JUDGED = "match", "mismatch", "not judged"


def checkpoint_of(row: Mapping[str, Any]) -> Mapping[str, Any] | None:
    m = row.get("measurements") or {}
    return m.get("checkpoint")


def resume_check(row: Mapping[str, Any]) -> dict[str, Any]:
    """{verdict, failed, deviations, note}: the resumed steps against the uninterrupted run's."""
    m = row["measurements"]
    record, reference = m.get("checkpoint") or {}, m.get("resume_reference") or {}
    at = record.get("resumed_from_step")
    if at is None or not reference.get("loss_per_step"):
        return {"verdict": NOT_JUDGED, "failed": [], "deviations": {}, "note": "no resumed launch in this row"}
    probe, expected_probe = m.get("checkpoint_probe") or {}, reference.get("probe") or {}
    resumed = {"spec": row["spec"], "measurements": {**_norms(probe), "loss_per_step": m["loss_per_step"][at:],
                                                     "precision_recipe": m.get("precision_recipe"),
                                                     "gradient_reduce_dtypes": m.get("gradient_reduce_dtypes")}}
    uninterrupted = {"spec": row["spec"], "measurements": {**_norms(expected_probe),
                                                           "loss_per_step": reference["loss_per_step"][at:]}}
    tolerance = TOLERANCE[arithmetic(resumed)]
    found = deviations(resumed, uninterrupted)
    failed = [q.value for q, value in found.items() if q in tolerance and not value <= tolerance[q]]
    notes = []
    if probe.get("norms_unavailable_because"):
        notes.append(f"losses alone: {probe['norms_unavailable_because']}")
    if reference.get("world_size") != row["spec"]["world_size"]:
        notes.append(f"saved at {record.get('saved_at_world_size')} ranks, resumed at {row['spec']['world_size']}, "
                     f"held against the uninterrupted run at {reference.get('world_size')}")
    return {"verdict": MISMATCH if failed else MATCH, "failed": failed,
            "deviations": {q.value: value for q, value in found.items()}, "note": "; ".join(notes)}


def _norms(probe: Mapping[str, Any]) -> dict[str, Any]:
    keys = {q.value for q in Quantity} - {Quantity.FIRST_LOSS.value, Quantity.LATER_LOSSES.value}
    return {key: value for key, value in probe.items() if key in keys}


def expected_checkpoint_bytes(measurements: Mapping[str, Any]) -> float | None:
    """The job's unique bytes of the components the checkpoint holds, from the row's plan (the module docstring's
    formula), with DCP's second copy of a tied weight; None where the row has no plan or no checkpoint."""
    record, plan = measurements.get("checkpoint"), measurements.get("model_state_plan")
    held = measurements.get("parameters_held_by_rank")
    if not record or not plan or not held:
        return None
    # The job's unique bytes do not depend on how many ranks share them: a save at another world size (resharded on
    # load) holds what this launch's ranks hold.
    data_parallel = measurements.get("data_parallel") or len(held)
    total = 0.0
    for component in record.get("holds", ("weights", "optimizer")):
        state = plan[component]
        copies = data_parallel / state["sharded_over"]
        total += sum(psi * state["bytes_per_parameter"] / state["sharded_over"] / copies for psi in held)
    if record.get("method") == "dcp" and "weights" in record.get("holds", ()):
        total += record.get("tied_parameters", 0) * plan["weights"]["bytes_per_parameter"]
    return total


def checkpoint_size_check(measurements: Mapping[str, Any]) -> dict[str, Any] | None:
    """{measured, expected, allowed, holds}: the checkpoint's bytes against the plan's, within SIZE_TOLERANCE and the
    files' overhead (module docstring); None where either is missing."""
    record = measurements.get("checkpoint") or {}
    expected = expected_checkpoint_bytes(measurements)
    if expected is None or not record.get("bytes_by_rank"):
        return None
    measured = sum(record["bytes_by_rank"])
    files = sum(record.get("files_by_rank") or [0])
    plan = measurements["model_state_plan"]
    writers = (record.get("saved_at_world_size") or 1) if plan["weights"]["sharded_over"] > 1 else 1
    overhead = (OVERHEAD_PER_FILE * files + OVERHEAD_PER_TENSOR * record.get("model_tensors", 0)
                * STATE_TENSORS_PER_MODEL_TENSOR * writers)
    allowed = SIZE_TOLERANCE * expected + overhead
    return {"measured": measured, "expected": expected, "allowed": allowed, "holds": abs(measured - expected) <= allowed}


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
