"""The report's opening: the answers a reader came for, computed from the cell table alone.

    python -m harness report results/reference/ci-cpu/full.jsonl --out report/    # report.html opens on these

For each device, workload, precision, global batch and world size (cells that did the same work per step,
so their speeds compare): the fastest strategy and its margin over the next, with whether that margin lies
beyond the launches' spread; the lowest memory per rank (on GPU the allocator's model states at
gradients_ready, on CPU the process's peak RSS, which is mostly the runtime, with the model states alone
beside it); the strategies whose exposed communication dominates the step (at 1 rank, where nothing is
communicated, each strategy's own overhead instead). Then every parity mismatch and
every cell that did not run, with its reason. Where cells ran with a memory technique (activation
checkpointing) beside the same cells without it, the report opens on what each saved and cost instead
(harness.report.techniques). Projected rows never get here: `harness.record.read_rows`
gives them only to a reader that asks for kind "projection".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

import pandas as pd

from harness.derive.compiled import compile_line
from harness.derive.exposed import BOUND_PREFIX
from harness.derive.harness_overhead import BARE_STRATEGY, overhead_verdict
from harness.derive.parity import REFERENCE_STRATEGY
from harness.report.checkpoint import checkpoint_lines
from harness.report.experts import expert_lines
from harness.report.sequence import sequence_lines
from harness.report.parameter_server import parameter_server_lines
from harness.report.techniques import technique_lines
from harness.spec import DeviceKind

# A step more than this share of which lies beyond the strategy's own world-size-1 step waits on the network
# more than it computes while waiting: communication, not compute, sets its length.
EXPOSED_DOMINATES = 0.5

# The clause a CPU group's Fastest verdict carries (`Fastest.on_cpu`).
CPU_SPEED_CAVEAT = "CPU cells prove the machinery, not the speed"
# Cells whose speeds compare: the same work per step on the same kind of device, under the same conditions
# (harness.derive.identity: link rate, placement, host type).
COMPARABLE = ["device", "workload", "precision", "global_batch", "world_size", "nnodes", "conditions_id"]

MIB = float(1 << 20)

RSS_CONTAINS = ("peak RSS, the whole process's resident memory: Python, torch and the strategy's libraries, "
                "model states, activations and buffers; largest rank")


class Noise(enum.StrEnum):
    BEYOND = "beyond noise"             # both cells have intervals and they do not overlap
    TIE = "tie within noise"            # the intervals (or one interval and the other's single launch) overlap
    NOT_JUDGED = "not judged"           # a single launch on both sides: no spread to judge against


@dataclass(frozen=True, kw_only=True)
class Speed:
    name: str
    samples_per_s: float
    low: float | None
    high: float | None
    interval: str           # its label ("range of 3 launches", "95% CI (bootstrap, 5 launches)"), "" for one launch


@dataclass(frozen=True, kw_only=True)
class Fastest:
    first: Speed
    second: Speed | None
    margin: float | None        # first / second - 1
    noise: Noise | None
    # CPU cells: the ranking is a CPU's, whose compute and overlap are not a GPU's (the cells show the strategies
    # run, not which would win on a GPU), so the verdict says so beside itself.
    on_cpu: bool = False

    def sentence(self) -> str:
        verdict = self._verdict()
        return f"{verdict[:-1]}; {CPU_SPEED_CAVEAT}." if self.on_cpu else verdict

    def _verdict(self) -> str:
        first = self.first
        text = f"Fastest: {first.name}, {_speed(first)}"
        if self.second is None:
            return text + " (the only cell with a speed)."
        text += f", {self.margin:.1%} more samples/s than {self.second.name} ({_speed(self.second)})"
        if self.noise is Noise.TIE:
            return text + f": {Noise.TIE.value} (their intervals overlap)."
        if self.noise is Noise.BEYOND:
            return text + f", {Noise.BEYOND.value} (their intervals do not overlap)."
        return text + "; one launch each, so no interval to judge the margin against noise."


@dataclass(frozen=True, kw_only=True)
class GroupVerdict:
    heading: str
    lines: list[str]
    fastest: Fastest | None = None
    lowest_memory: tuple[str, float] | None = None          # (cell, bytes) of the figure the line names
    dominated: list[tuple[str, float]] = field(default_factory=list)   # (cell, exposed share) above the threshold


@dataclass(frozen=True, kw_only=True)
class Verdicts:
    groups: list[GroupVerdict]
    parity: list[str]           # a count line, then one line per mismatch
    not_run: list[str]          # one line per failed, skipped or partial cell, or one line saying there are none
    # "memory saved, step time paid": a line per cell with a memory technique on beside its cell without it
    # (harness.report.techniques); empty where no cell has both
    techniques: list[str] = field(default_factory=list)
    # the parameter servers beside DDP and Horovod at each number of workers (harness.report.parameter_server);
    # empty where no parameter server's cell ran
    parameter_server: list[str] = field(default_factory=list)
    # each checkpoint cell's save, load, size and resume verdict (harness.report.checkpoint); empty where none ran
    checkpoint: list[str] = field(default_factory=list)
    # each MoE cell's all-to-all against its routing's expectation and its load imbalance (harness.report.experts)
    experts: list[str] = field(default_factory=list)
    # each sequence-split cell's exchanges around attention and a rank's saved bytes by its tokens
    # (harness.report.sequence)
    sequence: list[str] = field(default_factory=list)


def verdicts(cells: pd.DataFrame, launches: pd.DataFrame | None = None) -> Verdicts:
    """Every verdict of a `harness.derive.cells.cell_table`; `launches` (its `launch_table`) gives a
    partly failed cell the reason its failed launches recorded."""
    if cells.empty:
        return Verdicts(groups=[], parity=["No cell rows."], not_run=[])
    if "conditions_id" not in cells:      # a table built without identities: one set of conditions
        cells = cells.assign(conditions_id="")
    groups = [_group(key, group) for key, group in cells.groupby(COMPARABLE, sort=False, dropna=False)]
    return Verdicts(groups=groups, parity=_parity(cells), not_run=_not_run(cells, launches),
                    techniques=technique_lines(cells, COMPARABLE), parameter_server=parameter_server_lines(cells),
                    checkpoint=checkpoint_lines(cells), experts=expert_lines(cells), sequence=sequence_lines(cells))


def cell_name(line: Mapping[str, Any]) -> str:
    """strategy[options]: unique within a group of comparable cells (whose heading names their conditions)."""
    options = line.get("options") or ""
    return f"{line['strategy']}[{options}]" if options else str(line["strategy"])


def shown_name(line: Mapping[str, Any]) -> str:
    """cell_name and the conditions that tell the cell from others of the table ("@50Mbit/s",
    harness.derive.identity), for the table's and the plots' lines, which have no heading to say them."""
    conditions = line.get("conditions")
    return cell_name(line) + (conditions if isinstance(conditions, str) else "")    # NaN: a missing value


def _group(key: tuple, group: pd.DataFrame) -> GroupVerdict:
    device, workload, precision, global_batch, world_size, nnodes, _ = key
    nodes = f" on {int(nnodes)} nodes" if nnodes and nnodes > 1 else ""
    first = group.iloc[0].to_dict()
    conditions = first.get("conditions") if isinstance(first.get("conditions"), str) else ""
    heading = (f"{workload} at {_plural(int(world_size), 'rank')}{nodes} ({device}, {precision}, "
               f"global batch {int(global_batch)})" + (f" {conditions}" if conditions else ""))
    emulation = first.get("emulation") if isinstance(first.get("emulation"), str) else ""
    # Not a cluster's result: the nodes took turns on one machine's cores (issue 33, finding 11).
    emulated = ([f"Measured on {emulation}: these figures are the emulation's, not a scaling result of "
                 f"{_plural(int(nnodes), 'node')}; where the ranks outnumber the cores, their compute is "
                 "time-sliced."] if emulation and nnodes and nnodes > 1 else [])
    ok = group[group["status"].isin(["ok", "partial"])]
    # The bare loop is a yardstick, not a way to train: its figure enters the harness's line alone.
    harness_lines = _harness(ok)
    ok = ok[ok["strategy"] != BARE_STRATEGY]
    if ok.empty:
        return GroupVerdict(heading=heading, lines=emulated + ["No cell here ran (see 'Failed or skipped cells')."])
    lines, fastest = _fastest(ok, on_cpu=device == DeviceKind.CPU.value)
    lines = emulated + lines
    memory_line, lowest = _memory(ok, device)
    exposed_line, dominated = _exposed(ok, int(world_size))
    lines += [memory_line, exposed_line, *harness_lines,
              *(compile_line(cell_name(line), line) for line in ok.to_dict("records"))]
    return GroupVerdict(heading=heading, lines=[line for line in lines if line], fastest=fastest,
                        lowest_memory=lowest, dominated=dominated)


def _fastest(ok: pd.DataFrame, on_cpu: bool = False) -> tuple[list[str], Fastest | None]:
    timed = ok[~ok["shared_device"].astype(bool) & ok["samples_per_s"].notna()]
    if timed.empty:
        if not ok.empty and ok["shared_device"].astype(bool).all():
            return ["Fastest: not judged: the ranks shared one GPU, so their step times measure the sharing."], None
        return ["Fastest: no cell with a speed."], None
    ranked = sorted((_as_speed(line) for line in timed.to_dict("records")), key=lambda s: -s.samples_per_s)
    first = ranked[0]
    second = ranked[1] if len(ranked) > 1 else None
    margin = first.samples_per_s / second.samples_per_s - 1 if second else None
    fastest = Fastest(first=first, second=second, margin=margin, noise=_noise(first, second) if second else None,
                      on_cpu=on_cpu)
    lines = [fastest.sentence()]
    crowded = [cell_name(line) for line in timed.to_dict("records") if line.get("host_oversubscribed") is True]
    if crowded:
        lines.append(f"The ranks outnumbered the machine's cores for {', '.join(crowded)}: their step times "
                     "measure the cores' sharing.")
    return lines, fastest


def _noise(first: Speed, second: Speed) -> Noise:
    """Overlap of [low, high] of each (a single launch is the point of its value); with no interval on
    either side there is no spread to judge against."""
    if first.low is None and second.low is None:
        return Noise.NOT_JUDGED
    first_low = first.low if first.low is not None else first.samples_per_s
    second_high = second.high if second.high is not None else second.samples_per_s
    return Noise.TIE if first_low <= second_high else Noise.BEYOND


def _as_speed(line: Mapping[str, Any]) -> Speed:
    low, high = line.get("samples_per_s_low"), line.get("samples_per_s_high")
    present = low is not None and low == low and high is not None and high == high
    return Speed(name=cell_name(line), samples_per_s=float(line["samples_per_s"]),
                 low=float(low) if present else None, high=float(high) if present else None,
                 interval=str(line.get("samples_per_s_interval") or "") if present else "")


def _speed(speed: Speed) -> str:
    text = f"{speed.samples_per_s:.4g} samples/s"
    if speed.low is not None:
        text += f" [{speed.low:.4g}-{speed.high:.4g}, {speed.interval}]"
    return text


def _memory(ok: pd.DataFrame, device: str) -> tuple[str, tuple[str, float] | None]:
    if device == DeviceKind.CUDA.value:
        figures = [("model_state_bytes_measured_max", "allocated model states at gradients_ready"),
                   ("peak_allocated_bytes_max", "peak allocated")]
    else:
        figures = [("peak_rss_bytes_max", RSS_CONTAINS)]
    for column, what in figures:
        ranked = _ranked(ok, column)
        if ranked:
            break
    else:
        return "Lowest memory per rank: no cell recorded it.", None
    (name, value), rest = ranked[0], ranked[1:]
    line = f"Lowest memory per rank ({what}): {name}, {_mib(value)}"
    line += f"; next {rest[0][0]}, {_mib(rest[0][1])}." if rest else "."
    if device != DeviceKind.CUDA.value:
        census = _ranked(ok, "model_state_census_bytes_max")
        if census:
            line += (f" Model states alone (census of their storages at gradients_ready): lowest {census[0][0]}, "
                     f"{_mib(census[0][1])}" + (f"; next {census[1][0]}, {_mib(census[1][1])}." if len(census) > 1
                                                else "."))
    return line, (name, value)


def _ranked(ok: pd.DataFrame, column: str) -> list[tuple[str, float]]:
    if column not in ok:
        return []
    present = [line for line in ok.to_dict("records") if _present(line.get(column))]
    return sorted(((cell_name(line), float(line[column])) for line in present), key=lambda item: item[1])


def _exposed(ok: pd.DataFrame, world_size: int) -> tuple[str, list[tuple[str, float]]]:
    """At >= 2 ranks, where communication dominates the step: judged on the step beyond the strategy's own
    world-size-1 step (harness.derive.beyond_ws1), which leaves the strategy's own work out; on the step
    beyond the compute-only pass (exposed communication, which holds that work too) only for a cell
    without a world-size-1 cell, and said so. At 1 rank nothing is communicated: the framework's overhead."""
    timed = ok[~ok["shared_device"].astype(bool)]
    if world_size == 1:
        return _overhead(timed), []
    measured = []
    for line in timed.to_dict("records"):
        beyond, exposed = line.get("step_beyond_ws1_share"), line.get("exposed_comm_share")
        if _present(beyond):
            beside = f" ({float(exposed):.0%} beyond the compute-only pass{_bound(line)})" if _present(exposed) else ""
            measured.append((line, float(beyond), beside))
        elif _present(exposed):
            why = line.get("step_beyond_ws1_note") or "no world-size-1 cell"
            measured.append((line, float(exposed), f" beyond the compute-only pass, which also holds the "
                                                   f"strategy's own work (no figure beyond its world-size-1 step: "
                                                   f"{why}){_bound(line)}"))
    if not measured:
        return "", []
    threshold = f"more than {EXPOSED_DOMINATES:.0%} of the step beyond the strategy's own world-size-1 step"
    if any(" beyond the compute-only pass, which" in beside for _, _, beside in measured):
        threshold += ", or beyond the compute-only pass where that is not measured"
    above = sorted((item for item in measured if item[1] > EXPOSED_DOMINATES), key=lambda item: -item[1])
    dominated = [(cell_name(line), share) for line, share, _ in above]
    if not above:
        line, share, beside = max(measured, key=lambda item: item[1])
        return (f"Exposed communication dominates ({threshold}): none; the highest is {cell_name(line)}'s, "
                f"{share:.0%}{beside}."), []
    described = [f"{cell_name(line)} {share:.0%}{beside}" for line, share, beside in above]
    return f"Exposed communication dominates ({threshold}): {', '.join(described)}.", dominated


def _overhead(timed: pd.DataFrame) -> str:
    measured = [line for line in timed.to_dict("records") if _present(line.get("framework_overhead_share"))]
    if not measured:
        return ""
    ranked = sorted(measured, key=lambda line: -float(line["framework_overhead_share"]))
    described = [f"{cell_name(line)} {float(line['framework_overhead_share']):.0%}{_bound(line)}" for line in ranked]
    return ("Framework overhead (the step beyond the compute-only pass at 1 rank, where nothing is communicated: "
            f"the strategy's own work): {', '.join(described)}.")


def _harness(ok: pd.DataFrame) -> list[str]:
    """The harness's own cost on the plain loop, held to OVERHEAD_LIMIT (harness.derive.harness_overhead)."""
    if "harness_overhead_share" not in ok:
        return []
    lines = []
    for line in ok[ok["strategy"] == REFERENCE_STRATEGY].to_dict("records"):
        share = line.get("harness_overhead_share")
        if not _present(share):
            continue
        share = float(share)
        plain, bare = int(line["harness_plain_launches"]), int(line["harness_bare_launches"])
        text = (f"Harness overhead: {share:+.1%} ({cell_name(line)}'s mean step, {line['harness_plain_step_s'] * 1e3:.4g}"
                f" ms over {_launches(plain)}, against the bare loop's {line['harness_bare_step_s'] * 1e3:.4g} "
                f"ms over {_launches(bare)}, timed whole)")
        text += ": " + overhead_verdict(line)[1] + "."
        lines.append(text)
    return lines


def _bound(line: Mapping[str, Any]) -> str:
    kind = line.get("compute_only_kind") or ""
    return " (a bound: the baseline was not the rank's same work)" if str(kind).startswith(BOUND_PREFIX) else ""


def _parity(cells: pd.DataFrame) -> list[str]:
    verdicts = cells["parity"].fillna("").replace("", "none (no ok launch)") if "parity" in cells else pd.Series()
    counts = ", ".join(f"{count} {verdict}" for verdict, count in verdicts.value_counts(sort=False).items())
    mismatches = cells[cells["parity"] == "mismatch"] if "parity" in cells else cells.iloc[0:0]
    lines = [f"Loss parity against the plain loop, {_plural(len(cells), 'cell')}: {counts}."]
    if mismatches.empty:
        lines.append("No parity mismatch.")
    for line in mismatches.to_dict("records"):
        lines.append(f"Mismatch: {line['label']}: {line.get('parity_failed') or 'see its row'}.")
    return lines


def _not_run(cells: pd.DataFrame, launches: pd.DataFrame | None) -> list[str]:
    lines = []
    for line in cells[cells["status"] != "ok"].to_dict("records"):
        if line["status"] == "partial":
            failed = (launches[(launches["cell_id"] == line["cell_id"]) & (launches["status"] != "ok")]
                      if launches is not None and not launches.empty else pd.DataFrame())
            why = "; ".join(f"{f['status']}: {f['message'] or 'no message recorded'}"
                            for f in failed.to_dict("records"))
            lines.append(f"{line['label']}: partial: {line['ok']} of {line['launches']} launches ok"
                         + (f" ({why})." if why else "."))
        else:
            lines.append(f"{line['label']}: {line['status']}: {line.get('message') or 'no message recorded'}.")
    return lines or [f"None: every one of the {_plural(len(cells), 'cell')} ran."]


def _launches(count: int) -> str:
    return f"{count} launch" + ("" if count == 1 else "es")


def _mib(value: float) -> str:
    return f"{value / MIB:.4g} MiB"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)
