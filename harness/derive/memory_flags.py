"""Memory a rank held beyond its model states, where a reader looks: the console after `harness run`'s table, the
report's verdicts (report.md and report.html) and rows.csv.

    PARBENCH_FAULT=leak:bytes=100MiB:in=numpy:rank=all:step=0 python -m harness run --matrix smoke --strategy plain
    python -m harness report results/smoke-*.jsonl --out report/     # 'Memory outside the model states'

Two readings inside every rank flag its row (harness.rank.memory_model; docs/methodology.md, "Memory outside the
census"):
- the gap: at the last warm-up step, the rank's resident growth since just before its model was built less its
  model-state census, above its strategy's size (`memory_outside_census_flagged`): memory the rank holds that no
  model state accounts for, from a leak or a copy kept since the wrap to one made in the warm-up;
- the growth over the timed steps: RssAnon (on GPU also the allocator's bytes) after the last timed step less before
  the last warm-up step, each read with the heap's free pages given back, above a size that grows with the steps it
  spans (`memory_growth_timed_steps_flagged`): memory kept a little more every step.
A flag is no failure: the row keeps its status, and `harness run` its exit status. Rows are read as their ranks judged
them, against the sizes stored beside the figures, never judged again with this checkout's sizes.

Torch-free: standard library only.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from harness.derive.rows import Row, is_ok, label, measurements

MIB = float(1 << 20)
SECTION = "Memory outside the model states"
WHERE = "docs/methodology.md, 'Memory outside the census'"

GAP, GAP_LIMIT, GAP_FLAGGED = ("memory_outside_census_bytes_by_rank", "memory_outside_census_flag_bytes",
                               "memory_outside_census_flagged")
GROWTH, GROWTH_LIMIT, GROWTH_FLAGGED = ("memory_growth_timed_steps_bytes_by_rank",
                                        "memory_growth_timed_steps_flag_bytes", "memory_growth_timed_steps_flagged")
ALLOCATED_GROWTH, ALLOCATED_LIMIT = ("allocated_growth_timed_steps_bytes_by_rank",
                                     "allocated_growth_timed_steps_flag_bytes")
GROWTH_STEPS = "memory_growth_steps"        # the steps the growth spans: the last warm-up step and the timed ones

# rows.csv's columns, one per launch: whether either reading flagged it, then each reading's largest rank and size.
FLAG_COLUMNS = ("memory_flagged", "memory_outside_census_bytes_max", GAP_LIMIT, GAP_FLAGGED,
                "memory_growth_timed_steps_bytes_max", GROWTH_LIMIT, GROWTH_FLAGGED,
                "allocated_growth_timed_steps_bytes_max", ALLOCATED_LIMIT)


def flag_columns(m: Mapping[str, Any]) -> dict[str, Any]:
    """A launch's columns (FLAG_COLUMNS): None for a reading its row does not hold (an older row, a failed launch,
    no warm-up reading, no timed step run from its start); `memory_flagged` None only where it holds neither."""
    read = [m.get(GAP_FLAGGED), m.get(GROWTH_FLAGGED)]
    return {"memory_flagged": any(read) if any(flag is not None for flag in read) else None,
            "memory_outside_census_bytes_max": _largest(m.get(GAP)), GAP_LIMIT: m.get(GAP_LIMIT),
            GAP_FLAGGED: m.get(GAP_FLAGGED),
            "memory_growth_timed_steps_bytes_max": _largest(m.get(GROWTH)), GROWTH_LIMIT: m.get(GROWTH_LIMIT),
            GROWTH_FLAGGED: m.get(GROWTH_FLAGGED),
            "allocated_growth_timed_steps_bytes_max": _largest(m.get(ALLOCATED_GROWTH)),
            ALLOCATED_LIMIT: m.get(ALLOCATED_LIMIT)}


def is_flagged(row: Row) -> bool:
    """Whether an ok row's memory outside its model states was flagged by either reading."""
    m = measurements(row)
    return is_ok(row) and bool(m.get(GAP_FLAGGED) or m.get(GROWTH_FLAGGED))


def flag_sentence(row: Row) -> str:
    """What a flagged row's ranks held above their sizes, reading by reading; "" for a row not flagged."""
    if not is_flagged(row):
        return ""
    m = measurements(row)
    steps = int(m.get(GROWTH_STEPS) or 0)
    parts = []
    if m.get(GAP_FLAGGED):
        ranks, figures = _above(m.get(GAP), m[GAP_LIMIT])
        parts.append(f"{ranks} held {figures} outside the model-state census at the last warm-up step (the resident "
                     f"growth since the model was built, less the census; flagged above {_mib(m[GAP_LIMIT])})")
    if m.get(GROWTH_FLAGGED):
        for key, limit, what in ((GROWTH, GROWTH_LIMIT, "resident memory (RssAnon)"),
                                 (ALLOCATED_GROWTH, ALLOCATED_LIMIT, "allocated device memory")):
            if m.get(key) is None or m.get(limit) is None:
                continue
            ranks, figures = _above(m[key], m[limit])
            over = (f" over the last warm-up step and {steps - 1} timed steps, "
                    f"{_mib_list([v / steps for v in _values_above(m[key], m[limit])])} a step" if steps else "")
            if figures:
                parts.append(f"on {ranks}, {what} grew by {figures}{over} (flagged above {_mib(m[limit])})")
    return "; ".join(parts) or "flagged by its ranks, whose figures the row does not hold"


def flag_lines(rows: Sequence[Row]) -> list[str]:
    """A line per flagged launch: its cell, its launch, its figures; [] where none is flagged."""
    lines = []
    for row in rows:
        sentence = flag_sentence(row)
        if sentence:
            lines.append(f"{label(row)} r{row.get('repeat', 0)}: {sentence}. Flagged, not failed: the row stays "
                         f"{row['status']} ({WHERE}).")
    return lines


def verdict_lines(rows: Sequence[Row]) -> list[str]:
    """The report's section: a line per flagged launch, else one saying that none was and how many were read;
    [] where no row holds either reading (rows written before they were recorded)."""
    read = [row for row in rows if is_ok(row) and flag_columns(measurements(row))["memory_flagged"] is not None]
    if not read:
        return []
    flagged = flag_lines(read)
    if flagged:
        return [f"Flagged: {len(flagged)} of {_launches(len(read))} held memory outside their model states above "
                "the sizes their ranks were judged against.", *flagged]
    return [f"None flagged: {_launches(len(read))} read, each rank's memory beyond its model-state census at the last "
            f"warm-up step and its growth over the timed steps below the sizes their ranks were judged against "
            f"({WHERE})."]


def _above(by_rank: Sequence[float | None] | None, limit: float) -> tuple[str, str]:
    """("rank 1" or "ranks 0, 1", "11.8 MiB" or "175.8, 179.7 MiB"): the ranks whose figure is above `limit`."""
    ranks = [rank for rank, value in enumerate(by_rank or ()) if value is not None and value > limit]
    named = (f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks)))
    return named, _mib_list(_values_above(by_rank, limit))


def _values_above(by_rank: Sequence[float | None] | None, limit: float) -> list[float]:
    return [value for value in by_rank or () if value is not None and value > limit]


def _mib_list(values: Sequence[float]) -> str:
    return ", ".join(f"{value / MIB:.1f}" for value in values) + " MiB" if values else ""


def _largest(by_rank: Sequence[float | None] | None) -> float | None:
    values = [value for value in by_rank or () if value is not None]
    return max(values) if values else None


def _mib(value: float) -> str:
    return f"{value / MIB:.1f} MiB"


def _launches(count: int) -> str:
    return f"{count} launch" + ("" if count == 1 else "es")
