"""The (dp, tp) layout that `fsdp2-tp` and `autotp` share: `tp` neighbouring ranks split each block (one node's
GPUs), `world_size / tp` replicas across them, laid out row-major as `init_device_mesh` and DeepSpeed's
`_init_tp_mesh_device` both do (rank = replica x tp + tp index), so a replica's tp ranks see the same samples."""

from __future__ import annotations

import math

from harness.derive.memory import ModelSplit
from harness.spec import DeviceKind, Layout, RunSpec, SpecError
from workloads import Family, get_workload


def blocks_refusal(workload_name: str) -> str | None:
    """Why tensor parallelism cannot split a workload's blocks (its layouts split GPT and Llama blocks), or None."""
    if get_workload(workload_name).family in (Family.GPT, Family.LLAMA):
        return None
    return f"tensor parallelism splits transformer blocks; {workload_name} has none"


def heads_refusal(workload_name: str, tp: int) -> str | None:
    """Why tensor parallelism of `tp` cannot split a transformer workload's heads, or None: each rank holds whole
    heads, and under grouped-query attention whole key/value heads too, the ones its query heads read; Llama's
    SwiGLU width splits as well (gate and up alike)."""
    config = get_workload(workload_name).config
    kv_heads = getattr(config, "n_kv_head", None)
    if kv_heads is None:
        if config.n_head % tp:
            return f"tensor parallelism of {tp} must divide {workload_name}'s {config.n_head} heads"
        return None
    if config.n_head % tp or kv_heads % tp:
        both = math.gcd(config.n_head, kv_heads)
        allowed = [degree for degree in range(1, both + 1) if both % degree == 0]
        return (f"tensor parallelism of {tp} must divide {workload_name}'s {config.n_head} heads and {kv_heads} "
                f"key/value heads (allowed: {', '.join(map(str, allowed))})")
    if config.intermediate_size % tp:
        return (f"tensor parallelism of {tp} must divide {workload_name}'s SwiGLU width of "
                f"{config.intermediate_size}")
    return None


class MeshLayout:
    """Strategy methods of a (dp, tp) mesh over the `tp` option (a mixin before `Strategy` in the bases)."""

    name: str

    def tp_degree(self, spec: RunSpec) -> int:
        return self.resolved(spec)["tp"]

    def validate(self, spec: RunSpec) -> None:
        tp = self.tp_degree(spec)
        if spec.world_size % tp:
            raise SpecError(f"{self.name}: tp={tp} must divide world_size {spec.world_size} (tp x dp = world size)")
        if spec.global_batch % ((spec.world_size // tp) * spec.micro_batch):
            raise SpecError(f"{self.name}: global_batch {spec.global_batch} must be divisible by dp x micro_batch = "
                            f"{spec.world_size // tp} x {spec.micro_batch}")

    def layout_refusal(self, spec: RunSpec) -> str | None:
        tp = self.tp_degree(spec)
        why = blocks_refusal(spec.workload) or heads_refusal(spec.workload, tp)
        if why:
            return why
        if spec.device is DeviceKind.CUDA and (spec.world_size // spec.nnodes) % tp:
            return (f"tp={tp} must divide the {spec.world_size // spec.nnodes} GPUs per node: tensor "
                    "parallelism's all-reduces sit inside every layer and stay within a node")
        return None

    def model_split(self, replicas, tensor_parallel, options) -> ModelSplit:
        """`replicas` replicas of the `tp` option's ranks (the `tp` strategy's own degree, `tensor_parallel`, is not
        this strategy's)."""
        return ModelSplit(data_parallel=replicas, tensor_parallel=options["tp"])

    def layout(self, spec: RunSpec) -> Layout:
        replicas = spec.world_size // self.tp_degree(spec)
        per_replica = spec.global_batch // replicas
        return Layout(data_parallel=replicas, pipeline_stages=1, per_replica_batch=per_replica,
                      micro_batches=max(1, per_replica // spec.micro_batch))

    def replica(self, spec, context) -> int:
        return context.rank // self.tp_degree(spec)      # the mesh's row: the tp ranks of a replica share samples
