"""A cell's identity: what ran (its spec, less the repeat count) and the conditions that change what is
measured, from a row alone. Every reader that groups, matches or resumes rows keys on `cell_identity`.

    python -c "from harness.derive.identity import cell_identity; from harness.derive.rows import load_rows
rows = load_rows(['results/reference/emulated-reno/cells.jsonl']); print(len({cell_identity(r) for r in rows}))"

The conditions (issue 33, finding 1: the same spec at 50 and at 1000 Mbit/s is two cells, not one):
- the network: an emulated cluster's record (`environment.emulated_network`: nodes, link rate, shaping, TCP
  congestion control), less what does not change a measurement (the namespaces' addresses, a note, and the
  machine's cores, which the host type holds); none on real hosts;
- the placement: where the launcher put the ranks (`environment.placement`: one of harness.launch.placement's
  PLACEMENTS). The number of hosts a cell spans is its spec's `nnodes`, already part of the spec. Rows written
  before the placement was recorded are read as "emulated" where they record an emulated network, "local"
  where the cell ran on one node, and MULTI_HOST_UNRECORDED otherwise;
- the host type: the harness host's CPU model and core count and its GPUs' names (so their count), never the
  host's name, so that a baseline measured on another machine of the same kind still matches.
Software (versions, git SHA, environment variables) is not a condition: telling its effect apart is what
`compare` is for.

A row stores this identity as `cell_id` since the conditions joined it; older rows stored their spec's alone,
so readers recompute it from the row and never trust the stored one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

# Keys of `environment.emulated_network` that do not change what is measured: where the namespaces were
# addressed (a random subnet per run), a note for readers, and the machine's cores (part of the host type).
NETWORK_NOT_CONDITIONS = ("addresses", "note", "shared_machine_cores")
# harness.launch.placement's names (PLACEMENTS; tests/test_identity.py keeps these in step with it).
LOCAL, EMULATED = "local", "emulated"
MULTI_HOST_UNRECORDED = "several hosts (hostfile or slurm, not recorded)"


def spec_identity(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's fields that make its cell: every one but `repeats` (the rows of one cell are its repeats)."""
    return {key: value for key, value in spec.items() if key != "repeats"}


def placement_of(spec: Mapping[str, Any], environment: Mapping[str, Any]) -> str:
    """The placement a row records, or the one its other records imply (module docstring)."""
    recorded = environment.get("placement")
    if recorded:
        return str(recorded)
    if environment.get("emulated_network"):
        return EMULATED
    return LOCAL if int(spec.get("nnodes") or 1) == 1 else MULTI_HOST_UNRECORDED


def measuring_conditions(environment: Mapping[str, Any] | None) -> dict[str, Any]:
    """{"network": ..., "host": ...}: the conditions any row records, a `harness comm` row included."""
    environment = environment or {}
    network = environment.get("emulated_network")
    return {
        "network": ({key: value for key, value in sorted(network.items()) if key not in NETWORK_NOT_CONDITIONS}
                    if network else None),
        "host": {"cpu_model": environment.get("cpu_model"), "cpu_count": environment.get("cpu_count"),
                 "gpus": list(environment.get("gpus") or [])},
    }


def conditions_of(spec: Mapping[str, Any], environment: Mapping[str, Any] | None) -> dict[str, Any]:
    """{"network": ..., "placement": ..., "host": ...}: what changes a measurement besides the spec."""
    return {**measuring_conditions(environment), "placement": placement_of(spec, environment or {})}


def _digest(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def identity_of(spec: Mapping[str, Any], environment: Mapping[str, Any] | None) -> str:
    """The identity of a cell run with `spec` under `environment` (a row's, or the one a run captured)."""
    return _digest({"spec": spec_identity(spec), "conditions": conditions_of(spec, environment)})


def cell_identity(row: Mapping[str, Any]) -> str:
    """A row's cell, recomputed from its spec and environment (the stored `cell_id` of older rows is the
    spec's alone)."""
    return identity_of(row["spec"], row.get("environment"))


def row_conditions(row: Mapping[str, Any]) -> dict[str, Any]:
    return conditions_of(row["spec"], row.get("environment"))


def conditions_id(row: Mapping[str, Any]) -> str:
    """The conditions alone: cells of different specs measured alike share it (scaling references, the
    report's groups of comparable cells, the projection's bases)."""
    return _digest(row_conditions(row))


def network_of(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The network part of a row's conditions (a cell row's or a `harness comm` row's): None on real hosts."""
    return measuring_conditions(record.get("environment"))["network"]


def spec_id(row: Mapping[str, Any]) -> str:
    """The spec alone: rows of one spec under different conditions share it (to say why they do not match)."""
    return _digest(spec_identity(row["spec"]))


def network_tag(conditions: Mapping[str, Any]) -> str:
    """"@50Mbit/s" for an emulated network (the rate a reader must see on every line), "" for real hosts."""
    network = conditions.get("network")
    if not network:
        return ""
    rate = network.get("link_rate_bits_per_s")
    return f"@{rate / 1e6:g}Mbit/s" if rate else "@unshaped"


def _flat(conditions: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for part, value in conditions.items():
        if isinstance(value, Mapping):
            flat.update({f"{part}.{key}": inner for key, inner in value.items()})
        else:
            flat[part] = value
    return flat


def differences(these: Mapping[str, Any], those: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(condition, value here, value there) for each condition two sets of conditions differ in."""
    a, b = _flat(these), _flat(those)
    return [(key, a.get(key), b.get(key)) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _value(value: Any) -> str:
    if value is None or value == []:
        return "not recorded"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def describe_differences(these: Mapping[str, Any], those: Mapping[str, Any]) -> str:
    """One line: "network.link_rate_bits_per_s 50000000.0 here, 100000000.0 there; ..."."""
    return "; ".join(f"{_short(key)} {_value(a)} here, {_value(b)} there"
                     for key, a, b in differences(these, those))


def distinguishing_suffixes(entries: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """For each (name, conditions): the text to append to the name so that entries differing only in their
    conditions read apart: the network tag always, then "[key=value; ...]" with each condition that differs
    from another entry of the same name and tag (host type, placement, another network setting)."""
    tagged = [(name + network_tag(conditions), conditions) for name, conditions in entries]
    suffixes = []
    for name, conditions in tagged:
        keys = sorted({key for other_name, other in tagged if other_name == name
                       for key, _, _ in differences(conditions, other)})
        flat = _flat(conditions)
        extra = f" [{'; '.join(f'{_short(key)}={_value(flat.get(key))}' for key in keys)}]" if keys else ""
        suffixes.append(network_tag(conditions) + extra)
    return suffixes


def emulation_text(conditions: Mapping[str, Any]) -> str | None:
    """What an emulated row's figures are, for the report: None for real hosts."""
    network = conditions.get("network")
    if not network:
        return None
    cores = (conditions.get("host") or {}).get("cpu_count")
    return (f"an emulation: {network.get('nodes')} nodes that are network namespaces of one machine, whose "
            f"{f'{cores} ' if cores else ''}cores all their ranks share")
