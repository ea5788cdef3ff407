"""PyTorch DataParallel: one process replicating the model over every visible GPU each step.

One process feeds the whole global batch; DataParallel scatters each micro-batch over the devices and
gathers the outputs on the first. Micro-batch in the spec is per device, as everywhere else, so the
process runs micro-batches of `micro_batch x world_size` samples built from the same sample indices the
replicas of a multi-process strategy would use. DataParallel is CUDA-only, and with fewer than two GPUs it
is a single-device loop, not parallel: such cells are skipped with that reason and never appear as a
scaling result.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.spec import DeviceKind, RunSpec, SpecError
from harness.strategies.base import ExpectedTraffic, RankContext, Strategy, place_rank
from harness.strategies.plain import plain_trainer
from harness.strategies.state_checkpoint import CHECKPOINT, OPTION_NAME as CHECKPOINT_NAME
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME, checkpointed_blocks, interval_of
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME


class DataParallel(Strategy):
    name = "dataparallel"
    launcher = "python"
    checkpoint_method = "torch.save"
    description = "torch.nn.DataParallel over the visible GPUs (one process)"
    comm_interception = "none: DataParallel copies through torch.cuda.comm, which is not intercepted"
    options = {OPTION_NAME: ACTIVATION_CHECKPOINTING, CHECKPOINT_NAME: CHECKPOINT,
               ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD, COMPILE_NAME: COMPILE}
    cannot_compile_because = ("DataParallel copies the module onto every GPU in each forward, and compiling those "
                              "replicas is not wired here")

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        return "one process drives every GPU; its scatter/gather is not separable from its compute"

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        return ExpectedTraffic(not_modelled_because="DataParallel scatters inputs, replicates weights and gathers "
                               "outputs and gradients through torch.cuda.comm copies, not process-group collectives")

    def validate(self, spec: RunSpec) -> None:
        if self.resolved(spec)[ACTIVATION_OFFLOAD_NAME] != "none":
            raise SpecError("strategy dataparallel cannot take activation_offload: its replicas run in threads, "
                            "which torch's save_on_cpu hook (thread-local) does not reach; use none")

    def skip_reason(self, spec: RunSpec, machine=None) -> str | None:
        if spec.device is not DeviceKind.CUDA:
            return "DataParallel replicates over CUDA devices only; on CPU it would not be parallel"
        # One process drives every replica: they are the GPUs of one node (a planned machine's, or this host's).
        gpus = torch.cuda.device_count() if machine is None else (
            machine.devices_per_node if machine.device is DeviceKind.CUDA else 0)
        if spec.world_size < 2:
            return "DataParallel over one device is not parallel (world size 1)"
        if gpus < spec.world_size:
            return f"DataParallel needs {spec.world_size} GPUs, {gpus} visible"
        return super().skip_reason(spec, machine)

    def start(self, spec: RunSpec) -> RankContext:
        device, _, _ = place_rank(spec.device, 0, 1)
        return RankContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device,
                           backend="none", shared_device=False)

    def sample_indices(self, spec, context, micro_batch_index):
        """All replicas' samples of this micro-batch, in replica order (DataParallel's scatter order)."""
        from workloads.data import rank_sample_indices

        layout = self.layout(spec)
        return torch.cat([rank_sample_indices(replica=replica, micro_batch_index=micro_batch_index,
                                              micro_batches=layout.micro_batches, micro_batch=spec.micro_batch)
                          for replica in range(spec.world_size)])

    def wrap(self, spec, context, workload, layers):
        layers = checkpointed_blocks(layers, interval_of(self.resolved(spec)))
        model = nn.DataParallel(nn.Sequential(*layers).to(context.device), device_ids=list(range(spec.world_size)))
        trainer = plain_trainer(spec, context, workload, model)
        trainer.config = {**trainer.config, "device_ids": list(range(spec.world_size))}
        return trainer
