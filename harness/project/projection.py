"""Step time, throughput, scaling efficiency, the step beyond compute and model-state memory per rank of each
strategy at world sizes that were not measured: from measured rows, or from a description alone.

    python -m harness project results/reference/ci-cpu/smoke.jsonl --cluster dgx-h100-ib
    python -m harness project --params 1.5B --compute-ms 120 --cluster dgx-h100-ib

The model, end to end (docs/projection.md says where each part comes from and where it stops holding):

    step(N)   = compute(N) + beyond(N)
    comm(N)   = sum over the step's collectives of  calls(N) x time(collective, size(N), group(N))
    beyond(N) = max(f x comm(N),  comm(N) - BACKWARD_SHARE x compute(N))

- **compute(N)**: the strategy's own world-size-1 step where the rows hold one (its work on the rank with
  no network), else the measured compute-only step time (the model's work alone, harness.derive.exposed),
  at the measured per-device batch b (`Basis.compute_source` says which). Weak scaling keeps b, so
  compute(N) is that time; strong scaling keeps the global batch B, so compute(N) = compute x (B / N) / b
  (compute in proportion to the samples a device runs: a fixed cost per step, the optimizer's, does not
  shrink, so strong scaling is optimistic at small per-device batches).
- **beyond(N)**: the step beyond compute(N), named for it: with a world-size-1 cell, the step beyond the
  strategy's own world-size-1 step (harness.derive.beyond_ws1); only without one is it exposed
  communication as measured rows define it (the step beyond the compute-only pass, harness.derive.exposed).
- **the schedule**: the collectives the rows counted per step per rank (type, size per call, calls, the
  group they ran among). A collective among the data-parallel group runs among N ranks at the target; how
  its calls and sizes change with N is the strategy's own: `Strategy.expected_collectives` at the target
  over the same at the measured size (harness.project.facts), per collective type. Sizes are nccl-tests'
  (the whole gathered or scattered buffer), so a ZeRO-3 all-gather keeps its size at any N and its wire
  bytes per rank grow as (N-1)/N; under strong scaling the micro-batches per step, and with them ZeRO-2/3's
  and FSDP2's calls, follow B / N. A counted type the strategy does not expect (DeepSpeed on gloo reduces
  with all-reduces, not reduce-scatters) keeps its counted calls and sizes, with a note.
  Counted calls are what the strategy hands its library; where the library fuses them (Horovod's tensor
  fusion: one all-reduce per cycle in which gradients arrived), they are priced as the wire carries them
  (`on_the_wire`, Strategy.wire_calls), with a note.
- **time(collective)**: harness.project.collectives on a described cluster, each call by the least modelled
  time among the algorithms of the cluster's library (NCCL: ring or tree for an all-reduce) unless one is
  forced, named per collective in the table and the rows; or a Calibration fitted to `harness comm` rows
  (harness.project.fit), which then is the target: a one-level network like the host it was measured on,
  each collective by the algorithm it was fitted with. A dedicated parameter server's sends and recvs (its
  strategy's `point_to_point`: a star) are priced on its servers' links, where N counts its workers and its
  servers sit beside them (harness.project.collectives.ServerLinks, `server_links`).
- **overlap**: f = beyond_m / comm_m, the measured step beyond compute over the priced communication, with
  beyond_m the measured step beyond compute at >= 2 ranks (the step beyond the strategy's own world-size-1
  step where there is one, harness.derive.beyond_ws1) and comm_m the same schedule priced on the measuring
  host's calibration (`--comm`); >= 0 (a step measured faster than its compute exposes nothing) and not
  bounded above. Below 1, overlap hid part of the communication (the last bucket, ZeRO-1's all-gather
  after the optimizer step stay exposed); above 1, the step's collectives cost more inside the step than
  the calibration prices them (contention with compute for the host's cores, framework work per call),
  which is measured, not assumed away. Carried over to N as that ratio. The second term bounds it from
  below: communication can hide only behind backward, BACKWARD_SHARE of a step's compute, so whatever does
  not fit is exposed. Without a calibration of the measuring host, or a measured figure beyond compute,
  f = 1 (no overlap).
- **memory**: the strategy's `model_state_plan` at N (the ZeRO paper's sharding, harness.derive.memory)
  times the parameters a rank holds; beside it, for a transformer, what the busiest rank's blocks save for
  backward at N, every block whole and every block checkpointed (`activations_at`).
- **checkpoint** (only where a target storage is given, `CheckpointTarget`): a checkpoint's bytes a parameter
  from the basis's measured save where its rows hold one, else the strategy's own (`checkpoint_contents`: the
  components its checkpoint holds, as its plan keeps them, each once over the job), times the whole model's
  parameters; its save time, the Young/Daly interval and the goodput at N GPUs by harness.project.goodput
  (`with_checkpoint_costs`).
- **interval** (only where a Calibration prices the target): each collective's time scaled by the 10th
  and 90th percentiles of measured / fitted over that collective's calibration rows, every collective at
  the same percentile at once (errors taken to move together, which widens the band), and the same rule
  for the step beyond compute: an 80% band of the communication model's scatter, not of compute noise.

Efficiency is against the 1-device prediction (compute only, no communication): weak
E(N) = compute(b) / step(N); strong E(N) = compute(B on one device) / (N x step(N)).

Torch-free: the strategies' facts come through a StrategyFacts object (harness.project.facts reads the
registry). Projected rows are kind "projection", status "projected": readers of measured rows
(harness.record.read_rows without kind) never see them.
"""

from __future__ import annotations

import enum
import math
import uuid
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from statistics import median
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from harness.derive.activations import block_sizes, rank_activation_bytes
from harness.derive.beyond_ws1 import one_rank_launches
from harness.derive.harness_overhead import BARE_STRATEGY
from harness.derive.checkpoint import CheckpointContents, MeasuredCheckpoint, measured_checkpoint
from harness.derive.comm import RECEIVED_ONLY, wire_bytes
from harness.derive.exposed import exposed_communication, slowest_rank_per_step, stalled_steps
from harness.derive.hosts import row_host_load
from harness.derive.identity import conditions_id, distinguishing_suffixes, row_conditions
from harness.derive.memory import ModelStatePlan, plan_bytes
from harness.derive.staleness import is_asynchronous
from harness.derive.rows import is_ok, measurements, options_text, shared_device, spec
from harness.project.cluster import Cluster, Link
from harness.project.collectives import (DEFAULT_ALGORITHMS, LIBRARY_ALGORITHMS, POINT_TO_POINT, Algorithm,
                                         ClusterModel, CommModel, Library, ServerLinks)
from harness.project.fit import Calibration, NodesCalibration, ServerLinkCalibration
from harness.project.goodput import (ASSUMPTION as CHECKPOINT_ASSUMPTION, CheckpointCost, CheckpointTarget,
                                     checkpoint_cost, checkpoint_fields, checkpoint_lines)
from harness.record import PROJECTION_KIND
from harness.spec import SpecError

DEFAULT_WORLD_SIZES = tuple(2 ** k for k in range(3, 11))     # 8, 16, ..., 1024
PROJECTED = "projected"

# Communication can overlap only with backward: about 2/3 of a training step's FLOPs (the backward pass
# costs twice the forward: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1, C = 6N
# per token of which 2N forward). The optimizer step's time is in the compute too, so this is generous.
BACKWARD_SHARE = 2.0 / 3.0
# The prediction interval: these percentiles of measured / fitted over each collective's calibration rows.
INTERVAL_PERCENTILES = (10.0, 90.0)
NO_OVERLAP = "none measured: all communication exposed (an upper bound)"


class Scaling(enum.StrEnum):
    WEAK = "weak"       # per-device batch fixed, global batch grows with N
    STRONG = "strong"   # global batch fixed, each device's share shrinks as 1/N


class StrategyFacts(Protocol):
    """A strategy's own facts at any world size (harness.project.facts.RegistryFacts reads the registry). One more
    is asked for where present, `point_to_point(strategy, options) -> (pattern, hubs)` (`point_to_point_of`: a
    dedicated parameter server's star); without it every send is a chain's hop."""

    def expected_per_step(self, strategy: str, options: Mapping[str, Any], data_parallel: int, micro_batches: int,
                          parameters: int, gradient_bytes: int, gathered_bytes: int,
                          kept_whole: int = 0) -> dict[str, Any]: ...

    def wire_calls(self, strategy: str, options: Mapping[str, Any], collective: str, counted_calls: float,
                   bytes_per_step: float, backward_s: float) -> float: ...

    def model_state_plan(self, strategy: str, options: Mapping[str, Any], data_parallel: int,
                         recipe: str) -> ModelStatePlan: ...

    def checkpoint_contents(self, strategy: str, options: Mapping[str, Any], recipe: str) -> CheckpointContents: ...

    def expected_for_cell(self, *, workload: str, strategy: str, options: Mapping[str, Any], precision: str,
                          world_size: int, global_batch: int, micro_batch: int,
                          gpus_per_node: int | None = None) -> tuple[dict[str, Any], int, int]: ...

    def bubble_factor(self, strategy: str, options: Mapping[str, Any], micro_batches: int) -> float: ...

    def model_split(self, *, workload: str, strategy: str, options: Mapping[str, Any], precision: str,
                    world_size: int, global_batch: int, micro_batch: int) -> tuple[int, int]: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Scheduled:
    """Collectives of one type and size issued per step per rank."""

    collective: str
    size_bytes: float           # nccl-tests size of one call
    calls: float                # per optimizer step
    group: int | None = None    # ranks it runs among; None: the data-parallel group, N at the target
    origin: str = "counted"     # "counted" in the rows, or "expected" (the strategy's, not counted)
    label: str = ""             # the group's name where the strategy names its groups ("tp", "dp")
    stride: int = 1             # ranks between its members (ExpectedCollective.stride): > 1 spreads it over nodes
    # A send or recv of a star (a dedicated parameter server's, Algorithm.STAR): the servers its N workers send to
    # and receive from, ranks beyond the N; 0 for a chain's hop.
    servers: int = 0

    def ranks(self, world_size: int) -> int:
        """Ranks it runs among: a send or recv is between two, whatever group it was counted in."""
        if self.collective in POINT_TO_POINT:
            return 2
        return world_size if self.group is None else self.group


@dataclass(frozen=True, kw_only=True)
class Basis:
    """What a strategy's projection starts from: one measured cell (or a description)."""

    workload: str
    strategy: str
    options: Mapping[str, Any]
    precision: str
    recipe: str
    parameters: int                    # a rank's parameters before sharding (the whole model)
    kept_whole: int                    # parameters a sharding strategy keeps whole beside their shard
    tokens_per_sample: float | None
    per_device_batch: float            # samples per device per step where compute_s was measured
    global_batch: int                  # the strong-scaling reference
    micro_batch: int
    compute_s: float                   # compute-only step time at per_device_batch
    world_size: int | None             # where the schedule was counted; None: a description
    micro_batches: int                 # per step at world_size
    schedule: tuple[Scheduled, ...]    # at world_size (rows); empty for a description
    gradient_bytes: int                # all gradients as reduced (the strategy's traffic bytes)
    gathered_bytes: int                # all parameters as gathered
    exposed_fraction: float            # f of the module docstring
    overlap_source: str                # how f was obtained
    compute_source: str = "given"      # where compute_s came from
    run_ids: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    conditions: str = ""               # what tells it from a basis of the same cell measured elsewhere ("@50Mbit/s")
    # Traffic in groups of the strategy's own (tensor parallelism's "tp", a 2-D mesh's "dp"): its schedule at a
    # target is the strategy's expected traffic for the cell at that size (`grouped_schedule_at`).
    grouped: bool = False
    # A transformer's shape (seq_len, n_embd, n_head, n_layer; a Llama's n_kv_head and intermediate_size, and the
    # device it ran on, too: `transformer_shape` of a row's workload_description, or described), for the
    # activations a rank holds; None where not known (a ResNet's, a description without one).
    shape: Mapping[str, Any] | None = None
    # The whole model's parameters, each once (a row's `parameters`): what a checkpoint saves, where `parameters` is
    # a tensor-parallel rank's slice. None: `parameters`.
    model_parameters: int | None = None
    # A save its rows measured (harness.derive.checkpoint): a checkpoint's bytes a parameter come from it.
    measured_checkpoint: MeasuredCheckpoint | None = None
    # A described hybrid's schedule at a size: (world_size=, global_batch=, gpus_per_node=) -> (its collectives, its
    # ModelSplit, micro-batches a replica), `harness plan`'s (harness.project.layouts.described_schedule_at, handed in
    # by harness.project.run: plan imports this module, so this one cannot import it); None for any other basis.
    layout_schedule: Callable[..., tuple[tuple[Scheduled, ...], Any, int]] | None = field(default=None, compare=False,
                                                                                      repr=False)

    @property
    def label(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return (f"{self.workload}/{self.strategy}" + (f"[{options}]" if options else "") + f"/{self.precision}"
                + self.conditions)


@dataclass(frozen=True, kw_only=True)
class Projected:
    """One strategy at one world size under one scaling assumption."""

    basis: Basis
    scaling: Scaling
    world_size: int
    global_batch: float
    per_device_batch: float
    micro_batches: int
    compute_s: float
    comm_s: float
    exposed_s: float                   # beyond(N) of the module docstring: the step beyond compute_s
    step_s: float
    step_low_s: float | None
    step_high_s: float | None
    samples_per_s: float
    tokens_per_s: float | None
    efficiency: float
    exposed_share: float               # exposed_s / step_s
    model_state_bytes_per_rank: float
    wire_bytes_per_rank: float
    schedule: tuple[Scheduled, ...]
    algorithms: tuple[str, ...] = ()    # the algorithm each schedule entry is priced by, in its order
    notes: tuple[str, ...] = ()
    # What the busiest rank's blocks hold for backward at their peak, every block whole and every block
    # checkpointed (harness.derive.activations.rank_activation_bytes); None where the basis has no shape or
    # its recipe is one the block formula does not describe.
    activation_bytes_per_rank: float | None = None
    activation_bytes_checkpointed_per_rank: float | None = None
    # The checkpoint's save time, interval and goodput (harness.project.goodput), where a target storage is given.
    checkpoint: CheckpointCost | None = None


# ---- pricing -------------------------------------------------------------------------------------------


def priced_on(model: CommModel, item: Scheduled, world_size: int) -> CommModel:
    """The model that prices `item` in a step of `world_size` ranks: on a described cluster, a group whose
    members are `stride` ranks apart is priced on the cluster as such interleaved groups see it
    (Cluster.seen_by_interleaved_groups: fewer of its ranks per node, the node's NICs shared with the groups
    beside it). A pipeline's send to the next stage, `stride` ranks on, crosses a node boundary somewhere once
    the ranks fill more than a node, and the step waits for the slowest boundary: there the min(stride, g)
    ranks of a node send across at once, each with that share of its NICs; a send among the data-parallel group
    (a colocated parameter server's, to peers all over it) has every rank of a node sending across at once. A
    star's sends and recvs (a dedicated parameter server's) are priced on its servers' links (`server_links`).
    A calibration is one level, the same for every group; two (NodesCalibration: the emulated cluster's loopback
    and link) price a group on the one its members' placement uses."""
    if item.collective in POINT_TO_POINT and item.servers:
        return server_links(model, world_size, item.servers)
    if isinstance(model, NodesCalibration):
        return model.for_group(item.collective, item.ranks(world_size), item.stride, world_size)
    if not isinstance(model, ClusterModel):
        return model
    cluster = model.cluster
    if item.collective in POINT_TO_POINT:
        if world_size <= cluster.gpus_per_node:
            return model
        sharing = min(_ranks_apart(item, world_size), cluster.gpus_per_node)
        crossing = Cluster(name=f"{cluster.name}, a stage boundary across nodes", gpus_per_node=1,
                           intra_node=cluster.intra_node,
                           inter_node=Link(latency_s=cluster.inter_node.latency_s,
                                           bandwidth_bytes_per_s=cluster.inter_node.bandwidth_bytes_per_s / sharing))
        return ClusterModel(crossing, dict(model.algorithms), model.library)
    if item.stride <= 1:
        return model
    return ClusterModel(cluster.seen_by_interleaved_groups(item.stride), dict(model.algorithms), model.library)


def _ranks_apart(item: Scheduled, world_size: int) -> int:
    """Ranks between a send's two ends: its named group's stride (a pipeline's), or, among the data-parallel
    group, anywhere in the world (a colocated parameter server sends to every peer)."""
    return world_size if item.group is None else item.stride


def server_links(model: CommModel, workers: int, servers: int) -> CommModel:
    """The model that prices a star's messages, `workers` ranks sending to and receiving from `servers` of their
    own: on a described cluster the busier of the servers' and the workers' node links (ServerLinks); on a
    calibration each message as a send (ServerLinkCalibration), on the emulated cluster's across its nodes once
    the launch's workers and servers fill more than one."""
    if isinstance(model, ClusterModel):
        return ServerLinks(model.cluster, workers, servers)
    if isinstance(model, NodesCalibration):
        model = model.for_group("send", 2, 1, workers + servers)
    if isinstance(model, Calibration):
        return ServerLinkCalibration(model)
    return model


def point_to_point_of(facts: StrategyFacts, strategy: str, options: Mapping[str, Any]) -> tuple[str, int]:
    """The strategy's point-to-point pattern and its hubs (RegistryFacts.point_to_point); ("chain", 0) where the
    facts do not say (a test's own StrategyFacts)."""
    ask = getattr(facts, "point_to_point", None)
    return tuple(ask(strategy, options)) if ask is not None else ("chain", 0)


def star_servers(facts: StrategyFacts, strategy: str, options: Mapping[str, Any]) -> int:
    """The dedicated servers of a strategy whose sends and recvs form a star (a parameter server's): ranks beyond
    its data-parallel ones, which run no model; 0 for any other."""
    pattern, hubs = point_to_point_of(facts, strategy, options)
    return int(hubs) if pattern == Algorithm.STAR.value else 0


def with_servers(schedule: Iterable[Scheduled], servers: int) -> tuple[Scheduled, ...]:
    """`schedule` with its data-parallel sends and recvs marked as a star's of `servers` (unchanged where 0)."""
    if not servers:
        return tuple(schedule)
    return tuple(replace(item, servers=servers) if item.collective in POINT_TO_POINT and item.group is None else item
                 for item in schedule)


def star_notes(schedule: Sequence[Scheduled], world_size: int, model: CommModel) -> tuple[str, ...]:
    """Where a star's servers sit and, on a described cluster, which link sets a phase's pace at `world_size`
    workers (ServerLinks): none for a schedule without one."""
    sends = [item for item in schedule if item.collective == "send" and item.servers]
    if not sends:
        return ()
    servers, message = sends[0].servers, sends[0].size_bytes
    if not isinstance(model, ClusterModel):
        return (f"N counts the W workers; the S = {_servers_beside(servers, 'rank')} beside them, each of their "
                "messages, a recv as a send, priced as one send on the calibrated link",)
    links = ServerLinks(model.cluster, world_size, servers)
    server, worker_node = links.phase_bytes(message)
    server_text = f"W P / S = {world_size} x {message:.4g} B = {server:.4g} B"
    worker_text = f"g P = {links.workers_per_node} x {servers * message:.4g} B = {worker_node:.4g} B"
    if server == worker_node:
        where = f"the server's and the workers' node links alike ({server_text}; {worker_text} a phase)"
    elif links.bottleneck(message) == "server":
        where = f"the server's link ({server_text} a phase; a worker node's link carries {worker_text})"
    else:
        where = f"the workers' node link ({worker_text} a phase; a server's link carries {server_text})"
    return (f"N counts the W workers (GPUs); the S = {_servers_beside(servers, 'host')}, one server a host with its "
            "node's whole inter-node link", f"N = {world_size}: bottleneck {where}")


def _servers_text(servers: int) -> str:
    return f"{servers} dedicated server" + ("s" if servers > 1 else "")


def _servers_beside(servers: int, place: str) -> str:
    """E.g. "8 dedicated servers are 8 more hosts", or "1 dedicated server is 1 more rank"."""
    plural = "s" if servers > 1 else ""
    return f"{_servers_text(servers)} {'are' if plural else 'is'} {servers} more {place}{plural}"


def comm_seconds(schedule: Iterable[Scheduled], world_size: int, model: CommModel,
                 factors: Mapping[str, float] | None = None) -> float:
    """Seconds of communication per step: every call priced alone (its latency terms are per call), each
    collective's time scaled by `factors` (the interval's percentiles) where given."""
    total = 0.0
    for item in schedule:
        seconds = priced_on(model, item, world_size).collective_seconds(item.collective, item.size_bytes,
                                                                        item.ranks(world_size))
        total += item.calls * seconds * (factors or {}).get(item.collective, 1.0)
    return total


def exposed_seconds(comm_s: float, compute_s: float, fraction: float) -> float:
    """The module docstring's overlap rule."""
    return max(fraction * comm_s, comm_s - BACKWARD_SHARE * compute_s, 0.0)


def interval_factors(calibration: Calibration) -> tuple[dict[str, float], dict[str, float]]:
    """({collective: low factor}, {collective: high factor}): INTERVAL_PERCENTILES of measured / fitted."""
    low, high = {}, {}
    for name, fit in calibration.fits.items():
        ratios = [1.0 + r for r in fit.relative_residuals if math.isfinite(r)]
        if ratios:
            low[name], high[name] = (float(np.percentile(ratios, q)) for q in INTERVAL_PERCENTILES)
    return low, high


# ---- the schedule at a target world size -------------------------------------------------------------------


def _by_type(expected: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """{collective: (calls per step, bytes per step)} of an expected-traffic dict."""
    totals: dict[str, tuple[float, float]] = {}
    for entry in expected.get("collectives", ()):
        calls, size = totals.get(entry["collective"], (0.0, 0.0))
        totals[entry["collective"]] = (calls + entry["calls"], size + entry["calls"] * entry["size_bytes"])
    return totals


def schedule_at(basis: Basis, world_size: int, micro_batches: int, facts: StrategyFacts
                ) -> tuple[tuple[Scheduled, ...], tuple[str, ...]]:
    """The step's collectives at `world_size` with `micro_batches` per step, and notes on what was kept or
    added (module docstring, "the schedule")."""
    # kept_whole: ZeRO-3 gathers the parameters it keeps whole once a step, not for every micro-batch, so
    # under strong scaling their all-gathers do not follow the micro-batches (a row's own count).
    target = facts.expected_per_step(basis.strategy, basis.options, world_size, micro_batches, basis.parameters,
                                     basis.gradient_bytes, basis.gathered_bytes, basis.kept_whole)
    if target.get("not_modelled_because"):
        raise SpecError(f"{basis.strategy}: its traffic is not modelled ({target['not_modelled_because']})")
    if basis.world_size is None:             # a description: the strategy's own schedule, nothing counted
        return tuple(Scheduled(collective=e["collective"], size_bytes=float(e["size_bytes"]), calls=float(e["calls"]),
                               origin="expected") for e in target["collectives"] if e["calls"]), ()
    measured = facts.expected_per_step(basis.strategy, basis.options, basis.world_size, basis.micro_batches,
                                       basis.parameters, basis.gradient_bytes, basis.gathered_bytes, basis.kept_whole)
    now, then = _by_type(target), _by_type(measured)
    stand_ins = _stand_ins(basis.schedule, then)
    scheduled, notes = [], []
    for item in basis.schedule:
        if item.collective == ALL_TO_ALL and _shards_experts(facts, basis):
            # Expert parallelism's dispatch and combine: a call per block and micro-batch, each a rank's routed rows
            # of one micro-batch, as many at any world size under a fixed micro-batch (its tokens, k copies, spread
            # over the group's experts); so the calls follow the micro-batches a rank runs, the size stays, and a
            # group of every rank (ep = the world size) grows with it. The routing taken as the row's.
            scheduled.append(replace(item, calls=item.calls * micro_batches / basis.micro_batches))
            notes.append(f"counted all_to_all: {basis.strategy}'s dispatch and combine, its calls following the "
                         "micro-batches a rank runs, each call the size counted")
            continue
        role = stand_ins.get(item.collective, item.collective)
        if item.group is not None or not then.get(role, (0.0, 0.0))[0] or role not in now:
            if item.group is None and role not in now:
                notes.append(f"counted {item.collective} is not in {basis.strategy}'s expected traffic: kept as "
                             "counted per step")
            scheduled.append(item)       # a fixed group, or nothing of the strategy's to scale it by
            continue
        if role != item.collective:
            notes.append(f"counted {item.collective} stands in for {basis.strategy}'s expected {role} (none counted): "
                         f"scaled as {role}")
        (calls_n, bytes_n), (calls_m, bytes_m) = now[role], then[role]
        size_factor = (bytes_n / calls_n) / (bytes_m / calls_m) if calls_n and bytes_m else 1.0
        scheduled.append(replace(item, calls=item.calls * calls_n / calls_m, size_bytes=item.size_bytes * size_factor))
    counted = {stand_ins.get(item.collective, item.collective) for item in basis.schedule}
    for collective, (calls_n, bytes_n) in now.items():
        if collective not in counted and calls_n and bytes_n:
            # Expected but never counted: the row's world size issued none (a library skips a collective
            # among one rank) or the counter missed it. Priced from the strategy's own sizes.
            scheduled.append(Scheduled(collective=collective, size_bytes=bytes_n / calls_n, calls=calls_n,
                                       origin="expected"))
            notes.append(f"{collective} expected by {basis.strategy} but not counted at world size "
                         f"{basis.world_size}: taken from its expected traffic")
    return tuple(scheduled), tuple(notes)


ALL_TO_ALL = "all_to_all"


def _shards_experts(facts: StrategyFacts, basis: "Basis") -> bool:
    """Whether the basis's strategy shards an MoE model's experts (`Strategy.expert_parallel_degree`); False for facts
    that cannot say (a test's own)."""
    degree = getattr(facts, "expert_parallel_degree", None)
    return bool(degree and degree(basis.strategy, basis.options, basis.world_size or 1))


def _stand_ins(schedule: Sequence[Scheduled], expected: Mapping[str, tuple[float, float]]) -> dict[str, str]:
    """{counted type: the expected type it does the work of}, where the row counted exactly one
    data-parallel type the strategy does not expect and none of exactly one type it does: DeepSpeed's
    ZeRO-1/2 on gloo reduce gradients with all-reduces where the strategy expects reduce-scatters, so the
    all-reduces' calls and bytes follow the reduce-scatter's from world size to world size, and the
    reduce-scatter is not added again from the expected traffic."""
    counted = {item.collective for item in schedule if item.group is None}
    unexpected = sorted(counted - set(expected))
    missing = sorted(c for c, (calls, _) in expected.items() if calls and c not in counted)
    return {unexpected[0]: missing[0]} if len(unexpected) == 1 and len(missing) == 1 else {}


GROUPED_NOTE = ("schedule: the strategy's expected traffic for the cell at this size, group by group (its counted "
                "traffic equals it call for call where tested: tests/test_hybrid.py); a group of neighbours stays "
                "inside a node, a group spread over the mesh (stride > 1) shares each node's links with the groups "
                "beside it; compute: the samples a rank's replica runs over the ranks that split them, though "
                "what tensor parallelism does not split (embeddings, norms, the optimizer's unsplit state) is "
                "not divided")


DESCRIBED_GROUPED_NOTE = ("schedule: harness plan's for the layout at this size (harness.project.layouts.schedule_of): "
                          "the data-parallel strategy's collectives among the replicas over a rank's share of the "
                          "parameters, Megatron's activation all-reduces among the tp ranks (2 a block forward, 2 "
                          "backward, every micro-batch), a pipeline stage's sends of b x s x h fp32 values; compute: "
                          "the samples a rank's replica runs over the ranks that split them")


def grouped_schedule_at(basis: Basis, world_size: int, global_batch: int, facts: StrategyFacts,
                        gpus_per_node: int | None = None) -> tuple[tuple[Scheduled, ...], int, int, int]:
    """(the step's collectives, the data-parallel size, micro-batches per replica, the parameters a rank holds
    before sharding) of a grouped basis's cell at
    `world_size` and `global_batch` on nodes of `gpus_per_node`, from the strategy's own expected traffic there
    (SpecError where the strategy refuses that layout: tensor parallelism across nodes, or of a degree that
    does not divide the heads). A described hybrid (no cell, no workload) takes `harness plan`'s schedule of the
    same layout (its `layout_schedule`: harness.project.layouts.described_schedule_at), so that both commands price
    it alike."""
    if basis.layout_schedule is not None:
        schedule, split, micro_batches, held = basis.layout_schedule(world_size=world_size, global_batch=global_batch,
                                                                     gpus_per_node=gpus_per_node)
        return schedule, split.data_parallel, micro_batches, held
    expected, data_parallel, held = facts.expected_for_cell(
        workload=basis.workload, strategy=basis.strategy, options=basis.options, precision=basis.precision,
        world_size=world_size, global_batch=global_batch, micro_batch=basis.micro_batch, gpus_per_node=gpus_per_node)
    if expected.get("not_modelled_because"):
        raise SpecError(f"{basis.strategy}: its traffic is not modelled ({expected['not_modelled_because']})")
    schedule = tuple(Scheduled(collective=e["collective"], size_bytes=float(e["size_bytes"]), calls=float(e["calls"]),
                               group=int(e["ranks"]), origin="expected", label=str(e.get("group", "")),
                               stride=int(e.get("stride", 1)))
                     for e in expected["collectives"] if e["calls"])
    micro_batches = max(1, global_batch // (data_parallel * basis.micro_batch))
    if basis.world_size is not None and _shards_experts(facts, basis):
        # The all-to-alls follow the routing, so no expected traffic holds them: the row's counted ones, carried as
        # `schedule_at` carries them (calls with the micro-batches, each call's size kept), among the expert group
        # the strategy forms at this size.
        degree = facts.expert_parallel_degree(basis.strategy, basis.options, world_size)
        schedule += tuple(replace(item, calls=item.calls * micro_batches / basis.micro_batches, group=degree,
                                  stride=1, label="ep")
                          for item in basis.schedule if item.collective == ALL_TO_ALL)
    return schedule, data_parallel, micro_batches, held


def is_grouped(m: Mapping[str, Any]) -> bool:
    """Whether a row's strategy names its groups other than the default one (tensor parallelism, 2-D meshes)."""
    entries = (m.get("comm_expected_per_step") or {}).get("collectives") or ()
    return any(e.get("group", "world") != "world" for e in entries)


def labelled_schedule(m: Mapping[str, Any]) -> tuple[Scheduled, ...]:
    """The busiest rank's counted collectives per type and named group, each among its group's recorded ranks,
    with the stride the strategy gave that group (the counter names groups: harness.rank.comm_counter)."""
    strides = {e.get("group"): int(e.get("stride", 1))
               for e in (m.get("comm_expected_per_step") or {}).get("collectives") or ()}
    schedule = []
    for collective, figures in sorted(busiest_counts(m).items()):
        ranks = figures.get("group_ranks") or {}
        for label, counts in sorted((figures.get("by_group") or {}).items()):
            if counts["calls"] and counts["bytes"] and label in ranks:
                schedule.append(Scheduled(collective=collective, size_bytes=counts["bytes"] / counts["calls"],
                                          calls=counts["calls"], group=int(ranks[label]), label=label,
                                          stride=strides.get(label, 1)))
    return tuple(schedule)


def counted_against_expected(m: Mapping[str, Any]) -> tuple[str, ...]:
    """A note for each (collective, group) whose counted calls or bytes per step differ from the row's own
    expected traffic: a grouped basis is projected on its expected traffic, so a difference is said."""
    expected: dict[tuple[str, str], list[float]] = {}
    for e in (m.get("comm_expected_per_step") or {}).get("collectives") or ():
        totals = expected.setdefault((e["collective"], e.get("group", "world")), [0.0, 0.0])
        totals[0] += e["calls"]
        totals[1] += e["calls"] * e["size_bytes"]
    counted = {(item.collective, item.label): [item.calls, item.calls * item.size_bytes]
               for item in labelled_schedule(m)}
    notes = []
    for key in sorted(set(expected) | set(counted)):
        want, got = expected.get(key, [0.0, 0.0]), counted.get(key, [0.0, 0.0])
        if any(abs(a - b) > 1e-9 * max(abs(a), abs(b), 1.0) for a, b in zip(want, got)):
            notes.append(f"counted {key[0]} in group {key[1]}: {got[0]:g} calls, {got[1]:.6g} B a step, against "
                         f"{want[0]:g} calls, {want[1]:.6g} B expected: projected on the expected")
    return tuple(notes)


# ---- projecting -----------------------------------------------------------------------------------------


def project(basis: Basis, world_sizes: Sequence[int], model: CommModel, facts: StrategyFacts,
            scalings: Sequence[Scaling] = (Scaling.WEAK, Scaling.STRONG)) -> tuple[list[Projected], list[str]]:
    """Every (scaling, world size) of one basis; world sizes where strong scaling cannot split the global
    batch are left out with a note."""
    check_world_sizes(world_sizes, model)
    interval = interval_factors(model) if isinstance(model, Calibration) else None
    points, skipped = [], []
    for scaling in scalings:
        for n in world_sizes:
            if scaling is Scaling.STRONG and basis.global_batch % n:
                skipped.append(f"{basis.label} strong at {n}: the global batch {basis.global_batch} does not "
                               f"split over {n} ranks")
                continue
            try:
                points.append(_point(basis, scaling, n, model, facts, interval))
            except SpecError as error:
                if not basis.grouped:
                    raise
                skipped.append(f"{basis.label} {scaling.value} at {n}: {error}")   # a layout refused at n
    return points, skipped


def _point(basis: Basis, scaling: Scaling, n: int, model: CommModel, facts: StrategyFacts,
           interval: tuple[dict[str, float], dict[str, float]] | None) -> Projected:
    if scaling is Scaling.WEAK:
        per_device, micro_batches, compute = basis.per_device_batch, basis.micro_batches, basis.compute_s
    else:
        per_device = basis.global_batch / n
        micro_batches = max(1, int(per_device) // basis.micro_batch)
        compute = basis.compute_s * per_device / basis.per_device_batch
    if basis.grouped:
        gpus_per_node = model.cluster.gpus_per_node if isinstance(model, ClusterModel) else None
        schedule, data_parallel, micro_batches, parameters = grouped_schedule_at(
            basis, n, round(per_device * n), facts, gpus_per_node)
        notes: tuple[str, ...] = (GROUPED_NOTE if basis.world_size is not None else DESCRIBED_GROUPED_NOTE,)
        bubble = facts.bubble_factor(basis.strategy, basis.options, micro_batches)
        if bubble != 1.0:       # a pipeline: its stages idle while it fills and drains
            compute *= bubble
            notes += (f"compute includes the pipeline's bubble: x {bubble:.4g} = (K + S - 1) / K at K = "
                      f"{micro_batches} micro-batches",)
    else:
        (schedule, notes), data_parallel, parameters = schedule_at(basis, n, micro_batches, facts), n, basis.parameters
        schedule = with_servers(schedule, star_servers(facts, basis.strategy, basis.options))
        notes += star_notes(schedule, n, model)
    notes += above_one_note(basis.exposed_fraction)
    comm = comm_seconds(schedule, n, model)
    exposed = exposed_seconds(comm, compute, basis.exposed_fraction)
    step = compute + exposed
    low = high = None
    if interval is not None:
        low = compute + exposed_seconds(comm_seconds(schedule, n, model, interval[0]), compute, basis.exposed_fraction)
        high = compute + exposed_seconds(comm_seconds(schedule, n, model, interval[1]), compute, basis.exposed_fraction)
    global_batch = per_device * n
    samples = global_batch / step
    one_device = basis.compute_s * (basis.per_device_batch if scaling is Scaling.WEAK else basis.global_batch) \
        / basis.per_device_batch
    efficiency = one_device / step if scaling is Scaling.WEAK else one_device / (n * step)
    plan = facts.model_state_plan(basis.strategy, basis.options, data_parallel, basis.recipe)
    memory = plan_bytes(plan, parameters, basis.kept_whole)["total"]
    activations = activations_at(basis, n, round(per_device * n), micro_batches, facts)
    wire = sum(item.calls * wire_bytes(item.collective, item.size_bytes, item.ranks(n)) for item in schedule
               if item.collective not in RECEIVED_ONLY)       # a recv is its peer's send
    algorithms = tuple(priced_on(model, item, n).algorithm(item.collective, item.size_bytes, item.ranks(n))
                       for item in schedule)
    return Projected(basis=basis, scaling=scaling, world_size=n, global_batch=global_batch, per_device_batch=per_device,
                     micro_batches=micro_batches, compute_s=compute, comm_s=comm, exposed_s=exposed, step_s=step,
                     step_low_s=low, step_high_s=high, samples_per_s=samples,
                     tokens_per_s=samples * basis.tokens_per_sample if basis.tokens_per_sample else None,
                     efficiency=efficiency, exposed_share=exposed / step, model_state_bytes_per_rank=memory,
                     wire_bytes_per_rank=wire, schedule=schedule, algorithms=algorithms, notes=notes,
                     activation_bytes_per_rank=activations[0], activation_bytes_checkpointed_per_rank=activations[1])


def with_checkpoint_costs(points: Sequence[Projected], target: CheckpointTarget,
                          facts: StrategyFacts) -> list[Projected]:
    """`points` with their checkpoint time, interval and goodput on `target` (harness.project.goodput): a
    checkpoint's bytes a parameter (`checkpoint_bytes_of`) times the whole model's parameters, which weak and
    strong scaling keep alike, at each point's N GPUs."""
    found: dict[int, tuple[float, str, tuple[str, ...]]] = {}
    costed = []
    for point in points:
        basis = point.basis
        if id(basis) not in found:
            found[id(basis)] = checkpoint_bytes_of(basis, facts)
        per_parameter, source, notes = found[id(basis)]
        cost = checkpoint_cost(bytes_per_parameter=per_parameter,
                               parameters=basis.model_parameters or basis.parameters, bytes_source=source,
                               world_size=point.world_size, target=target)
        costed.append(replace(point, checkpoint=cost, notes=point.notes + notes))
    return costed


def checkpoint_bytes_of(basis: Basis, facts: StrategyFacts) -> tuple[float, str, tuple[str, ...]]:
    """(bytes a parameter, where they come from, notes): the basis's measured save where its rows hold one (the
    files the strategy really wrote), else the strategy's own figure from its model-state plan
    (`StrategyFacts.checkpoint_contents`)."""
    saved = basis.measured_checkpoint
    if saved is not None:
        return (saved.bytes_per_parameter, f"measured: {saved.describe()}",
                (f"checkpoint bytes from the measured save ({saved.describe()}), times the target's parameters",))
    contents = facts.checkpoint_contents(basis.strategy, basis.options, basis.recipe)
    return contents.bytes_per_parameter, contents.basis, ()


# The recipes whose saved tensors the block formula was measured against, and the bytes they compute in.
ACTIVATION_COMPUTE_BYTES = {"fp32": 4, "autocast": 2}


def activations_at(basis: Basis, world_size: int, global_batch: int, micro_batches: int,
                   facts: StrategyFacts) -> tuple[float | None, float | None]:
    """(every block whole, every block checkpointed): what the busiest rank's blocks hold for backward at
    `world_size` (harness.derive.activations.rank_activation_bytes), split as the strategy splits a replica there
    (tensor-parallel ranks, pipeline stages: `StrategyFacts.model_split`; data parallelism splits none), or
    (None, None) without a shape, under a recipe the formula does not describe (bf16 weights; a Llama block in fp32
    on CUDA: harness.derive.activations.block_sizes), or under sequence parallelism, whose saved tensors it was not
    checked against."""
    shape = basis.shape
    compute_bytes = ACTIVATION_COMPUTE_BYTES.get(basis.recipe)
    if shape is None or compute_bytes is None or basis.options.get("sequence_parallel"):
        return None, None
    # GPT's hidden and heads; a Llama block's key/value heads, MLP width and RMSNorm kernel (its device's) too.
    block = block_sizes(shape, device=str(shape.get("device", "cpu")), compute_bytes=compute_bytes)
    if block is None:
        return None, None
    if basis.layout_schedule is not None:       # a described hybrid: its layout as the plan lays it out
        _, split, _, _ = basis.layout_schedule(world_size=world_size, global_batch=global_batch, gpus_per_node=None)
        tensor_parallel, stages = split.tensor_parallel, split.pipeline_stages
    else:
        tensor_parallel, stages = (facts.model_split(workload=basis.workload, strategy=basis.strategy,
                                                     options=basis.options, precision=basis.precision,
                                                     world_size=world_size, global_batch=global_batch,
                                                     micro_batch=basis.micro_batch) if basis.grouped else (1, 1))
    sizes = dict(seq_len=int(shape["seq_len"]), micro_batch=basis.micro_batch, layers=int(shape["n_layer"]),
                 compute_bytes=compute_bytes, tensor_parallel=tensor_parallel, stages=stages,
                 micro_batches=micro_batches, **block)
    return rank_activation_bytes(**sizes), rank_activation_bytes(**sizes, checkpointed=True)


def above_one_note(fraction: float) -> tuple[str, ...]:
    """What f > 1 means, said wherever it is used: f is exposed time over priced communication, not a share."""
    if fraction <= 1.0:
        return ()
    return (f"f = {fraction:.3g} > 1: exposed time is {fraction:.3g} x the priced communication (collectives cost "
            "more inside the step than the benchmark prices them: contention with compute, work per call)",)


def check_world_sizes(world_sizes: Sequence[int], model: CommModel) -> None:
    """Whole numbers >= 1 that the target's nodes hold (a partly filled node is not modelled)."""
    if not world_sizes:
        raise SpecError("no world sizes to project to")
    for n in world_sizes:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpecError(f"world size {n!r} must be a whole number >= 1")
        if isinstance(model, ClusterModel):
            model.check_ranks(n)


# ---- bases from measured rows ---------------------------------------------------------------------------


def busiest_counts(m: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """{collective: the counts of the rank that moved the most bytes of it} (`comm_per_step_by_rank`)."""
    busiest: dict[str, Mapping[str, Any]] = {}
    for counted in m.get("comm_per_step_by_rank") or ():
        for collective, figures in counted.items():
            if figures["bytes"] >= busiest.get(collective, {"bytes": -1.0})["bytes"]:
                busiest[collective] = figures
    return busiest


def counted_schedule(m: Mapping[str, Any]) -> tuple[Scheduled, ...]:
    """Collectives per step of the busiest rank, per type and group size (calls shared out by bytes where a
    type ran in groups of several sizes). Rows without group sizes (schema 1) ran every collective among
    the data-parallel group, and so do a data-parallel strategy's sends and recvs, whatever group they were
    counted in (a dedicated parameter server's, in the launch's world of workers and servers)."""
    data_parallel = int(m.get("data_parallel") or 1)
    schedule = []
    for collective, figures in sorted(busiest_counts(m).items()):
        if not figures["calls"] or not figures["bytes"]:
            continue
        groups = figures.get("bytes_by_group_size") or {str(data_parallel): figures["bytes"]}
        for group, size in sorted(groups.items(), key=lambda kv: int(kv[0])):
            calls = figures["calls"] * size / figures["bytes"]
            among_replicas = int(group) == data_parallel or collective in POINT_TO_POINT
            schedule.append(Scheduled(collective=collective, size_bytes=size / calls, calls=calls,
                                      group=None if among_replicas else int(group)))
    return tuple(schedule)


def unstalled_median_step_s(m: Mapping[str, Any]) -> float | None:
    """Median step time over the timed steps the host did not stall; None if it stalled every one."""
    stalled = set(m.get("host_stalled_step_indices") or ())
    kept = [t for i, t in enumerate(m.get("step_time_s") or ()) if i not in stalled]
    return median(kept) if kept else None


def compute_only_seconds(m: Mapping[str, Any]) -> float | None:
    """Median compute-only step (slowest rank), leaving out steps the host stalled (harness.derive.exposed);
    schema-1 rows kept only the slowest rank's times, without which steps stalled."""
    by_rank = m.get("compute_only_step_time_s_by_rank")
    if by_rank:
        times = slowest_rank_per_step(by_rank)
        stalled = stalled_steps(m.get("compute_only_host_stalled_by_rank") or [[False] * len(times)])
        kept = [t for i, t in enumerate(times) if i not in stalled] or times
        return median(kept)
    legacy = m.get("compute_only_step_time_s")
    return median(legacy) if legacy else None


def _traffic_bytes(m: Mapping[str, Any], parameters: int) -> tuple[int, int]:
    """(gradients as reduced, parameters as gathered) in bytes, from the row's recorded expected traffic:
    the size of its gradient-reducing and its gathering collective; 4 bytes per parameter where the row
    did not record them. Only used where a collective was expected but not counted."""
    entries = (m.get("comm_expected_per_step") or {}).get("collectives") or ()
    reduced = [e["size_bytes"] for e in entries if e["collective"] in ("all_reduce", "reduce_scatter")]
    gathered = [e["size_bytes"] for e in entries if e["collective"] == "all_gather"]
    default = 4 * parameters
    return int(max(reduced, default=default)), int(max(gathered, default=reduced[0] if reduced else default))


def _group_key(row: Mapping[str, Any]) -> tuple:
    # The conditions (harness.derive.identity: link rate, placement, host type) keep a strategy measured at
    # 50 Mbit/s from being merged with the same strategy at 1 Gbit/s into one basis.
    s = spec(row)
    return (s["workload"], s["strategy"], options_text(row), s["precision"], s["micro_batch"], s["device"],
            conditions_id(row))


def one_device_step(rows: Sequence[Mapping[str, Any]], per_device_batch: float) -> tuple[float, float] | None:
    """(median unstalled step time, its batch) of the world-size-1 launches among `rows` that a basis of
    `per_device_batch` samples per device takes its compute from (harness.derive.beyond_ws1
    `one_rank_launches`: at that batch, else the only batch measured), or None."""
    ones, _ = one_rank_launches(rows, per_device_batch)
    if not ones:
        return None
    return median(unstalled_median_step_s(measurements(row)) for row in ones), float(spec(ones[0])["global_batch"])


# How much a rank's compute stretches at a world size on the machine that measured it: 1 on real nodes;
# the emulated cluster's namespaces share one machine's cores (harness.project.validate.shared_cores_factor).
ComputeFactor = Callable[[Mapping[str, Any], int], float]


def bases_from_rows(rows: Sequence[Mapping[str, Any]], facts: StrategyFacts,
                    measuring_host: Calibration | None = None,
                    compute_factor: ComputeFactor | None = None) -> tuple[list[Basis], list[str]]:
    """One basis per strategy cell (workload, strategy, options, precision, micro-batch, device) and set of
    conditions it was measured under: its ok, unshared rows at the largest world size measured, where the counted schedule and the overlap are
    nearest the targets, and its world-size-1 rows where there are some (they give the compute). 
    `measuring_host` (a calibration of the host the rows ran on) prices the measured schedule for f.
    Returns the bases and one note per cell left out."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    skipped = []
    for row in rows:
        if is_ok(row) and not shared_device(row):
            groups.setdefault(_group_key(row), []).append(row)
    # The plain loop's cells by what fixes its work (workload, precision, micro-batch, device, conditions): the
    # compute of a strategy that has neither a world-size-1 cell nor a compute-only pass.
    plains: dict[tuple, list[Mapping[str, Any]]] = {}
    # A layout's world-size-1 cells under other options (fsdp2-tp[tp=1], pipeline[stages=1]): the strategy's own
    # machinery on one rank (DTensor's dispatch, DeepSpeed's engine), for a layout that needs several ranks.
    own_ones: dict[tuple, list[Mapping[str, Any]]] = {}
    for key, members in groups.items():
        if key[1] == "plain":
            plains.setdefault(key[:1] + key[3:], []).extend(members)
        own_ones.setdefault(key[:2] + key[3:], []).extend(r for r in members if spec(r)["world_size"] == 1)
    bases = []
    tags = dict(zip(groups, distinguishing_suffixes([(str(key[:-1]), row_conditions(members[0]))
                                                      for key, members in groups.items()])))
    for key, members in groups.items():
        if key[1] == "plain":       # the reference: one device, nothing to project (it gives compute above)
            continue
        if key[1] == BARE_STRATEGY:     # the harness's yardstick, not a strategy: nothing to project
            continue
        label = f"{key[0]}/{key[1]}" + (f"[{key[2]}]" if key[2] else "") + tags[key]
        if is_asynchronous(measurements(members[0])):
            skipped.append(f"{label}: asynchronous updates (its workers wait on no one): the projection models "
                           "synchronous steps")
            continue
        candidates = members
        if compute_factor is None:
            # Ranks that outnumbered their host's cores measured the cores' sharing: their step beyond
            # compute is not the strategy's, and nothing here corrects for it (the validation's shared-cores
            # factor does, given as compute_factor).
            shared = sorted({spec(r)["world_size"] for r in members if row_host_load(r)["host_oversubscribed"]})
            candidates = [r for r in members if not row_host_load(r)["host_oversubscribed"]]
            if shared:
                skipped.append(f"{label}: world size {', '.join(map(str, shared))} left out of the basis: its ranks "
                               "outnumbered their host's cores, so its step measures their sharing")
            if not candidates:
                continue
        top = max(spec(r)["world_size"] for r in candidates)
        chosen = [r for r in candidates if spec(r)["world_size"] == top]
        # Launches of one strategy at several global batches are several bases: merged, their medians would
        # mix steps of different work under one per-device batch.
        batches = sorted({int(spec(r)["global_batch"]) for r in chosen})
        for batch in batches:
            at_batch = [r for r in chosen if int(spec(r)["global_batch"]) == batch]
            named = label + (f" at global batch {batch}" if len(batches) > 1 else "")
            try:
                per_device = batch / _model_ranks(at_batch[0], facts)
                one_device, whose = one_device_step(members, per_device), "the strategy's"
                if one_device is None:
                    options = dict(spec(at_batch[0]).get("options") or {})
                    same_but_degree = [r for r in own_ones.get(key[:2] + key[3:], [])
                                       if at_degree_one(dict(spec(r).get("options") or {}), options)]
                    one_device, whose = one_device_step(same_but_degree, per_device), \
                        "the strategy's own (one rank: degree 1)"
                if one_device is None and not any(compute_only_seconds(measurements(r)) for r in at_batch):
                    one_device, whose = one_device_step(plains.get(key[:1] + key[3:], []), per_device), "the plain loop's"
                bases.append(replace(_basis(at_batch, facts, measuring_host, one_device, compute_factor, whose),
                                     conditions=tags[key]))
            except SpecError as error:
                skipped.append(f"{named}: {error}")
    return bases, skipped


def at_degree_one(one_rank: Mapping[str, Any], options: Mapping[str, Any]) -> bool:
    """Whether a world-size-1 cell's options are `options` with each parallel degree at 1 (tp=1 for tp=2,
    stages=1 for stages=2) and every other option the same: the layout's own machinery on one rank doing the
    same work (not, say, a cell without activation checkpointing for one with it)."""
    return one_rank.keys() == options.keys() and all(
        one_rank[k] == v or (one_rank[k] == 1 and isinstance(v, int) and not isinstance(v, bool) and v > 1)
        for k, v in options.items())


def _model_ranks(row: Mapping[str, Any], facts: StrategyFacts) -> int:
    """The ranks of a launch that run the model: all of them, less a star's dedicated servers, which run none."""
    s = spec(row)
    return int(s["world_size"]) - star_servers(facts, s["strategy"], dict(s.get("options") or {}))


def _basis(rows: Sequence[Mapping[str, Any]], facts: StrategyFacts, host: Calibration | None,
           one_device: tuple[float, float] | None = None, compute_factor: ComputeFactor | None = None,
           whose: str = "the strategy's") -> Basis:
    first = rows[0]
    s, m = spec(first), measurements(first)
    if s["strategy"] == "plain":
        raise SpecError("runs on one device: nothing to project")
    launched = int(s["world_size"])
    options = dict(s.get("options") or {})
    servers = star_servers(facts, s["strategy"], options)
    # The projection's N: the ranks that run the model (a dedicated parameter server's workers, its servers beside).
    world_size = launched - servers
    per_device = s["global_batch"] / world_size
    factor = compute_factor(first, launched) if compute_factor else 1.0
    if one_device is not None:
        # The strategy's own step on one device, in proportion to the samples: it holds the strategy's
        # work on the rank (ZeRO-3's and FSDP2's parameter bookkeeping, DeepSpeed's flattening), which the
        # compute-only pass (the model's forward and backward alone) leaves out, and no network. Where the
        # strategy has neither (tensor parallelism, a pipeline, measured above one rank only), the plain loop's.
        compute = one_device[0] * per_device / one_device[1]
        compute_source = f"{whose} world-size-1 step, {one_device[0] * 1e3:.4g} ms at {one_device[1]:g} samples"
        beyond_what = f"step beyond {whose} world-size-1 step"       # harness.derive.beyond_ws1's figure
        steps = [t for t in (unstalled_median_step_s(measurements(r)) for r in rows) if t is not None]
        # A pipeline's stages idle in its bubble: not communication (Strategy.bubble_factor, 1 elsewhere).
        bubble = facts.bubble_factor(s["strategy"], dict(s.get("options") or {}),
                                     int(m.get("micro_batches_per_step") or 1))
        exposed = [t - compute * factor * bubble for t in steps]
    else:
        computes = [c for c in (compute_only_seconds(measurements(r)) for r in rows) if c is not None]
        if not computes:
            raise SpecError("no compute-only step time in its rows (compute_only_unavailable_because: "
                            f"{m.get('compute_only_unavailable_because', 'not recorded')!r})")
        compute, compute_source = median(computes) / factor, f"compute-only pass at world size {world_size}"
        beyond_what = "exposed communication (step beyond the compute-only pass)"
        exposed = [e for e in (exposed_communication(measurements(r)).exposed_comm_s for r in rows) if e is not None]
    data_parallel = int(m.get("data_parallel") or world_size)
    grouped = is_grouped(m)
    if data_parallel != world_size and not grouped:
        raise SpecError(f"{data_parallel} data-parallel replicas over {world_size} ranks: only data parallelism, a "
                        "parameter server's workers and strategies whose traffic names its groups (tp, fsdp2-tp, "
                        "pipeline) are projected")
    parameters = int(max(m.get("parameters_held_by_rank") or [m.get("parameters") or 0]))
    if parameters < 1:
        raise SpecError("the row records no parameter count")
    micro_batches = int(m.get("micro_batches_per_step") or 1)
    if grouped:
        schedule, notes = labelled_schedule(m), counted_against_expected(m)
    else:
        schedule, notes = on_the_wire(counted_schedule(m), facts, s["strategy"], options,
                                      backward_s=BACKWARD_SHARE * compute * factor / micro_batches)
        schedule = with_servers(schedule, servers)
    if servers:
        notes += (f"measured at {launched} ranks: {world_size} workers and {_servers_text(servers)}; world sizes "
                  "here count the workers",)
    gradient_bytes, gathered_bytes = _traffic_bytes(m, parameters)
    if world_size < 2 or not exposed:
        fraction, source = 1.0, NO_OVERLAP + (f" (measured at world size {world_size})" if world_size < 2 else "")
    elif host is None:
        fraction, source = 1.0, NO_OVERLAP + " (no --comm calibration of the measuring host to price its comm)"
    else:
        comm_m = comm_seconds(schedule, world_size, host)
        exposed_m = median(exposed)
        fraction = max(0.0, exposed_m / comm_m) if comm_m > 0 else 1.0
        source = (f"measured {beyond_what} {exposed_m * 1e3:.3g} ms / priced comm {comm_m * 1e3:.3g} ms at world size "
                  f"{world_size} on the --comm calibration")
    return Basis(workload=s["workload"], strategy=s["strategy"], options=options,
                 precision=s["precision"], recipe=str(m.get("precision_recipe") or "fp32"), parameters=parameters,
                 kept_whole=int(max(m.get("weights_kept_whole_parameters_by_rank") or [0])),
                 tokens_per_sample=m.get("tokens_per_sample"), per_device_batch=s["global_batch"] / world_size,
                 global_batch=int(s["global_batch"]), micro_batch=int(s["micro_batch"]), compute_s=compute,
                 world_size=world_size, micro_batches=micro_batches, schedule=schedule,
                 gradient_bytes=gradient_bytes, gathered_bytes=gathered_bytes, exposed_fraction=fraction,
                 overlap_source=source, compute_source=compute_source,
                 run_ids=tuple(str(r.get("run_id", "")) for r in rows), notes=notes, grouped=grouped,
                 shape=transformer_shape(m.get("workload_description"), s["device"]),
                 model_parameters=int(m.get("parameters") or parameters), measured_checkpoint=median_save(rows))


def median_save(rows: Sequence[Mapping[str, Any]]) -> MeasuredCheckpoint | None:
    """The save of median bytes a parameter among the rows that measured one (the middle one, not an average,
    so its figures are one save's); None where none did."""
    saves = sorted((s for s in (measured_checkpoint(measurements(row)) for row in rows) if s is not None),
                   key=lambda save: save.bytes_per_parameter)
    return saves[len(saves) // 2] if saves else None


# What `activations_at` reads of a row's `workload_description`, by family: a Llama block's bytes also follow
# its key/value heads and its MLP's width (harness.derive.activations.llama_block_activations).
SHAPE_KEYS = {"gpt": ("seq_len", "n_embd", "n_head", "n_layer"),
              "llama": ("seq_len", "n_embd", "n_head", "n_layer", "n_kv_head", "intermediate_size")}


def transformer_shape(described: Mapping[str, Any] | None, device: str = "cpu") -> dict[str, Any] | None:
    """A row's `workload_description` as the shape `activations_at` reads, where it is a transformer's: its family,
    its sizes (`SHAPE_KEYS`) and the row's `device`, whose kernels decide what a Llama block's RMSNorm saves."""
    family = (described or {}).get("family")
    if family not in SHAPE_KEYS:
        return None
    return {"family": family, "device": str(device), **{key: int(described[key]) for key in SHAPE_KEYS[family]}}


def on_the_wire(schedule: Sequence[Scheduled], facts: StrategyFacts, strategy: str, options: Mapping[str, Any],
                backward_s: float) -> tuple[tuple[Scheduled, ...], tuple[str, ...]]:
    """The counted schedule as the network sees it, and a note for each type whose calls changed: the
    counter sees what the strategy hands its library, and a library that fuses (Horovod's tensor fusion,
    Strategy.wire_calls) sends fewer, larger collectives. Latency is paid per collective on the wire, so
    pricing the handed-over calls would charge Horovod's per-tensor submissions as that many all-reduces."""
    wired, notes = [], []
    for item in schedule:
        calls = item.calls if item.group is not None else facts.wire_calls(
            strategy, options, item.collective, item.calls, item.calls * item.size_bytes, backward_s)
        if calls != item.calls:
            notes.append(f"{item.calls:g} counted {item.collective} calls per step priced as {calls:g} on the wire "
                         f"({strategy} fuses what arrives within its cycle over a {backward_s * 1e3:.3g} ms backward)")
            item = replace(item, calls=calls, size_bytes=item.size_bytes * item.calls / calls)
        wired.append(item)
    return tuple(wired), tuple(notes)


# ---- a basis from a description ------------------------------------------------------------------------


def description_basis(*, strategy: str, parameters: int, compute_s: float, gradient_element_bytes: float = 4,
                      gathered_element_bytes: float | None = None, per_device_batch: int = 1,
                      global_batch: int | None = None, recipe: str = "autocast", exposed_fraction: float = 1.0,
                      options: Mapping[str, Any] | None = None, workload: str = "described",
                      shape: Mapping[str, int] | None = None,
                      layout_schedule: Callable[..., tuple[tuple[Scheduled, ...], Any, int]] | None = None,
                      compute_source: str = "given") -> Basis:
    """A model of `parameters` whose step takes `compute_s` per device at `per_device_batch` samples, one
    micro-batch per step; the collectives are the strategy's own expected traffic (one call per collective
    type: bucketing's extra latency is not in it); `exposed_fraction` is f, exposed = f x priced communication
    (1: none overlapped; above 1: the step's collectives cost more than priced). Strong scaling keeps `global_batch` (default: per_device_batch x 1024, the batch of the largest
    default world size, so that every default world size can split it). `shape` (seq_len, n_embd, n_head,
    n_layer of a transformer) adds the activations a rank holds, every block whole and checkpointed. `layout_schedule`:
    a hybrid's (tensor parallelism, a pipeline) schedule at each size, `harness plan`'s for its layout
    (`Basis.layout_schedule`), which makes the basis grouped. `compute_source` says where `compute_s` came from
    (given, or from FLOPs)."""
    if parameters < 1 or not (compute_s > 0 and math.isfinite(compute_s)):
        raise SpecError(f"a description needs parameters >= 1 and compute seconds > 0, got {parameters} and {compute_s}")
    if gradient_element_bytes <= 0 or (gathered_element_bytes is not None and gathered_element_bytes <= 0):
        raise SpecError("bytes per gradient (and gathered) element must be > 0")
    from harness.project.facts import REGISTRY_FACTS

    if REGISTRY_FACTS.expert_parallel_degree(strategy, dict(options or {}), 1):
        raise SpecError(f"{strategy} shards an MoE model's experts, whose traffic a parameter count does not give: "
                        "harness plan --model or --shape ...,experts=N lays it out; harness project takes its rows")
    if per_device_batch < 1:
        raise SpecError(f"per-device batch must be >= 1, got {per_device_batch}")
    if isinstance(exposed_fraction, bool) or not isinstance(exposed_fraction, (int, float)) or not (
            math.isfinite(exposed_fraction) and exposed_fraction >= 0):
        raise SpecError(f"exposed fraction f must be a finite number >= 0 (exposed time over priced communication; "
                        f"above 1 where collectives cost more in the step than priced), got {exposed_fraction!r}")
    gathered = gradient_element_bytes if gathered_element_bytes is None else gathered_element_bytes
    source = NO_OVERLAP if exposed_fraction == 1.0 else f"given: f = {exposed_fraction:g} (exposed / priced communication)"
    return Basis(workload=workload, strategy=strategy, options=dict(options or {}), precision=recipe, recipe=recipe,
                 parameters=int(parameters), kept_whole=0, tokens_per_sample=None,
                 per_device_batch=float(per_device_batch), global_batch=int(global_batch or per_device_batch * max(DEFAULT_WORLD_SIZES)),
                 micro_batch=per_device_batch, compute_s=float(compute_s), world_size=None, micro_batches=1,
                 schedule=(), gradient_bytes=int(round(parameters * gradient_element_bytes)),
                 gathered_bytes=int(round(parameters * gathered)), exposed_fraction=exposed_fraction,
                 overlap_source=source, shape=dict(shape) if shape else None, model_parameters=int(parameters),
                 grouped=layout_schedule is not None, layout_schedule=layout_schedule,
                 compute_source=compute_source)


# ---- describing the target, recording, printing ---------------------------------------------------------


def describe_model(model: CommModel) -> dict[str, Any]:
    """Everything the target's pricing depends on, to reproduce it."""
    if isinstance(model, ClusterModel):
        cluster: Cluster = model.cluster
        return {"kind": "cluster", "name": cluster.name, "description": cluster.description,
                "gpus_per_node": cluster.gpus_per_node,
                "intra_node_bandwidth_GBps": cluster.intra_node.bandwidth_bytes_per_s / 1e9,
                "intra_node_latency_us": cluster.intra_node.latency_s * 1e6,
                "inter_node_bandwidth_GBps": cluster.inter_node.bandwidth_bytes_per_s / 1e9,
                "inter_node_latency_us": cluster.inter_node.latency_s * 1e6, "sources": dict(cluster.sources),
                "library": str(model.library), "forced_algorithms": {k: str(v) for k, v in model.algorithms.items()},
                "algorithm_choice": "least modelled time per call among the library's algorithms, where not forced",
                "library_algorithms": {c: [str(a) for a in algorithms]
                                       for c, algorithms in LIBRARY_ALGORITHMS[model.library].items()}}
    if isinstance(model, Calibration):
        return {"kind": "calibration", "backend": model.backend, "device": model.device,
                "fits": {name: {"algorithm": str(f.algorithm), "latency_s": f.latency_s,
                                "seconds_per_byte": f.seconds_per_byte, "fixed_s": f.fixed_s,
                                "world_sizes": list(f.world_sizes), "rows": len(f.residuals)}
                         for name, f in model.fits.items()}}
    return {"kind": type(model).__name__}


ASSUMPTIONS = {
    "compute": "the strategy's world-size-1 step where the rows hold one, else the compute-only step time, at the "
               "measured per-device batch; strong scaling scales it by the per-device share of the global batch",
    "schedule": "collectives as counted per step; calls and sizes follow the strategy's expected traffic "
                "from the measured to the target world size; data-parallel groups span all ranks",
    "overlap": f"step beyond compute = max(f x comm, comm - {BACKWARD_SHARE:.3g} x compute), f measured at >= 2 "
               "ranks",
    "algorithm": "on a described cluster, each call by the least modelled time among its library's algorithms "
                 "(NCCL: ring or tree for all-reduce), unless --algorithm forces one; a calibration's own",
    "memory": "the strategy's model_state_plan at the target (ZeRO paper, sec. 5.1)",
    "interval": f"percentiles {INTERVAL_PERCENTILES} of measured/fitted over each collective's calibration rows",
}


def projected_record(point: Projected, model: CommModel, comm_sources: Sequence[str] = (),
                     created: str | None = None) -> dict[str, Any]:
    """A projected row: kind "projection", status "projected", with every input it came from."""
    b = point.basis
    checkpoint = checkpoint_fields(point.checkpoint) if point.checkpoint is not None else {}
    assumptions = ASSUMPTIONS | ({"checkpoint": CHECKPOINT_ASSUMPTION} if point.checkpoint is not None else {})
    return {
        "kind": PROJECTION_KIND, "status": PROJECTED, "projection_id": uuid.uuid4().hex,
        "created_utc": created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "workload": b.workload, "strategy": b.strategy, "options": dict(b.options), "precision": b.precision,
        "measured_under": b.conditions,
        "scaling": point.scaling.value, "world_size": point.world_size, "global_batch": point.global_batch,
        "per_device_batch": point.per_device_batch, "micro_batches_per_step": point.micro_batches,
        "compute_s": point.compute_s, "comm_s": point.comm_s, "step_beyond_compute_s": point.exposed_s,
        "step_time_s": point.step_s, "step_time_low_s": point.step_low_s, "step_time_high_s": point.step_high_s,
        "samples_per_s": point.samples_per_s, "tokens_per_s": point.tokens_per_s,
        f"{point.scaling.value}_efficiency_vs_1_device": point.efficiency,
        "step_beyond_compute_share": point.exposed_share, "model_state_bytes_per_rank": point.model_state_bytes_per_rank,
        "activation_bytes_per_rank": point.activation_bytes_per_rank,
        "activation_bytes_checkpointed_per_rank": point.activation_bytes_checkpointed_per_rank,
        "wire_bytes_per_step_per_rank": point.wire_bytes_per_rank, **checkpoint,
        "schedule": [asdict(item) | {"ranks": item.ranks(point.world_size), "algorithm": algorithm}
                     for item, algorithm in zip(point.schedule, point.algorithms, strict=True)],
        "notes": list(b.notes + point.notes),
        "inputs": {"rows": list(b.run_ids), "comm_rows": list(comm_sources), "target": describe_model(model),
                   "basis": {"world_size": b.world_size, "per_device_batch": b.per_device_batch,
                             "global_batch": b.global_batch, "micro_batch": b.micro_batch,
                             "micro_batches_per_step": b.micro_batches, "compute_s": b.compute_s,
                             "compute_source": b.compute_source,
                             "parameters": b.parameters, "kept_whole": b.kept_whole, "recipe": b.recipe,
                             "gradient_bytes": b.gradient_bytes, "gathered_bytes": b.gathered_bytes,
                             "schedule": [asdict(item) for item in b.schedule],
                             "exposed_fraction": b.exposed_fraction, "overlap_source": b.overlap_source},
                   "assumptions": assumptions},
    }


def format_table(points: Sequence[Projected]) -> str:
    """One block per basis: a line per scaling and world size."""
    lines: list[str] = []
    header = (f"{'scaling':<7} {'N':>5} {'global batch':>12} {'compute ms':>11} {'comm ms':>10} {'beyond ms':>11} "
              f"{'step ms':>10} {'step ms band':>19} {'samples/s':>11} {'efficiency':>10} {'beyond':>8} "
              f"{'states GiB/rank':>15} {'acts GiB (ckpt)':>17}  algorithms")
    by_basis: dict[int, list[Projected]] = {}
    for point in points:
        by_basis.setdefault(id(point.basis), []).append(point)
    for group in by_basis.values():
        b = group[0].basis
        where = f"measured at world size {b.world_size}" if b.world_size else "described"
        lines += ["", f"{b.label} ({where}; compute {b.compute_s * 1e3:.4g} ms at {b.per_device_batch:g} samples/device "
                      f"from {b.compute_source}, beyond: the step beyond it; overlap: {b.overlap_source})", header,
                  "-" * len(header)]
        for p in group:
            band = (f"{p.step_low_s * 1e3:.4g}-{p.step_high_s * 1e3:.4g}" if p.step_low_s is not None else "-")
            lines.append(f"{p.scaling.value:<7} {p.world_size:>5} {p.global_batch:>12g} {p.compute_s * 1e3:>11.4g} "
                         f"{p.comm_s * 1e3:>10.4g} {p.exposed_s * 1e3:>11.4g} {p.step_s * 1e3:>10.4g} {band:>19} "
                         f"{p.samples_per_s:>11.4g} {p.efficiency:>10.1%} {p.exposed_share:>8.1%} "
                         f"{p.model_state_bytes_per_rank / 2 ** 30:>15.4g} {_activations_text(p):>17}  "
                         f"{algorithms_text(p)}")
        costs = [(p.world_size, p.checkpoint) for p in group if p.checkpoint is not None]
        if costs:
            lines += [f"  {line}" for line in checkpoint_lines(costs)]
        for note in dict.fromkeys(n for p in group for n in b.notes + p.notes):
            lines.append(f"  note: {note}")
    return "\n".join(lines).lstrip("\n")


def _activations_text(point: Projected) -> str:
    """Every block whole (every block checkpointed), GiB per rank; "-" where not known."""
    if point.activation_bytes_per_rank is None:
        return "-"
    return (f"{point.activation_bytes_per_rank / 2 ** 30:.4g} "
            f"({point.activation_bytes_checkpointed_per_rank / 2 ** 30:.4g})")


def algorithms_text(point: Projected) -> str:
    """`collective=algorithm` for each schedule entry (once each), e.g. `all_reduce=tree all_gather=ring`."""
    return " ".join(dict.fromkeys(f"{item.collective}={algorithm}"
                                  for item, algorithm in zip(point.schedule, point.algorithms, strict=True)))


def default_model(cluster: Cluster | None, calibration: Calibration | None,
                  algorithms: Mapping[str, str] | None = None, library: str | None = None) -> CommModel:
    """The target's pricing: the described cluster where given, driven by `library` (default NCCL), else the
    calibration (one level)."""
    if cluster is not None:
        return ClusterModel(cluster, dict(algorithms or {}), library or Library.NCCL)
    if calibration is not None:
        if algorithms or library is not None:
            raise SpecError(f"{'--algorithm' if algorithms else '--library'} chooses among a cluster's algorithms; "
                            "a calibration was fitted with its own")
        return calibration
    raise SpecError("a projection needs a target: --cluster PRESET|FILE.toml, or --comm COMM_ROWS to project "
                    f"onto the calibrated host's network (modelled collectives: {', '.join(DEFAULT_ALGORITHMS)})")
