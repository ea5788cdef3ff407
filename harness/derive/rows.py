"""Raw rows as plain dicts: reading them and the few accessors every derivation shares.

A row is what `harness.record` wrote: {"schema_version", "run_id", "cell_id", "repeat", "status",
"message", "spec": {...}, "measurements": {...}, "environment": {...}, ...}. Nothing here builds a
`RunSpec` (that validates against the strategy and workload registries, which import torch): a report
of rows written elsewhere, or by an older parbench, needs neither.

    python -c "from harness.derive.rows import load_rows; print(len(load_rows(['results/reference/ci-cpu/smoke.jsonl'])))"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from harness.record import read_rows

Row = Mapping[str, Any]
OK = "ok"

# Spec fields that identify what a cell computed; with `options` they make the cell.
SPEC_FIELDS = ("workload", "strategy", "world_size", "global_batch", "micro_batch", "precision",
               "warmup_steps", "timed_steps", "seed", "device", "nnodes")


def load_rows(paths: Iterable[Path | str]) -> list[dict[str, Any]]:
    """Cell rows of every file in order (collective-benchmark rows are read by `harness.record.read_rows`
    with kind="commbench")."""
    return read_rows([Path(p) for p in paths])


def spec(row: Row) -> Mapping[str, Any]:
    return row["spec"]


def measurements(row: Row) -> Mapping[str, Any]:
    return row.get("measurements") or {}


def is_ok(row: Row) -> bool:
    return row.get("status") == OK


def options_text(row: Row) -> str:
    """The cell's explicit strategy options as `k=v,k=v` (sorted, as RunSpec keeps them)."""
    options = spec(row).get("options") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(options.items()))


def label(row: Row) -> str:
    """The same short name `RunSpec.label` gives, built from the dict."""
    s = spec(row)
    options = options_text(row)
    tail = f"[{options}]" if options else ""
    nodes = f"x{s['nnodes']}nodes" if s.get("nnodes", 1) > 1 else ""
    return (f"{s['workload']}/{s['strategy']}{tail}/ws{s['world_size']}{nodes}/gb{s['global_batch']}"
            f"/mb{s['micro_batch']}/{s['precision']}/{s['device']}")


def shared_device(row: Row) -> bool:
    """Several ranks on one GPU: valid for memory and correctness, meaningless for speed."""
    return bool(measurements(row).get("shared_device", False))
