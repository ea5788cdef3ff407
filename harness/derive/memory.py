"""Model-state memory per rank: the plan a strategy records, the bytes it predicts, and how they compare
with what the rank measured.

Model states are a rank's weights, gradients and optimizer state (Rajbhandari et al. 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", sec. 3.1 and 5.1). A strategy records
its plan in the row (`model_state_plan`): for each of the three, the bytes it keeps per parameter under
the precision recipe it ran and the number of ranks that component is sharded over. With Psi
parameters held by the rank (`parameters_held_by_rank`), the paper's per-rank figure is

    sum over weights, gradients, optimizer of  Psi x bytes / shards

which with the paper's mixed-precision Adam (2, 2, K = 12 bytes) and N_d data-parallel ranks gives
    baseline (2 + 2 + K) Psi;  P_os (2 + 2) Psi + K Psi / N_d;  P_os+g 2 Psi + (2 + K) Psi / N_d;
    P_os+g+p (2 + 2 + K) Psi / N_d          (sec. 5.1, fig. 1: 7.5B parameters, N_d = 64 -> 120, 31.4,
                                             16.6 and 1.9 GB).
Parameters a sharding strategy keeps whole beside their shard (`weights_kept_whole_parameters_by_rank`:
DeepSpeed ZeRO-3 keeps parameters below `stage3_param_persistence_threshold` gathered on every rank)
add their unsharded weight bytes.

Measured figures, read by the worker at the `gradients_ready` point of the last warm-up step
(docs/methodology.md, "Model-state memory, measured"): `model_state_census_bytes_by_rank` counts the distinct
storages of the three kinds the rank holds; `model_state_bytes_measured_by_rank` (CUDA only) is the
allocator's figure. Rows of schema 1 hold no plan: their stored `model_state_bytes_predicted` is returned
as it was, labelled as such.

Torch-free: standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

COMPONENTS = ("weights", "gradients", "optimizer")

# Where each prediction came from, recorded beside it.
FROM_PLAN = "the strategy's model_state_plan x parameters held (ZeRO paper, sec. 5.1)"
STORED_SCHEMA_1 = "stored by the rank (schema 1: whole model / pipeline stages, ZeRO stage by strategy name)"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedState:
    """One model-state component: bytes per parameter, the ranks each holding 1/sharded_over of it, and whether
    it is kept in host memory rather than on the device (harness.strategies.offload)."""

    bytes_per_parameter: float
    sharded_over: int = 1
    on_host: bool = False

    def __post_init__(self) -> None:
        if self.bytes_per_parameter < 0:
            raise ValueError(f"bytes_per_parameter must be >= 0, got {self.bytes_per_parameter}")
        if self.sharded_over < 1:
            raise ValueError(f"sharded_over must be >= 1, got {self.sharded_over}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelStatePlan:
    """What one rank keeps per parameter of weights, gradients and optimizer state, and how sharded."""

    weights: ShardedState
    gradients: ShardedState
    optimizer: ShardedState
    basis: str              # one line: what the bytes are, with the source they follow

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {name: {"bytes_per_parameter": getattr(self, name).bytes_per_parameter,
                                       "sharded_over": getattr(self, name).sharded_over,
                                       "on_host": getattr(self, name).on_host} for name in COMPONENTS}
        data["basis"] = self.basis
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelStatePlan":
        return cls(**{name: ShardedState(**data[name]) for name in COMPONENTS}, basis=data.get("basis", ""))


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSplit:
    """How a layout divides a model among its ranks: `data_parallel` replicas, each of `tensor_parallel` ranks that
    split every block's layers, times `pipeline_stages` stages that cut the layers between them. A strategy says
    how it lays out a layout the user describes (`Strategy.model_split`); a rank's model states are its plan over
    `data_parallel` ranks of the parameters one rank of a replica holds."""

    data_parallel: int
    tensor_parallel: int = 1
    pipeline_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("data_parallel", "tensor_parallel", "pipeline_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def ranks(self) -> int:
        return self.data_parallel * self.tensor_parallel * self.pipeline_stages

    def evenly_held(self, parameters: int) -> float:
        """Psi of one rank of a model known only by its parameter count: an even cut over the stages, and every
        parameter split over the tensor-parallel ranks. A real model keeps its embeddings, norms and row-parallel
        biases whole on every tp rank, and a stage holding a tied weight's copy holds more: a run's row records the
        rank's own count (`parameters_held_by_rank`)."""
        return parameters / (self.tensor_parallel * self.pipeline_stages)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankParameters:
    """What one rank of a described layout holds, for the memory a strategy keeps beyond its model states
    (`Strategy.working_memory_bytes`, harness.project.rank_memory): parameter counts before any data-parallel
    sharding, as the rank's tensor-parallel and pipeline share of the model."""

    held: float                 # every parameter the rank holds
    unit: float                 # one block as the rank holds it: what a sharded unit gathers at once
    outside_blocks: float       # the embeddings, the final norm and the head as the rank holds them
    largest_module: float       # the most parameters one module holds (a block, or a vocabulary matrix)
    data_parallel: int
    micro_batches: int


def zero_plan(stage: int, data_parallel: int, weights: float, gradients: float, optimizer: float,
              basis: str) -> ModelStatePlan:
    """The paper's partitioning (sec. 5.1): stage 1 shards the optimizer state over the N_d data-parallel
    ranks (P_os), stage 2 also the gradients (P_os+g), stage 3 also the weights (P_os+g+p); stage 0 is
    the unsharded data-parallel baseline."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    return ModelStatePlan(
        weights=ShardedState(bytes_per_parameter=weights, sharded_over=data_parallel if stage >= 3 else 1),
        gradients=ShardedState(bytes_per_parameter=gradients, sharded_over=data_parallel if stage >= 2 else 1),
        optimizer=ShardedState(bytes_per_parameter=optimizer, sharded_over=data_parallel if stage >= 1 else 1),
        basis=basis)


def offloaded_to_host(plan: ModelStatePlan, *components: str) -> ModelStatePlan:
    """`plan` with `components` kept in host memory (ZeRO-Offload, FSDP2's CPUOffloadPolicy)."""
    moved = {name: dataclasses.replace(getattr(plan, name), on_host=True) for name in components}
    return dataclasses.replace(plan, **moved, basis=f"{plan.basis}; {', '.join(components)} on the host")


def plan_bytes(plan: ModelStatePlan, parameters: float, kept_whole: int = 0) -> dict[str, float]:
    """Bytes of each component for a rank holding `parameters` (Psi), `kept_whole` of which are also kept
    unsharded beside their weight shard; `total` is what the device holds, `host` what offload keeps on the host."""
    figures = {name: parameters * getattr(plan, name).bytes_per_parameter / getattr(plan, name).sharded_over
               for name in COMPONENTS}
    # Parameters kept whole beside their shard stay gathered on the device, even where the shards are on the host
    # (ZeRO-3's persistent parameters under offload_param: deepspeed/runtime/zero/partition_parameters.py).
    whole = kept_whole * plan.weights.bytes_per_parameter if plan.weights.sharded_over > 1 else 0
    figures["weights"] += whole
    figures["total"] = sum(figures[name] for name in COMPONENTS if not getattr(plan, name).on_host)
    figures["host"] = sum(figures[name] for name in COMPONENTS if getattr(plan, name).on_host)
    if plan.weights.on_host:
        figures["total"] += whole
        figures["host"] -= whole
    return figures


def _added(first: Mapping[str, float], second: Mapping[str, float]) -> dict[str, float]:
    return {name: first[name] + second[name] for name in first}


def predicted_model_states(measurements: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Predicted model-state bytes of each rank ({weights, gradients, optimizer, total, source}), from the
    row's plan and the parameters each rank held; for a schema-1 row its stored figure (total only, the
    same for every rank); None where the row has neither."""
    plan_data = measurements.get("model_state_plan")
    held = measurements.get("parameters_held_by_rank")
    if plan_data and held:
        plan = ModelStatePlan.from_dict(plan_data)
        kept = measurements.get("weights_kept_whole_parameters_by_rank") or [0] * len(held)
        experts_plan = measurements.get("expert_model_state_plan")
        if experts_plan:
            # An expert-parallel row: the dense parameters under the plan over every data-parallel rank, the rank's
            # experts under the plan over the ranks holding the same experts.
            experts = ModelStatePlan.from_dict(experts_plan)
            return [{**_added(plan_bytes(plan, parameters - own), plan_bytes(experts, own)), "source": FROM_PLAN}
                    for parameters, own in zip(held, measurements["expert_parameters_held_by_rank"])]
        return [{**plan_bytes(plan, parameters, whole), "source": FROM_PLAN}
                for parameters, whole in zip(held, kept)]
    stored = measurements.get("model_state_bytes_predicted")
    if stored is None:
        return None
    ranks = len(measurements.get("peak_rss_bytes_by_rank") or [None])
    return [{"total": float(stored), "source": STORED_SCHEMA_1} for _ in range(ranks)]


def model_state_comparison(measurements: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Per rank: the prediction, the census and the allocator's figure (CUDA), and each measured figure
    over the prediction of the same components. A census component the rank could not read (None: the
    pipeline's gradients, freed inside `train_batch`) is left out of both sides of its ratio. None where
    there is no prediction or nothing was measured."""
    predicted = predicted_model_states(measurements)
    census = measurements.get("model_state_census_bytes_by_rank")
    allocated = measurements.get("model_state_bytes_measured_by_rank")
    if predicted is None or (census is None and allocated is None):
        return None
    lines = []
    for rank, prediction in enumerate(predicted):
        line: dict[str, Any] = {"rank": rank, "predicted": prediction,
                                "read_at": measurements.get("model_state_read_at")}
        if census is not None and rank < len(census):
            counted = census[rank]
            read = [name for name in COMPONENTS if counted.get(name) is not None]
            line["census"] = {**counted, "total": sum(counted[name] for name in read)}
            if all(name in prediction for name in read):
                expected = sum(prediction[name] for name in read)
                line["census_over_predicted"] = line["census"]["total"] / expected if expected else None
                line["census_components"] = read
        if allocated is not None and rank < len(allocated):
            line["allocated"] = allocated[rank]
            line["allocated_over_predicted"] = (allocated[rank] / prediction["total"]
                                                if prediction["total"] else None)
        lines.append(line)
    return lines


def memory_columns(measurements: Mapping[str, Any]) -> dict[str, float | None]:
    """One-number memory figures of a row for tables (largest rank): predicted, census and allocator's
    model-state bytes."""
    predicted = predicted_model_states(measurements)
    census = measurements.get("model_state_census_bytes_by_rank")
    allocated = measurements.get("model_state_bytes_measured_by_rank")
    return {
        "model_state_bytes_predicted": max(p["total"] for p in predicted) if predicted else None,
        "model_state_census_bytes_max": (max(sum(v for v in c.values() if v is not None) for c in census)
                                         if census else None),
        "model_state_bytes_measured_max": max(allocated) if allocated else None,
    }
