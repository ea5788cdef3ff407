"""Rows -> one line per launch and one line per cell, every figure derived here, for every reader.

    python -c "from harness.derive.cells import cell_table; from harness.derive.rows import load_rows;
        print(cell_table(load_rows(['results/reference/ci-cpu/smoke.jsonl'])).T)"

`launch_table` gives one line per launch (any status) with its spec, step-time medians and throughput on
the basis chosen for the whole set (harness.derive.throughput), memory, communication, exposed time and
MFU. `cell_table` folds the launches of each cell (its spec under its conditions, harness.derive.identity:
the same spec at another link rate, placement or host type is another cell, labelled apart): the median across
ok launches, the interval of the throughput that their number supports, the parity verdict judged over every
row given, the scaling efficiencies and the step beyond the strategy's own world-size-1 step
(harness.derive.beyond_ws1). The console
summary (`harness run`), `harness report` and the asv suite read these tables and nothing else, so a
figure means the same wherever it is shown.
"""

from __future__ import annotations

from statistics import median
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from harness.derive.beyond_ws1 import step_beyond_ws1
from harness.derive.activations import predicted_activation_bytes
from harness.derive.comm import comm_columns
from harness.derive.experts import expert_columns
from harness.derive.sequence import sequence_columns
from harness.derive.compiled import cell_compile, compile_columns
from harness.derive.exposed import exposed_columns
from harness.derive.hosts import cell_host_load, row_host_load
from harness.derive.identity import (cell_identity, conditions_id, distinguishing_suffixes, emulation_text,
                                     identity_of, network_of, row_conditions)
from harness.derive.intervals import median_interval
from harness.derive.memory import memory_columns
from harness.derive.harness_overhead import BARE_STRATEGY, harness_overhead
from harness.derive.launches import last_rows
from harness.derive.parity import REFERENCE_STRATEGY, judge
from harness.derive.peaks import mfu, peak_flops_for, tf32_in_use
from harness.derive.rows import SPEC_FIELDS, Row, is_ok, label, measurements, options_text, shared_device, spec
from harness.derive.scaling import scaling_efficiency
from harness.derive.resume import checkpoint_columns
from harness.derive.server_link import server_link_columns
from harness.derive.techniques import technique_columns
from harness.derive.throughput import Basis, launch_throughput, throughput_basis

if TYPE_CHECKING:       # imported where a table is made: a plan reads this module's labels, not its tables
    import pandas as pd

CELL_FIELDS = ["workload", "strategy", "options", "world_size", "nnodes", "global_batch", "micro_batch",
               "precision", "device", "shared_device"]


def launch_record(row: Row, basis: Basis) -> dict[str, Any]:
    s, m = spec(row), measurements(row)
    record: dict[str, Any] = {
        "run_id": row.get("run_id"), "cell_id": cell_identity(row), "conditions_id": conditions_id(row),
        "label": label(row),
        "repeat": row.get("repeat", 0), "status": row.get("status"), "message": row.get("message", ""),
        "schema_version": row.get("schema_version"), "started_at": row.get("started_at"),
        "wall_time_s": row.get("wall_time_s"), "options": options_text(row), "shared_device": shared_device(row),
        **{name: s.get(name) for name in SPEC_FIELDS},
        "git_sha": (row.get("environment") or {}).get("git_sha"),
        "host": (row.get("environment") or {}).get("host"),
    }
    if not is_ok(row):
        return record
    record.update(launch_throughput(row, basis))
    record.update(_memory(m))
    record["activation_bytes_predicted"] = predicted_activation_bytes(s, m)
    record.update(technique_columns(m))
    record.update(_communication(m))
    record.update(expert_columns(m))
    record.update(sequence_columns(m))
    record.update(server_link_columns(m))
    record.update(checkpoint_columns(row))
    record.update(compile_columns(m))
    network = network_of(row) or {}
    record["link_rate_bits_per_s"] = network.get("link_rate_bits_per_s")     # an emulated network's, else None
    record.update(_exposed(m, int(s["world_size"])))
    record.update(_mfu(row, record))
    record.update(row_host_load(row))
    return record


def launch_table(rows: Sequence[Row], basis: Basis | None = None, context: Sequence[Row] = ()) -> pd.DataFrame:
    """One line per row, with its parity verdict judged over `rows` and `context` together (rows not shown
    that may hold a reference, such as the rest of a results file: harness.derive.parity)."""
    import pandas as pd

    basis = basis or throughput_basis(rows)
    shown_ids = {row.get("run_id") for row in rows}
    verdicts = judge(list(rows) + [row for row in context if row.get("run_id") not in shown_ids])
    shown = condition_labels(rows)
    records = []
    for row, parity in zip(rows, verdicts):
        record = launch_record(row, basis)
        record.update(shown[record["cell_id"]])
        record.update({"parity_verdict": parity.verdict.value, "parity_failed": ",".join(parity.failed),
                       "parity_note": parity.note})
        records.append(record)
    return pd.DataFrame(records)


def condition_labels(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Per cell (harness.derive.identity): its label with the conditions a reader must see to tell it from
    the other cells of `rows` ("@50Mbit/s" on an emulated cluster's; the host type or placement where cells
    of one spec differ in them), those conditions alone (`conditions`), and `emulation`, what an emulated
    cell's figures are (None on real hosts)."""
    cells: dict[str, tuple[str, dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault(cell_identity(row), (label(row), row_conditions(row)))
    suffixes = distinguishing_suffixes(list(cells.values()))
    return {identity: {"label": name + suffix, "conditions": suffix.strip(), "emulation": emulation_text(conditions)}
            for (identity, (name, conditions)), suffix in zip(cells.items(), suffixes)}


def _memory(m: dict) -> dict[str, Any]:
    """Peaks over the timed steps (largest rank) and model states measured and predicted
    (harness.derive.memory: the ZeRO paper's formula over the strategy's recorded plan)."""
    def largest(key: str) -> float | None:
        values = [v for v in m.get(f"{key}_by_rank") or () if v is not None]
        return max(values) if values else m.get(f"{key}_max")
    return {"peak_rss_bytes_max": largest("peak_rss_bytes"), "peak_allocated_bytes_max": largest("peak_allocated_bytes"),
            "peak_rss_since": m.get("peak_rss_since"), **memory_columns(m)}


def _communication(m: dict) -> dict[str, Any]:
    """Wire bytes per step per rank by collective and in all, counted and expected (harness.derive.comm)."""
    return comm_columns(m)


def _exposed(m: dict, world_size: int) -> dict[str, Any]:
    """The step beyond the compute-only baseline (harness.derive.exposed): exposed communication at >= 2
    ranks, the framework's own overhead at world size 1, where nothing is communicated."""
    return exposed_columns(m, world_size)


def _mfu(row: Row, figures: dict) -> dict[str, Any]:
    """MFU on the launch's derived throughput (harness.derive.peaks: PaLM, appendix B). A peak the user
    stated is used as the user's; rows of schema 1 stored it as `peak_flops_per_s` with source "user"."""
    m = measurements(row)
    user_peak = m.get("user_peak_flops_per_s")
    if user_peak is None and m.get("peak_flops_source") == "user":
        user_peak = m.get("peak_flops_per_s")
    peak = peak_flops_for(m.get("device_name", "cpu"), spec(row)["precision"], tf32_in_use(m), user_peak)
    if figures.get("samples_per_s") is None or m.get("train_flops_per_sample") is None:
        return {"mfu": None, "mfu_unavailable_because": "no throughput", "peak_flops_per_s": peak.flops_per_s,
                "peak_flops_source": peak.source}
    value, why_not = mfu(m["train_flops_per_sample"], figures["samples_per_s"], spec(row)["world_size"], peak,
                         shared_device(row))
    return {"mfu": value, "mfu_unavailable_because": why_not or None, "peak_flops_per_s": peak.flops_per_s,
            "peak_flops_source": peak.source, "peak_math_mode": peak.math_mode,
            "model_flops_per_s_per_device": m["train_flops_per_sample"] * figures["samples_per_s"]
            / spec(row)["world_size"]}


MEDIAN_COLUMNS = ("step_time_median_s", "step_time_unstalled_median_s", "samples_per_s",
                  "samples_per_s_all_steps", "tokens_per_s", "peak_rss_bytes_max", "peak_allocated_bytes_max",
                  "model_state_bytes_predicted", "model_state_census_bytes_max", "model_state_bytes_measured_max",
                  "activation_bytes_predicted", "saved_activation_bytes", "allocator_activation_bytes",
                  "recompute_cost", "recompute_cost_low", "recompute_cost_high", "host_bytes_per_step",
                  "optimizer_steps_skipped",
                  "comm_wire_bytes_per_step", "comm_expected_wire_bytes_per_step",
                  "exposed_comm_share", "framework_overhead_share", "mfu", "worker_link_bytes_per_step",
                  "busiest_link_bytes_per_step", "busiest_over_worker", "staleness_median", "staleness_max",
                  "checkpoint_save_s", "checkpoint_load_s", "checkpoint_save_GBps", "checkpoint_bytes",
                  "recovery_s", "steps_recomputed", "restarts",
                  "checkpoint_async_blocked_s", "checkpoint_async_write_s", "load_imbalance",
                  "all_to_all_bytes_per_step", "all_to_all_expected_bytes_per_step", "all_to_all_counted_over_expected",
                  "sequence_split", "causal_balance", "attention_bytes_per_step", "attention_expected_bytes_per_step",
                  "attention_counted_over_expected")
FIRST_COLUMNS = ("activation_checkpointing", "activation_offload", "compute_only_kind", "exposed_comm_note",
                 "framework_overhead_note", "mfu_unavailable_because", "peak_flops_source", "workers", "servers",
                 "busiest_link", "link_rate_bits_per_s", "checkpoint_method", "checkpoint_files", "sequence_attention")
# A cell's resume verdict and size check are its worst launch's, as its parity is: one launch that resumed wrong is a
# cell that resumes wrong, whatever order the rows were read in.
RESUME_ORDER = ("mismatch", "not judged", "match")
# A cell's parity is its worst launch's: one mismatching repeat is a mismatch of the cell.
PARITY_ORDER = ("mismatch", "not comparable: asynchronous", "not-judged", "no-reference", "match", "reference")


def cell_table(rows: Sequence[Row], context: Sequence[Row] = ()) -> pd.DataFrame:
    """One line per cell, in the order cells first appear in `rows`; `context` as for `launch_table`. A launch
    recorded more than once (run again by `run --resume`) counts once, by its last row (harness.derive.launches)."""
    import pandas as pd

    rows = last_rows(rows)
    if not rows:
        return pd.DataFrame()
    basis = throughput_basis(rows)
    launches = launch_table(rows, basis, context)
    raw = {row.get("run_id"): row for row in rows}
    lines, ok_rows = [], {}
    for cell_id, group in launches.groupby("cell_id", sort=False):
        first = group.iloc[0]
        ok = group[group["status"] == "ok"]
        line = {name: first[name] for name in CELL_FIELDS}
        line.update({"cell_id": cell_id, "label": first["label"], "conditions_id": first["conditions_id"],
                     "conditions": first["conditions"], "emulation": first["emulation"],
                     "launches": len(group), "ok": len(ok),
                     "status": ("ok" if len(ok) == len(group) else str(first["status"]) if ok.empty else "partial"),
                     "message": "" if not ok.empty else first["message"], "throughput_basis": basis.value})
        by_group = [c for c in launches.columns if c.startswith("comm_group_")]      # tp, dp, world: comm_columns
        for column in (*MEDIAN_COLUMNS, *by_group):
            values = [float(v) for v in ok.get(column, pd.Series(dtype=float)).tolist() if _present(v)]
            line[column] = median(values) if values else None
        for column in FIRST_COLUMNS:
            values = [v for v in ok.get(column, pd.Series(dtype=object)).tolist() if _present(v)]
            line[column] = values[0] if values else None
        verdicts = [v for v in ok.get("parity_verdict", pd.Series(dtype=object)).tolist() if v]
        worst = min(verdicts, key=lambda v: PARITY_ORDER.index(v) if v in PARITY_ORDER else -1, default="")
        line["parity"] = worst
        line["parity_failed"] = next((f for v, f in zip(ok["parity_verdict"], ok["parity_failed"]) if v == worst
                                      and f), "") if verdicts else ""
        line.update(_worst_checkpoint(ok.to_dict("records")))
        line.update(cell_compile(ok.to_dict("records")))
        throughputs = [float(v) for v in ok.get("samples_per_s", pd.Series(dtype=float)).tolist() if _present(v)]
        line["step_time_on_basis_s"] = _step_of(line["global_batch"], line["samples_per_s"])
        line.update(_interval(throughputs))
        line.update(cell_host_load(ok.to_dict("records")))
        # Against the strategy's world-size-1 launches among the rows shown (harness.derive.beyond_ws1).
        line.update(step_beyond_ws1([raw[run] for run in ok["run_id"] if run in raw], rows,
                                    _oversubscribed(line.get("host_oversubscribed"))))
        if not ok.empty:
            line["host_stalled_steps"] = int(ok["host_stalled_steps"].sum())
            line["timed_steps_recorded"] = int(ok["timed_steps_recorded"].sum())
        ok_rows[cell_id] = [raw[run] for run in ok["run_id"] if run in raw]
        lines.append(line)
    _harness_overheads(lines, ok_rows)
    cells = pd.DataFrame(lines)
    cells["samples_per_s"] = cells["samples_per_s"].astype(float)
    return scaling_efficiency(cells)


def _worst_checkpoint(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """A checkpoint cell's resume verdict (and what failed) and size check from its worst launch (RESUME_ORDER; the
    size furthest off the plan), whatever order its launches are read in; Nones where none was checkpointed."""
    resumed = [launch for launch in launches if _present(launch.get("resume"))]
    worst = min(resumed, key=lambda launch: RESUME_ORDER.index(launch["resume"])
                if launch["resume"] in RESUME_ORDER else -1, default=None)
    sized = [launch for launch in launches if _present(launch.get("checkpoint_tensor_bytes"))
             and _present(launch.get("checkpoint_bytes_expected")) and launch["checkpoint_bytes_expected"]]
    furthest = max(sized, key=lambda launch: abs(launch["checkpoint_tensor_bytes"] / launch["checkpoint_bytes_expected"]
                                                 - 1), default=None)
    return {"resume": worst["resume"] if worst else None, "resume_failed": worst.get("resume_failed") if worst else None,
            "checkpoint_tensor_bytes": furthest["checkpoint_tensor_bytes"] if furthest else None,
            "checkpoint_bytes_expected": furthest["checkpoint_bytes_expected"] if furthest else None,
            "checkpoint_size_holds": furthest.get("checkpoint_size_holds") if furthest else None}


def _harness_overheads(lines: list[dict[str, Any]], ok_rows: dict[str, list[Row]]) -> None:
    """On each plain cell and the bare cell that is the same cell with the strategy swapped (the same spec, steps and
    options, under the same conditions): the harness's own cost on the plain loop's step
    (harness.derive.harness_overhead), both lines carrying it."""
    def as_plain(line: dict[str, Any]) -> str | None:
        rows = ok_rows[line["cell_id"]]
        if not rows:
            return None
        return identity_of({**spec(rows[0]), "strategy": REFERENCE_STRATEGY}, rows[0].get("environment"))

    bare = {as_plain(line): line for line in lines if line["strategy"] == BARE_STRATEGY and ok_rows[line["cell_id"]]}
    for line in lines:
        partner = bare.get(line["cell_id"]) if line["strategy"] == REFERENCE_STRATEGY else None
        if partner is None:
            continue
        figures = harness_overhead(ok_rows[line["cell_id"]], ok_rows[partner["cell_id"]])
        line.update(figures)
        partner.update(figures)


def _step_of(global_batch: Any, samples_per_s: float | None) -> float | None:
    """The step time the cell's throughput stands for, global_batch / samples_per_s (on the set's basis), so
    that the two agree on every line that shows both: with an odd number of launches it is the median
    launch's median step on that basis; with an even number, the step of the middle throughputs' mean."""
    return float(global_batch) / samples_per_s if samples_per_s else None


def _interval(values: list[float]) -> dict[str, Any]:
    """The interval the number of launches supports (harness.derive.intervals): none for one launch, the
    range below five, a bootstrap CI of the median from five; labelled as what it is."""
    interval = median_interval(values) if values else None    # a cell with no ok launch has none
    return {"samples_per_s_low": interval.low if interval else None,
            "samples_per_s_high": interval.high if interval else None,
            "samples_per_s_interval": interval.label if interval else ""}


def _oversubscribed(flag: Any) -> bool:
    return flag is not None and flag == True  # noqa: E712  (numpy's bool is not `True`)


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)
