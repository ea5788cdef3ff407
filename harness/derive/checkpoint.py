"""What one checkpoint of a job holds: per parameter from a strategy's model-state plan, or as a row measured it.

    python -c "from harness.derive.memory import zero_plan; from harness.derive.checkpoint import held_once; \\
        print(held_once(zero_plan(0, 8, 4, 4, 8, basis='torch AdamW'), ('weights', 'optimizer')))"

A checkpoint holds the model-state components its strategy writes (`Strategy.checkpoint_holds`: weights and
optimizer state, never gradients, which the next step makes again; ZeRO-3 its optimizer's fp32 partitions alone),
each once over the job. From a plan (harness.derive.memory), a component of b bytes a parameter sharded over s
ranks keeps Psi b / s on each of them, s x Psi b / s = Psi b in all, and a component kept whole on every rank is
saved from one of them: Psi b either way (harness.derive.resume's `expected_checkpoint_bytes` is the same sum over
a measured row's ranks).

A measured save (`measurements["checkpoint"]`, a checkpoint cell's: harness.rank.checkpointed_run): its tensor bytes
(`tensor_bytes_by_rank`, the state without the files' formats: harness.derive.resume) added up over the row's
`measurements["parameters"]`, the model's parameter count, is its bytes a parameter; a row from before they were
read gives every file's bytes, the formats' fixed overhead included, which on a small model reads a little high.

Torch-free: standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from harness.derive.memory import COMPONENTS, ModelStatePlan


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointContents:
    """Bytes a checkpoint holds per parameter of the model, and what they are, with their source."""

    bytes_per_parameter: float
    basis: str

    def __post_init__(self) -> None:
        if not self.bytes_per_parameter > 0:
            raise ValueError(f"bytes_per_parameter must be > 0, got {self.bytes_per_parameter}")


def held_once(plan: ModelStatePlan, components: Sequence[str]) -> CheckpointContents:
    """The `components` of `plan`, each once over the job (the module docstring)."""
    per_parameter = {name: getattr(plan, name).bytes_per_parameter for name in components}
    sum_text = " + ".join(f"{per_parameter[name]:g} {name}" for name in components)
    unsaved = ", ".join(name for name in COMPONENTS if name not in components)
    return CheckpointContents(bytes_per_parameter=sum(per_parameter.values()),
                              basis=f"{sum_text}, each once over the job (not saved: {unsaved}), by the model-state "
                                    f"plan ({plan.basis})")


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredCheckpoint:
    """A save one row measured (`measurements["checkpoint"]`)."""

    method: str                 # "dcp", "deepspeed", "horovod rank 0", "torch.save"
    step: int | None
    world_size: int
    total_bytes: float          # sum of bytes_by_rank
    parameters: int             # the model's (measurements["parameters"])
    save_s: float | None        # the slowest rank's save

    @property
    def bytes_per_parameter(self) -> float:
        return self.total_bytes / self.parameters

    def describe(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return (f"{self.method} save{at} on {self.world_size} ranks: {self.total_bytes:,.0f} B / {self.parameters:,} "
                f"parameters = {self.bytes_per_parameter:.4g} B a parameter")


def measured_checkpoint(measurements: Mapping[str, Any]) -> MeasuredCheckpoint | None:
    """The row's measured save, or None where it recorded none (rows from before the measurement was added, or
    of a cell that saved nothing), none that gives bytes a parameter (no bytes, or no parameter count), or a save
    with a planted fault (`planted`: one that leaves the optimizer out is not what the strategy saves)."""
    saved = measurements.get("checkpoint")
    parameters = measurements.get("parameters")
    if not isinstance(saved, Mapping) or not parameters or saved.get("planted"):
        return None
    # The state's own bytes where the row read them back (they grow with the model); else every file's, whose
    # formats' overhead is a fixed cost that a larger model would not multiply.
    sizes = [b for b in saved.get("tensor_bytes_by_rank") or saved.get("bytes_by_rank") or () if b is not None]
    if not sizes or sum(sizes) <= 0:
        return None
    times = [t for t in saved.get("save_s_by_rank") or () if t is not None]
    return MeasuredCheckpoint(method=str(saved.get("method", "unnamed")), step=saved.get("step"),
                              world_size=int(saved.get("saved_at_world_size") or saved.get("world_size") or len(sizes)),
                              total_bytes=float(sum(sizes)),
                              parameters=int(parameters), save_s=max(times) if times else None)
