"""The (dp, tp) layout that `fsdp2-tp` and `autotp` share: `tp` neighbouring ranks split each block (one node's
GPUs), `world_size / tp` replicas across them, laid out row-major as `init_device_mesh` and DeepSpeed's
`_init_tp_mesh_device` both do (rank = replica x tp + tp index), so a replica's tp ranks see the same samples."""

from __future__ import annotations

from harness.derive.memory import ModelSplit
from harness.spec import DeviceKind, Layout, RunSpec, SpecError
from workloads import Family, get_workload


def blocks_refusal(workload_name: str) -> str | None:
    """Why tensor parallelism cannot split a workload's blocks (its layouts name the GPT block's layers), or None."""
    family = get_workload(workload_name).family
    if family is Family.GPT:
        return None
    if family is Family.LLAMA:
        return (f"tensor parallelism has no layout of {workload_name}'s blocks (grouped-query attention's fused "
                "q|k|v, SwiGLU) yet: it splits GPT blocks only")
    return f"tensor parallelism splits transformer blocks; {workload_name} has none"


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
        workload, tp = get_workload(spec.workload), self.tp_degree(spec)
        if blocks_refusal(spec.workload):
            return blocks_refusal(spec.workload)
        if workload.config.n_head % tp:
            return f"tensor parallelism of {tp} must divide {spec.workload}'s {workload.config.n_head} heads"
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
