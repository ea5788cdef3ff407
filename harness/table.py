"""Rows as a pandas DataFrame: one line per launch, spec fields and scalar measurements as columns.

Everything downstream of a run (report, compare, the asv suite) reads rows through `load_table`, so
a column means the same thing everywhere. Lists and dicts (per-step times, per-rank figures, collectives)
stay in the row objects; the table keeps what a reader filters, groups and plots by.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from harness.derive.memory import memory_columns
from harness.record import read_results
from harness.spec import RunResult

SPEC_COLUMNS = ["workload", "strategy", "world_size", "global_batch", "micro_batch", "precision",
                "warmup_steps", "timed_steps", "seed", "device", "nnodes"]


def result_record(result: RunResult) -> dict:
    spec = result.spec
    record = {
        "run_id": result.run_id, "cell_id": spec.cell_id, "label": spec.label, "repeat": result.repeat,
        "status": result.status.value, "message": result.message, "started_at": result.started_at,
        "wall_time_s": result.wall_time_s, "options": ",".join(f"{k}={v}" for k, v in spec.options),
        **{name: getattr(spec, name) for name in SPEC_COLUMNS},
        "precision": spec.precision.value, "device": spec.device.value,
        "git_sha": result.environment.get("git_sha"), "torch": result.environment.get("torch"),
        "host": result.environment.get("host"),
    }
    for name, value in result.measurements.items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            record[name] = value
    for kind, volume in (result.measurements.get("comm_bytes_per_step_max_rank") or {}).items():
        record[f"comm_{kind}_bytes_per_step"] = volume
    record.update(memory_columns(result.measurements))   # derived when read (harness.derive.memory)
    record.setdefault("shared_device", False)
    return record


def results_table(results: Sequence[RunResult]) -> pd.DataFrame:
    return pd.DataFrame([result_record(r) for r in results])


def load_table(paths: Iterable[Path]) -> tuple[pd.DataFrame, list[RunResult]]:
    """The rows of the run results files (commbench rows are skipped) as a table, and the rows."""
    results = read_results(paths)
    return results_table(results), results
