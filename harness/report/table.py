"""The report's compact table of cells: one table per device kind, its columns those that hold something there.

    python -m harness report results/reference/ci-cpu/full.jsonl --out report/    # report.html, "Cells"

Figures come from `harness.derive.cells.cell_table` as they are; only their units change (bytes to MiB,
seconds to ms, shares to %). A column empty for every cell of a device kind (the allocator's figures on CPU,
peak RSS where not recorded, intervals where every cell ran once) is left out of that kind's table, and a
cell of one launch shows "-" for its interval: a single launch has no spread, and repeating its value as an
interval would claim one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import pandas as pd

from harness.derive.exposed import BOUND_PREFIX
from harness.derive.harness_overhead import overhead_verdict
from harness.derive.throughput import Basis
from harness.report.verdicts import shown_name

NO_INTERVAL = "-"
# The step beyond a baseline, three ways (harness.derive.exposed, harness.derive.beyond_ws1); the notes
# under the table say what each is.
EXPOSED_TITLE = "exposed comm (vs compute-only)"
BEYOND_WS1_TITLE = "beyond own ws1 step"
OVERHEAD_TITLE = "framework overhead (ws1)"
HARNESS_TITLE = "harness overhead (plain vs bare)"
MIB = float(1 << 20)

Line = Mapping[str, Any]


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)


def _number(value: Any) -> str:
    if not _present(value):
        return ""
    value = float(value)
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _scaled(key: str, scale: float) -> Callable[[Line], str]:
    return lambda line: _number(float(line[key]) * scale) if _present(line.get(key)) else ""


def _share(key: str) -> Callable[[Line], str]:
    return lambda line: f"{float(line[key]):.1%}" if _present(line.get(key)) else ""


def _text(key: str) -> Callable[[Line], str]:
    return lambda line: str(line[key]) if _present(line.get(key)) else ""


def _weak(key: str) -> Callable[[Line], str]:
    # At world size 1 weak and strong scaling are the same cell against the same reference: the figure is
    # shown once, under strong.
    return lambda line: _scaled(key, 1)(line) if line.get("world_size") != 1 else ""


def _interval(line: Line) -> str:
    low, high = line.get("samples_per_s_low"), line.get("samples_per_s_high")
    if not (_present(low) and _present(high)):
        return NO_INTERVAL
    return f"{_number(low)}-{_number(high)} ({line.get('samples_per_s_interval')})"


def _launches(line: Line) -> str:
    launches, ok = int(line.get("launches") or 0), int(line.get("ok") or 0)
    return str(launches) if ok == launches else f"{ok} of {launches} ok"


def _beyond_compute_only(key: str) -> Callable[[Line], str]:
    """Exposed communication (>= 2 ranks) or the framework's overhead (1 rank): both the step beyond the
    compute-only pass (harness.derive.exposed), marked where that pass only bounds the rank's work."""
    def render(line: Line) -> str:
        share = line.get(key)
        if not _present(share):
            return ""
        bound = str(line.get("compute_only_kind") or "").startswith(BOUND_PREFIX)
        return f"{float(share):.1%}" + (" (bound)" if bound else "")
    return render


def _harness_overhead(line: Line) -> str:
    """On the plain and bare cells of the same work: the plain loop's step over the bare loop's, and what its
    interval shows against the limit the report holds it to (within, over or inconclusive)."""
    share = line.get("harness_overhead_share")
    if not _present(share):
        return ""
    return f"{float(share):+.1%} ({overhead_verdict(line)[0].value})"


def _stalled(line: Line) -> str:
    stalled = line.get("host_stalled_steps")
    return str(int(stalled)) if _present(stalled) else ""


def _all_steps(key: str, scale: float = 1.0) -> Callable[[Line], str]:
    # Only a different figure where the set's basis is the unstalled steps; otherwise it repeats the figure
    # on the basis (step ms, samples/s).
    return lambda line: (_scaled(key, scale)(line) if line.get("throughput_basis") == Basis.UNSTALLED.value
                         else "")


GROUP_PREFIX, GROUP_SUFFIX = "comm_group_", "_wire_bytes_per_step"


def _wire_by_group(line: Line) -> str:
    """Wire MiB per step in each named process group (harness.derive.comm.group_wire_bytes), where a cell ran
    in groups other than the default one: tensor parallelism's "tp" apart from data parallelism's "dp"."""
    groups = {key.removeprefix(GROUP_PREFIX).removesuffix(GROUP_SUFFIX): line[key] for key in sorted(line)
              if key.startswith(GROUP_PREFIX) and key.endswith(GROUP_SUFFIX) and _present(line[key])}
    if set(groups) <= {"world"}:
        return ""
    return ", ".join(f"{label} {_number(float(value) / MIB)}" for label, value in groups.items())


@dataclass(frozen=True)
class Column:
    title: str
    render: Callable[[Line], str]
    says_nothing: frozenset[str] = frozenset({""})      # a column holding only these is left out


COLUMNS = [
    Column("workload", _text("workload")),
    Column("strategy", shown_name),
    Column("ranks", _text("world_size")),
    Column("status", _text("status")),
    Column("launches", _launches),
    # The step samples/s stands for (global batch / samples/s), on the same basis: harness.derive.throughput.
    Column("step ms", _scaled("step_time_on_basis_s", 1e3)),
    Column("step ms, all steps", _all_steps("step_time_median_s", 1e3)),
    Column("host-stalled steps", _stalled, frozenset({"", "0"})),
    Column("samples/s", _scaled("samples_per_s", 1)),
    Column("samples/s interval", _interval, frozenset({"", NO_INTERVAL})),
    Column("samples/s, all steps", _all_steps("samples_per_s_all_steps")),
    Column("strong eff. vs ws1", _scaled("strong_efficiency_vs_ws1", 1)),
    Column("strong eff. vs plain", _scaled("strong_efficiency_vs_plain", 1)),
    Column("weak eff. vs ws1", _weak("weak_efficiency_vs_ws1")),
    Column("weak eff. vs plain", _weak("weak_efficiency_vs_plain")),
    Column(EXPOSED_TITLE, _beyond_compute_only("exposed_comm_share")),
    Column(BEYOND_WS1_TITLE, _share("step_beyond_ws1_share")),
    Column(OVERHEAD_TITLE, _beyond_compute_only("framework_overhead_share")),
    # The plain loop's step over the bare loop's, timed whole (harness.derive.harness_overhead): the harness's cost.
    Column(HARNESS_TITLE, _harness_overhead),
    Column("wire MiB/step", _scaled("comm_wire_bytes_per_step", 1 / MIB)),
    Column("expected wire MiB/step", _scaled("comm_expected_wire_bytes_per_step", 1 / MIB)),
    Column("wire MiB/step by group", _wire_by_group),
    Column("peak RSS MiB", _scaled("peak_rss_bytes_max", 1 / MIB)),
    Column("peak allocated MiB", _scaled("peak_allocated_bytes_max", 1 / MIB)),
    Column("model states, allocated MiB", _scaled("model_state_bytes_measured_max", 1 / MIB)),
    Column("model states, census MiB", _scaled("model_state_census_bytes_max", 1 / MIB)),
    Column("model states, predicted MiB", _scaled("model_state_bytes_predicted", 1 / MIB)),
    # Korthikanti et al. 2022 redone for the workloads' blocks (harness.derive.activations): one micro-batch.
    Column("block activations, predicted MiB", _scaled("activation_bytes_predicted", 1 / MIB)),
    # The census's peak, the whole model (harness.rank.saved_activations), and checkpointing's recompute cost.
    Column("saved for backward, measured MiB", _scaled("saved_activation_bytes", 1 / MIB)),
    Column("peak allocated - model states MiB", _scaled("allocator_activation_bytes", 1 / MIB)),
    Column("recompute cost", _share("recompute_cost")),
    # Activation offload's copies to the host and back (harness.derive.techniques), and fp16's skipped steps.
    Column("host MiB/step", _scaled("host_bytes_per_step", 1 / MIB)),
    Column("skipped steps", _scaled("optimizer_steps_skipped", 1)),
    # torch.compile's (harness.derive.compiled): a timed step that recompiled holds a compile in its time.
    Column("compile s", _scaled("compile_seconds", 1)),
    Column("graph breaks", _scaled("graph_breaks", 1)),
    Column("recompiles in timed steps", _scaled("recompiles_in_timed_steps", 1)),
    Column("MFU", _share("mfu")),
    Column("parity", _text("parity")),
    Column("host load", _text("host_load")),
    Column("why", _text("message")),
]


@dataclass(frozen=True)
class Table:
    device: str
    titles: list[str]
    rows: list[list[str]]
    hidden: list[str]           # titles of the columns left out, for the note under the table


def tables(cells: pd.DataFrame) -> list[Table]:
    """One table per device kind, in the order kinds first appear."""
    if cells.empty:
        return []
    return [_table(str(device), group) for device, group in cells.groupby("device", sort=False)]


def _table(device: str, cells: pd.DataFrame) -> Table:
    lines = cells.to_dict("records")
    rendered = [[column.render(line) for line in lines] for column in COLUMNS]
    kept = [i for i, (column, values) in enumerate(zip(COLUMNS, rendered))
            if any(value not in column.says_nothing for value in values)]
    hidden = [column.title for i, column in enumerate(COLUMNS) if i not in kept]
    rows = [[rendered[i][row] for i in kept] for row in range(len(lines))]
    return Table(device=device, titles=[COLUMNS[i].title for i in kept], rows=rows, hidden=hidden)
