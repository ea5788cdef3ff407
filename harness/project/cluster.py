"""Cluster descriptions: GPUs per node, the link inside a node and the link between nodes.

    python -c "from harness.project.cluster import load_cluster; print(load_cluster('dgx-h100-ib',
        overrides=['inter_node_bandwidth_GBps=100']))"

Units and directions, the same in presets, TOML files and overrides (docs/projection.md). "One direction":
what a GPU (a node) sends while it receives as much, links being full duplex.

| key | unit | what it is |
| --- | --- | --- |
| `gpus_per_node` | count | ranks one node holds; ranks fill whole nodes |
| `intra_node_bandwidth_GBps` | 1e9 bytes/s | one GPU to the others of its node, one direction |
| `intra_node_latency_us` | microseconds | alpha of one step between two GPUs of a node |
| `inter_node_bandwidth_GBps` | 1e9 bytes/s | one node, all its NICs, to other nodes, one direction |
| `inter_node_latency_us` | microseconds | alpha of one step between GPUs of different nodes |
| `gpu` | name | optional: the GPU as torch names it, a key of harness.derive.peaks.PEAKS (its datasheet peaks) |
| `gpu_memory_GiB` | 2^30 bytes | optional: one GPU's memory, as its datasheet gives it |

The two GPU keys matter only to `harness plan` (what fits, and compute from FLOPs); the communication model
needs none of them.

The inter-node bandwidth is per node, not per GPU, because the node's GPUs share its NICs: when all g GPUs
of a node talk to other nodes at once (the inter-node phase of a hierarchical all-reduce, an all-to-all
round), each gets 1/g of it; a ring that crosses the node boundary once per channel gets all of it
(harness.project.collectives says which algorithm does which). Datasheets give NIC rates in Gb/s: divide
by 8 (400 Gb/s = 50 GB/s). A TOML file holds these keys at top level, with an optional `description` and
an optional `[sources]` table (key -> where the value comes from), as the presets in
harness.project.presets do.
"""

from __future__ import annotations

import math
import numbers
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness.derive.peaks import PEAKS
from harness.spec import SpecError

GBPS = 1e9          # bytes per second in one GBps
US = 1e-6           # seconds in one microsecond

NUMBER_KEYS = ("intra_node_bandwidth_GBps", "intra_node_latency_us", "inter_node_bandwidth_GBps",
               "inter_node_latency_us")
REQUIRED_KEYS = ("gpus_per_node", *NUMBER_KEYS)
GPU_KEYS = ("gpu", "gpu_memory_GiB")
OPTIONAL_KEYS = (*GPU_KEYS, "description", "sources")


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One level of the network, in the alpha-beta model: a step that sends k bytes takes
    latency_s + k / bandwidth_bytes_per_s."""

    latency_s: float                    # alpha: seconds per step, whatever its size
    bandwidth_bytes_per_s: float        # one direction; beta = 1 / this

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise SpecError(f"latency must be a finite number of seconds >= 0, got {self.latency_s!r}")
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise SpecError(f"bandwidth must be a finite number of bytes/s > 0, got {self.bandwidth_bytes_per_s!r}")

    @property
    def seconds_per_byte(self) -> float:
        return 1.0 / self.bandwidth_bytes_per_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Nodes of `gpus_per_node` GPUs; `intra_node` is one GPU's link to its node's other GPUs, `inter_node`
    one node's link (all its NICs) to the other nodes. Units and directions: module docstring."""

    name: str
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    description: str = ""
    sources: Mapping[str, str] = field(default_factory=dict)     # key -> public source of its value
    gpu: str = ""                           # a key of harness.derive.peaks.PEAKS; "" where not described
    gpu_memory_GiB: float | None = None     # one GPU's memory; None where not described

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise SpecError(f"gpus_per_node must be a whole number >= 1, got {self.gpus_per_node!r}")

    def layout(self, ranks: int) -> "NodeLayout":
        return node_layout(ranks, self.gpus_per_node)

    def seen_by_interleaved_groups(self, stride: int) -> "Cluster":
        """The cluster as one of several process groups that run at once sees it, whose members are `stride`
        ranks apart (a 2-D mesh's dp group, one member per tp slice; the others hold the ranks between): a node
        holds gpus_per_node / stride members of each group (1 where stride >= gpus_per_node), and min(stride,
        gpus_per_node) groups cross its boundary at once, each with that share of the node's NICs. A GPU's link
        inside its node is its own. Stride 1 is the cluster itself."""
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise SpecError(f"a group's stride must be a whole number >= 1, got {stride!r}")
        sharing = min(stride, self.gpus_per_node)
        if stride == 1:
            return self
        if self.gpus_per_node % sharing:
            raise SpecError(f"groups {stride} ranks apart do not tile nodes of {self.gpus_per_node} GPUs; allowed: "
                            f"a divisor or a multiple of {self.gpus_per_node}")
        return Cluster(name=f"{self.name}, 1 of {sharing} interleaved groups", gpus_per_node=self.gpus_per_node // sharing,
                       intra_node=self.intra_node,
                       inter_node=Link(latency_s=self.inter_node.latency_s,
                                       bandwidth_bytes_per_s=self.inter_node.bandwidth_bytes_per_s / sharing),
                       description=self.description, sources=self.sources, gpu=self.gpu,
                       gpu_memory_GiB=self.gpu_memory_GiB)


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Where `nodes` x `ranks_per_node` ranks sit: packed onto whole nodes, as the harness places them."""

    nodes: int
    ranks_per_node: int

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


def node_layout(ranks: int, gpus_per_node: int) -> NodeLayout:
    """Ranks packed onto nodes: fewer than a node's GPUs share one node; more must fill whole nodes (a
    partly filled node would make its NICs' share per GPU differ from the others')."""
    if isinstance(ranks, bool) or not isinstance(ranks, numbers.Integral) or ranks < 1:
        raise SpecError(f"ranks must be a whole number >= 1, got {ranks!r}")
    ranks = int(ranks)
    if ranks <= gpus_per_node:
        return NodeLayout(1, ranks)
    if ranks % gpus_per_node:
        raise SpecError(f"ranks {ranks} do not fill whole nodes of {gpus_per_node} GPUs; allowed: up to "
                        f"{gpus_per_node}, or a multiple of {gpus_per_node}")
    return NodeLayout(ranks // gpus_per_node, gpus_per_node)


# ---- loading: presets, TOML files, key=value overrides -------------------------------------------------


def cluster_from_mapping(name: str, values: Mapping[str, Any]) -> Cluster:
    """A cluster from the keys of the module docstring; a missing, unknown or out-of-range key is a
    one-line SpecError naming it and what is allowed."""
    unknown = sorted(set(values) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise SpecError(f"cluster {name!r}: unknown key {unknown[0]!r}; allowed: "
                        f"{', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)}")
    missing = [key for key in REQUIRED_KEYS if key not in values]
    if missing:
        raise SpecError(f"cluster {name!r}: missing {missing[0]!r}; a cluster needs {', '.join(REQUIRED_KEYS)}")
    gpus = values["gpus_per_node"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise SpecError(f"cluster {name!r}: gpus_per_node must be a whole number >= 1, got {gpus!r}")
    numbers = {key: _number(name, key, values[key]) for key in NUMBER_KEYS}
    for key in ("intra_node_bandwidth_GBps", "inter_node_bandwidth_GBps"):
        if numbers[key] <= 0:
            raise SpecError(f"cluster {name!r}: {key} must be > 0 (1e9 bytes/s, one direction), got {numbers[key]:g}")
    for key in ("intra_node_latency_us", "inter_node_latency_us"):
        if numbers[key] < 0:
            raise SpecError(f"cluster {name!r}: {key} must be >= 0 (microseconds per step), got {numbers[key]:g}")
    sources = values.get("sources", {})
    if not isinstance(sources, Mapping) or not all(isinstance(v, str) for v in sources.values()):
        raise SpecError(f"cluster {name!r}: sources must be a table of key = \"where the value comes from\"")
    strays = sorted(set(sources) - set(REQUIRED_KEYS) - set(GPU_KEYS))
    if strays:
        raise SpecError(f"cluster {name!r}: sources names {strays[0]!r}, which is not one of: "
                        f"{', '.join(REQUIRED_KEYS + GPU_KEYS)}")
    description = values.get("description", "")
    if not isinstance(description, str):
        raise SpecError(f"cluster {name!r}: description must be a string, got {description!r}")
    gpu, memory = _gpu(name, values)
    return Cluster(
        name=name, gpus_per_node=gpus, description=description, sources=dict(sources), gpu=gpu, gpu_memory_GiB=memory,
        intra_node=Link(latency_s=numbers["intra_node_latency_us"] * US,
                        bandwidth_bytes_per_s=numbers["intra_node_bandwidth_GBps"] * GBPS),
        inter_node=Link(latency_s=numbers["inter_node_latency_us"] * US,
                        bandwidth_bytes_per_s=numbers["inter_node_bandwidth_GBps"] * GBPS))


def _gpu(name: str, values: Mapping[str, Any]) -> tuple[str, float | None]:
    """The optional GPU keys: a device name harness.derive.peaks knows, and a memory > 0."""
    gpu = values.get("gpu", "")
    if not isinstance(gpu, str) or (gpu and gpu not in PEAKS):
        raise SpecError(f"cluster {name!r}: gpu {gpu!r} is not a device with datasheet peaks; known: "
                        f"{', '.join(PEAKS)}")
    memory = values.get("gpu_memory_GiB")
    if memory is not None and not _number(name, "gpu_memory_GiB", memory) > 0:
        raise SpecError(f"cluster {name!r}: gpu_memory_GiB must be > 0 (GiB of one GPU), got {memory!r}")
    return gpu, None if memory is None else float(memory)


def _number(name: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"cluster {name!r}: {key} must be a finite number, got {value!r}")
    return float(value)


def preset(name: str) -> Cluster:
    """A named cluster of harness.project.presets; an unknown name lists the known ones."""
    from harness.project.presets import PRESETS

    try:
        values = PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown cluster preset {name!r}; known: {', '.join(PRESETS)}") from None
    return cluster_from_mapping(name, values)


def parse_overrides(pairs: Sequence[str]) -> dict[str, float | int | str]:
    """`key=value` strings (as flags give them) -> {key: number}; `gpus_per_node` must be a whole number, `gpu` is
    a device name (text)."""
    parsed: dict[str, float | int | str] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or key not in REQUIRED_KEYS + GPU_KEYS:
            raise SpecError(f"cluster override {pair!r} must be KEY=NUMBER with KEY one of: "
                            f"{', '.join(REQUIRED_KEYS + GPU_KEYS)} (gpu=NAME)")
        if key == "gpu":
            parsed[key] = text.strip()
            continue
        try:
            parsed[key] = int(text) if key == "gpus_per_node" else float(text)
        except ValueError:
            kind = "a whole number" if key == "gpus_per_node" else "a number"
            raise SpecError(f"cluster override {key}: {text.strip()!r} is not {kind}") from None
    return parsed


def load_cluster(source: str | Path | None = None, overrides: Sequence[str] | Mapping[str, Any] = ()) -> Cluster:
    """A preset name or a TOML file path (anything ending in .toml), with `overrides` (key=value strings or
    a mapping) replacing its keys; with no source, the overrides must give every key. An overridden key
    loses its source: the value is now the user's."""
    values: dict[str, Any]
    if source is None:
        name, values = "custom", {}
    elif str(source).endswith(".toml"):
        path = Path(source)
        try:
            values = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise SpecError(f"cluster file {path}: cannot read ({error.strerror})") from None
        except tomllib.TOMLDecodeError as error:
            raise SpecError(f"cluster file {path}: not TOML ({error})") from None
        name = path.stem
    else:
        from harness.project.presets import PRESETS

        if str(source) not in PRESETS:
            raise SpecError(f"unknown cluster preset {str(source)!r}; known: {', '.join(PRESETS)} (or a .toml file)")
        name, values = str(source), dict(PRESETS[str(source)])
    changed = parse_overrides(overrides) if not isinstance(overrides, Mapping) else dict(overrides)
    if changed:
        values = {**values, **changed,
                  "sources": {k: v for k, v in values.get("sources", {}).items() if k not in changed}}
    return cluster_from_mapping(name, values)
