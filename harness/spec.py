"""What to run (`RunSpec`) and what came of it (`RunResult`): the one data type of the pipeline.

A `RunSpec` checks its own fields on construction; what needs the workload and strategy registries (the
names, the strategy's options, its layout of the batch, its rules) is checked above this module by
harness.strategies.checked, which every matrix applies, so a bad matrix fails before any process is launched.
A `RunResult` is one launch of one cell; it is appended to a JSONL file as a row and every report is computed
from those rows alone.

    python -c "from harness.spec import RunSpec; from harness.strategies import checked, layout_of;
        print(layout_of(checked(RunSpec(workload='gpt-tiny', strategy='ddp', world_size=2, global_batch=16,
        micro_batch=8))))"
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from harness.derive.identity import identity_of

# Bump when a row's meaning changes; readers refuse rows from a newer schema. 2: rows hold measurements and
# the strategy's facts only; every derived figure is computed when rows are read (harness.derive), and rows
# of schema 1 (which also stored figures derived in the rank) still read.
SCHEMA_VERSION = 2


class SpecError(ValueError):
    """A spec that cannot be run; the message is one line naming the field and what is allowed."""


class Status(enum.StrEnum):
    OK = "ok"
    FAILED = "failed"
    OOM = "oom"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"
    INTERRUPTED = "interrupted"     # a stop signal ended the run while this launch ran (harness.launch.interrupt)


class Precision(enum.StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"      # with dynamic loss scaling (harness.strategies.loss_scaling)

    @property
    def is_mixed(self) -> bool:
        """A 16-bit precision computed under autocast (or a library's own recipe) beside fp32 state."""
        return self is not Precision.FP32


class DeviceKind(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


OptionValue = bool | int | float | str | None


def _choice(enum_type: type[enum.StrEnum], value: Any, field_name: str) -> enum.StrEnum:
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(member.value for member in enum_type)
        raise SpecError(f"{field_name} {value!r} is not one of: {allowed}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """How a spec's global batch is split; derived by the strategy (pipeline stages change it)."""

    data_parallel: int          # replicas that each see a different slice of the global batch
    pipeline_stages: int        # ranks one replica is cut across (1 unless pipeline parallel)
    per_replica_batch: int      # samples per optimizer step per data-parallel replica
    micro_batches: int          # forward/backward passes per replica per optimizer step (accumulation)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One cell of a matrix. Its fields checked on construction (harness.strategies.checked: the rest); see
    `Layout` for how the batch is split."""

    workload: str                       # a key of workloads.WORKLOADS
    strategy: str                       # a key of harness.strategies.STRATEGIES
    world_size: int                     # ranks (processes; devices for DataParallel)
    global_batch: int                   # samples per optimizer step, all ranks together
    micro_batch: int                    # samples per forward/backward pass on one rank
    precision: Precision = Precision.FP32
    warmup_steps: int = 2               # untimed optimizer steps before the timed ones
    timed_steps: int = 5                # optimizer steps whose time is recorded
    repeats: int = 1                    # separate launches of this cell
    seed: int = 0                       # model init and synthetic data
    device: DeviceKind = DeviceKind.CPU
    nnodes: int = 1                     # hosts the ranks are spread over
    options: tuple[tuple[str, OptionValue], ...] = ()  # strategy options, sorted by name

    def __post_init__(self) -> None:
        # Normalise in place: the dataclass is frozen, so go through object.__setattr__.
        object.__setattr__(self, "precision", _choice(Precision, self.precision, "precision"))
        object.__setattr__(self, "device", _choice(DeviceKind, self.device, "device"))
        pairs = self.options.items() if isinstance(self.options, Mapping) else self.options
        object.__setattr__(self, "options", tuple(sorted((str(k), v) for k, v in pairs)))
        for name in ("world_size", "global_batch", "micro_batch", "timed_steps", "repeats", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{name} must be a whole number >= 1, got {value!r}")
        for name in ("warmup_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{name} must be a whole number >= 0, got {value!r}")
        if self.world_size % self.nnodes:
            raise SpecError(f"world_size {self.world_size} must be divisible by nnodes {self.nnodes}")
        # What needs the registries (the workload, the strategy's options, layout and rules) is checked above this
        # module, by harness.strategies.checked: the registries import this one.

    @property
    def options_dict(self) -> dict[str, OptionValue]:
        """The options given explicitly; harness.strategies.resolved_options adds the strategy's defaults."""
        return dict(self.options)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["precision"] = self.precision.value
        data["device"] = self.device.value
        data["options"] = dict(self.options)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"unknown spec fields {unknown}; known: {sorted(known)}")
        return cls(**dict(data))

    def replace(self, **changes: Any) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    @property
    def cell_id(self) -> str:
        """Stable identity of the spec: every field but `repeats` (rows of one cell are its repeats). A row's
        cell is this spec under its conditions (network, placement, host type): harness.derive.identity."""
        identity = self.to_dict()
        identity.pop("repeats")
        canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    @property
    def label(self) -> str:
        """Short human name for tables and logs."""
        options = ",".join(f"{k}={v}" for k, v in self.options)
        tail = f"[{options}]" if options else ""
        nodes = f"x{self.nnodes}nodes" if self.nnodes > 1 else ""
        return (f"{self.workload}/{self.strategy}{tail}/ws{self.world_size}{nodes}/gb{self.global_batch}"
                f"/mb{self.micro_batch}/{self.precision.value}/{self.device.value}")


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One launch of one cell: raw measurements, its status and everything needed to reproduce it."""

    spec: RunSpec
    status: Status
    message: str = ""                   # one line: why it failed or was skipped; empty when ok
    run_id: str                         # unique per row
    repeat: int = 0                     # which of spec.repeats launches this is
    measurements: dict[str, Any] = field(default_factory=dict)   # raw figures; names carry units
    environment: dict[str, Any] = field(default_factory=dict)    # versions, hardware, git, env vars
    launch_command: list[str] = field(default_factory=list)
    node_launch_commands: list[list[str]] = field(default_factory=list)  # multi-node: one per node, in order
    started_at: str = ""                # ISO 8601, UTC
    wall_time_s: float = 0.0            # launch to exit, as seen by the harness
    artifacts_dir: str = ""             # the cell's folder: spec.json, log.txt, per-rank files
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", _choice(Status, self.status, "status"))

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec.to_dict()
        return {
            "schema_version": self.schema_version,
            "run_id": self.run_id,
            "cell_id": identity_of(spec, self.environment),
            "repeat": self.repeat,
            "status": self.status.value,
            "message": self.message,
            "spec": spec,
            "measurements": self.measurements,
            "environment": self.environment,
            "launch_command": self.launch_command,
            "node_launch_commands": self.node_launch_commands,
            "started_at": self.started_at,
            "wall_time_s": self.wall_time_s,
            "artifacts_dir": self.artifacts_dir,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunResult":
        version = data.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise SpecError(f"schema_version {version!r} is not readable (this parbench reads <= {SCHEMA_VERSION})")
        return cls(
            spec=RunSpec.from_dict(data["spec"]),
            status=data["status"],
            message=data.get("message", ""),
            run_id=data["run_id"],
            repeat=data.get("repeat", 0),
            measurements=dict(data.get("measurements", {})),
            environment=dict(data.get("environment", {})),
            launch_command=list(data.get("launch_command", [])),
            node_launch_commands=[list(c) for c in data.get("node_launch_commands", [])],
            started_at=data.get("started_at", ""),
            wall_time_s=float(data.get("wall_time_s", 0.0)),
            artifacts_dir=data.get("artifacts_dir", ""),
            schema_version=version,
        )
