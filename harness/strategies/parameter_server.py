"""A synchronous parameter server on torch.distributed point to point, started by torchrun.

The model's trainable parameters (a tied weight once) are flattened in their order and cut into S contiguous
shards (the first N mod S one element longer). Server s holds shard s in fp32 with its AdamW state; workers hold
the whole model and no optimizer state.

- `placement=dedicated` (the default): the last S ranks of the launch are servers and run no model; the first
  W = world size - S are workers, who share the global batch.
- `placement=colocated`: every one of the W ranks is a worker and also serves shard r of its own rank r
  (S = W), as TensorFlow's and MXNet's colocated layouts do: the bytes of a reduce-scatter and an all-gather,
  moved point to point.

One step: each worker runs forward and backward over its micro-batches and sends shard s of its gradient to
server s; each server receives the W gradient shards, sums them in worker order and divides by W (DDP's
average), runs AdamW on its shard and sends the updated shard back to every worker, who copies it into its
model. Every message is a `torch.distributed.isend`/`irecv`, counted as `send` and `recv`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from harness.derive.checkpoint import CheckpointContents
from harness.derive.comm import Collective
from harness.derive.memory import ModelStatePlan, ShardedState
from harness.rank.memory_model import ModelStateTensors
from harness.spec import Layout, Precision, RunSpec, SpecError
from harness.strategies.base import (ComputeOnlyPlan, ExpectedCollective, ExpectedTraffic, MicroBatch, Option, Strategy, Trainer,
                                     TrafficBytes, accumulate, make_adamw, optimizer_description, recipe_of, torchrun_context,
                                     Sharding, unwrapped_parameter_names)
from harness.strategies.compiling import COMPILE, OPTION_NAME as COMPILE_NAME
from harness.strategies.checkpointing import ACTIVATION_CHECKPOINTING, OPTION_NAME, checkpointed_blocks, interval_of
from harness.strategies.offload import ACTIVATION_OFFLOAD, ACTIVATION_OFFLOAD_NAME
from workloads import Workload

DEDICATED, COLOCATED = PLACEMENTS = ("dedicated", "colocated")
# Tags keep a pair's two messages of a step apart (a colocated rank sends its peer a gradient shard, then a
# parameter shard, of other sizes where the shards differ).
GRADIENT_TAG, PARAMETER_TAG = 1, 2


def shard_bounds(elements: int, shards: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `shards` contiguous shards of `elements`, the first `elements % shards` one longer
    (torch.tensor_split's rule)."""
    base, longer = divmod(elements, shards)
    bounds, start = [], 0
    for s in range(shards):
        stop = start + base + (1 if s < longer else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class Roles:
    """Who does what in one launch: the worker ranks, the server rank of each shard, and this rank's parts."""

    workers: tuple[int, ...]
    servers: tuple[int, ...]          # servers[s]: the rank holding shard s

    @classmethod
    def of(cls, world_size: int, servers: int, placement: str) -> "Roles":
        if placement == COLOCATED:
            return cls(tuple(range(world_size)), tuple(range(world_size)))
        workers = world_size - servers
        return cls(tuple(range(workers)), tuple(range(workers, world_size)))

    def shard_of(self, rank: int) -> int | None:
        return self.servers.index(rank) if rank in self.servers else None


@dataclass
class ParameterServerTrainer(Trainer):
    model: nn.Module | None = None
    workload: Workload | None = None
    spec: RunSpec | None = None
    roles: Roles | None = None
    bounds: list[tuple[int, int]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)    # each trainable parameter once (a tied weight once), in order
    sizes: list[int] = field(default_factory=list)    # and its elements
    shard: nn.Parameter | None = None                 # this rank's shard of the parameters, where it serves one
    optimizer: torch.optim.Optimizer | None = None    # AdamW over `shard`

    @property
    def _rank(self) -> int:
        return self.context.rank

    @property
    def _is_worker(self) -> bool:
        return self._rank in self.roles.workers

    def _parameters(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def train_step(self, micro_batches: list[MicroBatch], gradients_ready=None) -> torch.Tensor:
        device, shard_index = self.context.device, self.roles.shard_of(self._rank)
        loss = torch.zeros((), device=device)
        pending: list[dist.Work] = []
        if self._is_worker:
            loss = accumulate(self.model, self.workload.loss, micro_batches, self.spec, device,
                              multipliers=self.loss_multipliers)
            gradient = torch.cat([p.grad.reshape(-1) for p in self._parameters()])
            pending += [dist.isend(gradient[start:stop].contiguous(), dst=server, tag=GRADIENT_TAG)
                        for (start, stop), server in zip(self.bounds, self.roles.servers) if server != self._rank]
        if shard_index is not None:
            start, stop = self.bounds[shard_index]
            received = {worker: torch.empty(stop - start, device=device) for worker in self.roles.workers
                        if worker != self._rank}
            for work in [dist.irecv(buffer, src=worker, tag=GRADIENT_TAG) for worker, buffer in received.items()]:
                work.wait()
            if self._is_worker:
                received[self._rank] = gradient[start:stop]
            total = received[self.roles.workers[0]].clone()
            for worker in self.roles.workers[1:]:        # in worker order: the same sum in either placement
                total += received[worker]
            self.shard.grad = total / len(self.roles.workers)
        if gradients_ready is not None:                  # every rank: the probe's norms are collectives
            gradients_ready()
        if shard_index is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            pending += [dist.isend(self.shard.detach(), dst=worker, tag=PARAMETER_TAG) for worker in self.roles.workers
                        if worker != self._rank]
        if self._is_worker:
            self._receive_parameters()
            self.model.zero_grad(set_to_none=True)
        for work in pending:
            work.wait()
        return loss

    def _receive_parameters(self) -> None:
        device = self.context.device
        parts = []
        for (start, stop), server in zip(self.bounds, self.roles.servers):
            if server == self._rank:
                parts.append((self.shard.detach(), None))
            else:
                buffer = torch.empty(stop - start, device=device)
                parts.append((buffer, dist.irecv(buffer, src=server, tag=PARAMETER_TAG)))
        for _, work in parts:
            if work is not None:
                work.wait()
        flat = torch.cat([part for part, _ in parts])
        # Copied into the parameters' own storage: `vector_to_parameters` would make them views of `flat`, and a
        # colocated rank's of its own server shard, aliasing the model and the optimizer's tensor.
        with torch.no_grad():
            for parameter, piece in zip(self._parameters(), flat.split(self.sizes)):
                parameter.copy_(piece.view_as(parameter))

    def global_losses(self, local_losses: torch.Tensor) -> torch.Tensor:
        """The workers' mean: a dedicated server's losses are zeros and count for nothing."""
        total = local_losses.clone()
        dist.all_reduce(total)
        return total / len(self.roles.workers)

    def _slices(self, flat: torch.Tensor | None) -> list[torch.Tensor]:
        """This rank's part of each trainable parameter within `flat` (its shard), empty where it holds none."""
        result, offset = [], 0
        start, stop = self.bounds[self.roles.shard_of(self._rank)] if flat is not None else (0, 0)
        for size in self.sizes:
            low, high = max(offset, start), min(offset + size, stop)
            result.append(flat[low - start:high - start] if flat is not None and low < high
                          else torch.empty(0, device=self.context.device))
            offset += size
        return result

    def local_parameters(self):
        return self._slices(self.shard.detach() if self.shard is not None else None), True

    def local_gradients(self):
        return self._slices(self.shard.grad if self.shard is not None else None), True

    def parameter_names(self):
        return list(self.names)

    def torch_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise NotImplementedError("a parameter-server worker holds no optimizer: its servers do")
        return self.optimizer

    def model_state_tensors(self) -> ModelStateTensors:
        weights = list(self._parameters()) if self._is_worker else []
        gradients = [p.grad for p in weights if p.grad is not None]
        optimizer = []
        if self.shard is not None:
            weights.append(self.shard)
            if self.shard.grad is not None:
                gradients.append(self.shard.grad)
            optimizer = [t for state in self.optimizer.state.values() for t in state.values()
                         if isinstance(t, torch.Tensor)]
        return ModelStateTensors(weights=weights, gradients=gradients, optimizer=optimizer)


class ParameterServer(Strategy):
    name = "ps"
    launcher = "torchrun"
    description = "synchronous parameter server on torch.distributed send/recv (torchrun)"
    comm_interception = "torch.distributed point to point (isend/irecv)"
    trainer_class = ParameterServerTrainer      # ps-async's servers apply each gradient as it arrives
    options = {
        "servers": Option(1, "dedicated server ranks, the last of the launch (placement=dedicated)", minimum=1),
        "placement": Option(DEDICATED, "dedicated: servers run no model; colocated: every worker serves a shard",
                            choices=PLACEMENTS),
        OPTION_NAME: ACTIVATION_CHECKPOINTING, ACTIVATION_OFFLOAD_NAME: ACTIVATION_OFFLOAD, COMPILE_NAME: COMPILE,
    }
    cannot_compile_because = "the parameter server's workers and servers are not wired to compile here"

    def _roles(self, spec: RunSpec) -> Roles:
        options = self.resolved(spec)
        return Roles.of(spec.world_size, options["servers"], options["placement"])

    def validate(self, spec: RunSpec) -> None:
        if spec.precision is Precision.FP16:
            raise SpecError("strategy ps runs fp32 and bf16; fp16 loss scaling is not built for it")

    def layout_refusal(self, spec: RunSpec) -> str | None:
        options = self.resolved(spec)
        if options["placement"] == DEDICATED and spec.world_size <= options["servers"]:
            return (f"ps with {options['servers']} dedicated server(s) needs a world size above it, for at least "
                    f"one worker; this cell has {spec.world_size}")
        if options["placement"] == DEDICATED and options["servers"] > spec.world_size - options["servers"]:
            # A worker then sends more messages a step (S) than a server receives (W): the busiest rank is a worker,
            # which neither the expected traffic nor the projection's server link describes.
            return (f"ps with {options['servers']} dedicated servers needs at least as many workers; this cell has "
                    f"{spec.world_size - options['servers']}")
        return None

    def layout(self, spec: RunSpec) -> Layout:
        workers = max(1, len(self._roles(spec).workers))
        per_replica = spec.global_batch // workers
        return Layout(data_parallel=workers, pipeline_stages=1, per_replica_batch=per_replica,
                      micro_batches=max(1, per_replica // spec.micro_batch))

    def replica(self, spec, context) -> int:
        workers = self._roles(spec).workers
        return context.rank if context.rank in workers else 0     # a dedicated server feeds no batch of its own

    def start(self, spec):
        return torchrun_context(spec.device)

    def check_options(self, given) -> None:
        """The options' own checks, and a colocated placement given a server count: refused wherever options are
        read (a cell's spec, or a projection's `ps[placement=colocated,servers=2]`)."""
        super().check_options(given)
        if given.get("placement") == COLOCATED and "servers" in given:
            raise SpecError("strategy ps: placement=colocated has every worker serve one shard; leave servers unset")

    def traffic_bytes(self, spec: RunSpec, model: nn.Module) -> TrafficBytes:
        """The trainable parameters (a tied weight once) and their fp32 bytes: what the servers hold and every
        message carries, in any precision (autocast keeps fp32 gradients; fp16 is refused)."""
        elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return TrafficBytes(parameters=elements, gradients_reduced=4 * elements, parameters_gathered=4 * elements)

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic) -> ExpectedTraffic:
        """The busiest rank's messages per step among W = `data_parallel` workers, each of the largest shard's
        fp32 bytes, ceil(elements / S) x 4 (shard_bounds' first shards are the longer): a dedicated server's W
        gradient shards in and W parameter shards out (S = `servers`); a colocated rank's W - 1 of each way for
        its own shard and as many for the others' (S = W), 2 (W - 1) sends and as many recvs. Micro-batches do
        not matter: the gradients are sent once a step."""
        workers = data_parallel
        if options["placement"] == COLOCATED:
            shards, calls = workers, 2 * (workers - 1)
        else:
            shards, calls = options["servers"], workers
        largest = -(-traffic.parameters // shards) * 4
        return ExpectedTraffic(collectives=tuple(
            ExpectedCollective(collective=kind, size_bytes=largest, calls=calls, ranks=2)
            for kind in (Collective.SEND, Collective.RECV)))

    def point_to_point(self, options) -> tuple[str, int]:
        """("star", S) for dedicated servers: the W workers all send to and receive from S ranks of their own,
        whose links carry every message (harness.project.collectives, Algorithm.STAR). ("chain", 0) colocated:
        every rank sends its peers their shards while it receives its own from them, as a ring's ranks do."""
        if options["placement"] == COLOCATED:
            return "chain", 0
        return "star", int(options["servers"])

    def model_state_plan(self, data_parallel, recipe, options) -> ModelStatePlan:
        """The fullest rank's model states. A worker keeps fp32 weights and gradients whole (8 bytes a parameter)
        and no optimizer state; a server keeps its 1/S of the parameters as an fp32 shard with its gradient and
        AdamW's two moments (16 / S); a colocated rank is both, with S = W."""
        if options["placement"] == COLOCATED:
            shards = data_parallel
            return ModelStatePlan(weights=ShardedState(bytes_per_parameter=4 + 4 / shards),
                                  gradients=ShardedState(bytes_per_parameter=4 + 4 / shards),
                                  optimizer=ShardedState(bytes_per_parameter=8, sharded_over=shards),
                                  basis=f"{recipe.value}: a worker's fp32 weights and gradients whole, and the fp32 "
                                        f"shard, its gradient and AdamW's moments of 1/{shards} of them it serves")
        shards = options["servers"]
        if 16 / shards > 8:
            return ModelStatePlan(weights=ShardedState(bytes_per_parameter=4, sharded_over=shards),
                                  gradients=ShardedState(bytes_per_parameter=4, sharded_over=shards),
                                  optimizer=ShardedState(bytes_per_parameter=8, sharded_over=shards),
                                  basis=f"{recipe.value}: a server's fp32 shard of 1/{shards} of the parameters, its "
                                        "gradient and AdamW's two moments (a worker keeps 8 bytes a parameter)")
        return ModelStatePlan(weights=ShardedState(bytes_per_parameter=4), gradients=ShardedState(bytes_per_parameter=4),
                              optimizer=ShardedState(bytes_per_parameter=0),
                              basis=f"{recipe.value}: a worker's fp32 weights and gradients whole, no optimizer state "
                                    f"(each of the {shards} servers keeps 16 / {shards} bytes a parameter)")

    def checkpoint_contents(self, recipe, options) -> CheckpointContents:
        """The servers' fp32 shards and AdamW's two moments, 4 + 8 bytes a parameter over the S servers (the
        workers' whole copies are the same weights): the plan describes the fullest rank, not the job, so its
        weights and optimizer held once would count a worker's copy beside, or instead of, the servers' state."""
        return CheckpointContents(bytes_per_parameter=4 + 8,
                                  basis=f"{recipe.value}: the servers' fp32 weight shards (4) and AdamW moments (8), "
                                        "once over the servers")

    def compute_only_unavailable(self, spec: RunSpec) -> str:
        if self.resolved(spec)["placement"] == DEDICATED:
            return ("a dedicated server steps the optimizer and a worker runs forward and backward: no one rank's "
                    "work without communication is the step's")
        return ""

    def compute_only_plan(self, spec: RunSpec) -> ComputeOnlyPlan:
        """Colocated: the whole model forward and backward, and AdamW over the rank's contiguous 1/W of the
        flattened parameters (ZeRO-1's flat partition)."""
        return ComputeOnlyPlan(sharding=Sharding.FLAT, autocast=spec.precision.is_mixed)

    def wrap(self, spec, context, workload, layers):
        options = self.resolved(spec)
        roles = Roles.of(context.world_size, options["servers"], options["placement"])
        model = nn.Sequential(*checkpointed_blocks(layers, interval_of(options)))
        parameters = [p for p in model.parameters() if p.requires_grad]
        flat = torch.nn.utils.parameters_to_vector(parameters).detach()
        bounds = shard_bounds(flat.numel(), len(roles.servers))
        shard_index = roles.shard_of(context.rank)
        shard = optimizer = None
        if shard_index is not None:
            start, stop = bounds[shard_index]
            shard = nn.Parameter(flat[start:stop].to(context.device, copy=True))
            optimizer = make_adamw([shard], context.device)
        names, sizes = unwrapped_parameter_names(model), [p.numel() for p in parameters]
        # A dedicated server runs no model: its copy goes to the meta device, shapes without storage (where
        # `Module.to` makes a tied weight two parameters, hence the names and sizes read above).
        model = model.to(context.device if context.rank in roles.workers else "meta")
        return self.trainer_class(
            context=context, model=model, workload=workload, spec=spec, roles=roles, bounds=bounds, names=names,
            sizes=sizes, shard=shard,
            optimizer=optimizer, precision_recipe=recipe_of(spec),
            config={**options, "workers": list(roles.workers), "servers_ranks": list(roles.servers),
                    "shard_elements": [stop - start for start, stop in bounds],
                    **optimizer_description(context.device)})

