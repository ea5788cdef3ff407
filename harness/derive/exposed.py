"""Exposed communication from a row: the real step's time beyond a communication-free run of the same work.

    python -c "from harness.derive.exposed import exposed_communication as e; print(e(ROW_MEASUREMENTS))"

Definition (parbench since its first release: harness/rank/worker.py `_communication` and README "Exposed
communication" at b2b0cbe; the usual "step time minus compute time" of overlap studies):
    exposed = median(unstalled real steps) - median(unstalled compute-only steps)
    share   = exposed / median(unstalled real steps)
A step is a synchronous step's slowest rank; a step is left out of a pass when the host stalled it on
any rank (harness.rank.timing), because a stall lands on one pass and not the other and would otherwise decide
the difference.

The compute-only pass (harness.rank.compute_only, run by each rank after its timed steps) records what kind
of baseline it was: "same work" (the rank's own forward, backward and optimizer step over its own share
of the parameters, in the real recipe's dtypes) or "bound: <why>" where the rank's work could not be
mirrored (a CPU-offloaded optimizer step, say): then the exposed figure also holds that difference and
is labelled with it. A negative share is reported as measured, never clipped, with a note saying
whether it lies within the steps' spread (noise: no exposed communication measurable) or beyond it (the
baseline was slower than the real step, so the figure says nothing about communication).

At world size 1 nothing is communicated, and the same difference is the strategy's own work beyond the bare
compute (ZeRO-3's parameter bookkeeping, DDP's bucket copies, DeepSpeed's flattening): `exposed_columns`
shows it there as `framework_overhead_*`, never as exposed communication. At >= 2 ranks the exposed figure
holds that overhead too; harness.derive.beyond_ws1 gives the step beyond the strategy's own world-size-1
step, which leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any, Mapping, Sequence

SAME_WORK = "same work"
BOUND_PREFIX = "bound: "
SCHEMA_1_KIND = ("unrecorded: schema-1 row, whose baseline ran the unwrapped model and a full AdamW step on "
                 "every rank")


@dataclass(frozen=True, kw_only=True)
class ExposedCommunication:
    exposed_comm_s: float | None
    exposed_comm_share: float | None
    compute_only_kind: str | None       # "same work", "bound: <why>", or None where there was no baseline
    note: str                           # why there is no figure, or what a negative one means; else ""

    def columns(self) -> dict[str, Any]:
        return {"exposed_comm_s": self.exposed_comm_s, "exposed_comm_share": self.exposed_comm_share,
                "compute_only_kind": self.compute_only_kind, "exposed_comm_note": self.note}


def exposed_communication(measurements: Mapping[str, Any], subject: str = "communication") -> ExposedCommunication:
    """Exposed communication time and share of one row (see the module docstring); `subject` words a
    negative figure's note (negative_note)."""
    if "compute_only_step_time_s_by_rank" not in measurements:
        return _schema_1(measurements)
    kind = measurements.get("compute_only_kind")
    compute_by_rank = measurements["compute_only_step_time_s_by_rank"]
    if compute_by_rank is None:
        return ExposedCommunication(exposed_comm_s=None, exposed_comm_share=None, compute_only_kind=None,
                                    note=measurements.get("compute_only_unavailable_because", ""))
    compute = _unstalled(slowest_rank_per_step(compute_by_rank),
                         stalled_steps(measurements["compute_only_host_stalled_by_rank"]))
    real = _unstalled(measurements["step_time_s"], set(measurements.get("host_stalled_step_indices") or ()))
    if not real or not compute:
        return ExposedCommunication(exposed_comm_s=None, exposed_comm_share=None, compute_only_kind=kind,
                                    note="the host stalled every step of a pass")
    step, baseline = median(real), median(compute)
    exposed = step - baseline
    note = negative_note(exposed, real, compute, subject) if exposed < 0 else ""
    return ExposedCommunication(exposed_comm_s=exposed, exposed_comm_share=exposed / step, compute_only_kind=kind,
                                note=note)


def negative_note(exposed_s: float, real: Sequence[float], compute: Sequence[float],
                  subject: str = "communication") -> str:
    """What a negative exposed time means, judged against the spread (max - min) of each pass's steps;
    `subject` is what the figure stands for (communication; at world size 1 the framework's overhead)."""
    spread = max(max(real) - min(real), max(compute) - min(compute))
    measured = (f"the compute-only median exceeds the real step's by {-exposed_s * 1e3:.3g} ms, "
                f"steps spread {spread * 1e3:.3g} ms")
    figure = "exposed communication" if subject == "communication" else subject
    if -exposed_s <= spread:
        return f"negative within noise: {measured}; no {figure} measurable"
    return (f"negative beyond noise: {measured}; the baseline was slower than the real step, so this says "
            f"nothing about {subject}")


FRAMEWORK_OVERHEAD = "framework overhead"
WORLD_SIZE_1 = "world size 1: nothing is communicated (the step beyond the compute-only pass is framework_overhead)"


def exposed_columns(measurements: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """The row's step beyond its compute-only pass under the name that says what it is: exposed
    communication at >= 2 ranks, the framework's own overhead at world size 1 (module docstring)."""
    if world_size >= 2:
        return {**exposed_communication(measurements).columns(), "framework_overhead_s": None,
                "framework_overhead_share": None, "framework_overhead_note": ""}
    figure = exposed_communication(measurements, subject=FRAMEWORK_OVERHEAD)
    return {"exposed_comm_s": None, "exposed_comm_share": None, "compute_only_kind": figure.compute_only_kind,
            "exposed_comm_note": WORLD_SIZE_1 if figure.exposed_comm_s is not None else figure.note,
            "framework_overhead_s": figure.exposed_comm_s, "framework_overhead_share": figure.exposed_comm_share,
            "framework_overhead_note": figure.note}


def slowest_rank_per_step(times_by_rank: Sequence[Sequence[float]]) -> list[float]:
    """A synchronous step ends when its slowest rank ends."""
    return [max(per_rank) for per_rank in zip(*times_by_rank)]


def stalled_steps(stalled_by_rank: Sequence[Sequence[bool]]) -> set[int]:
    """Steps the host stalled on any rank: a synchronous step waits for its slowest rank."""
    return {step for step, flags in enumerate(zip(*stalled_by_rank)) if any(flags)}


def _unstalled(times: Sequence[float], stalled: set[int]) -> list[float]:
    return [t for i, t in enumerate(times) if i not in stalled]


def _schema_1(measurements: Mapping[str, Any]) -> ExposedCommunication:
    """Rows written before the baseline's per-rank times were kept carry the figure the worker computed;
    which steps of their baseline stalled was not recorded, so it cannot be recomputed."""
    exposed = measurements.get("exposed_comm_s")
    if exposed is None:
        return ExposedCommunication(exposed_comm_s=None, exposed_comm_share=None, compute_only_kind=None,
                                    note=measurements.get("exposed_comm_unavailable_because", ""))
    note = ""
    if exposed < 0:
        note = "negative: the schema-1 baseline was slower than the real step (not recomputable from this row)"
    return ExposedCommunication(exposed_comm_s=exposed, exposed_comm_share=measurements.get("exposed_comm_share"),
                                compute_only_kind=SCHEMA_1_KIND, note=note)
