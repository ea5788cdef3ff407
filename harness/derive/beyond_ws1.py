"""The step beyond the strategy's own world-size-1 step: what running on N ranks adds to a strategy's step.

    python -c "from harness.derive.cells import cell_table; from harness.derive.rows import load_rows;
print(cell_table(load_rows(['results/reference/ci-cpu/full.jsonl']))[['label', 'step_beyond_ws1_share']])"

Exposed communication (harness.derive.exposed) is the step beyond the compute-only pass, the model's
forward, backward and optimizer step alone; it also holds the strategy's own work on the rank (ZeRO-3's
parameter bookkeeping, DeepSpeed's flattening), which the compute-only pass leaves out: at world size 1,
where nothing is communicated, ZeRO-3's step on gpt-tiny is about twice its compute-only pass. Held
against the strategy's own step on one rank instead, that work cancels and what is left is what N ranks
add (communication, waiting on the slowest rank, sharing the host):

    beyond = median(step at N) - step_1 x b_N / b_1
    share  = beyond / median(step at N)

medians over the steps the host did not stall, then across launches; step_1 is the median over the
strategy's world-size-1 launches (same workload, options, precision, micro-batch and device, measured under
the same conditions: network, placement and host type, harness.derive.identity) of their unstalled
medians; b is the samples a rank runs per step (global batch / world size). The world-size-1 cell at the
same b is preferred (the same work per rank, no scaling); else the one at the nearest b
(`one_rank_launches`) is scaled in proportion to the samples, as the projection does
(harness.project.projection `_basis`: this figure is its measured basis at the world size it starts
from): a fixed per-step cost, the optimizer's, is then scaled too, so a smaller b at N makes the figure
too large.

None, with a note, where there is no such world-size-1 cell, no unstalled step, or the ranks outnumbered
their host's cores (their step measures the cores' sharing, which the world-size-1 step did not have).
"""

from __future__ import annotations

import math
from statistics import median
from typing import Any, Sequence

from harness.derive.identity import conditions_id
from harness.derive.rows import Row, is_ok, options_text, shared_device, spec
from harness.derive.throughput import unstalled_step_times


def strategy_key(row: Row) -> tuple:
    """What a world-size-1 launch must share with a cell to be its strategy's own step on one rank."""
    s = spec(row)
    return (s["workload"], s["strategy"], options_text(row), s["precision"], s["micro_batch"], s["device"],
            conditions_id(row))


def _unstalled_median(row: Row) -> float | None:
    steps = unstalled_step_times(row)
    return median(steps) if steps else None


def _per_rank_batch(row: Row) -> float:
    return spec(row)["global_batch"] / spec(row)["world_size"]


def one_rank_launches(rows: Sequence[Row], batch: float) -> tuple[list[Row], str]:
    """The ok, unshared world-size-1 launches among `rows` (one strategy's, under one set of conditions) that a
    cell running `batch` samples per rank is held against, and why there are none: those of one global batch,
    the same samples per rank where measured, else the nearest (by ratio; the larger on a tie), which the
    caller scales in proportion. Launches of several batches are never pooled: their medians would mix steps
    of different work. The projection takes its compute from the same launches (harness.project.projection
    `one_device_step`)."""
    ones = [row for row in rows if is_ok(row) and spec(row)["world_size"] == 1 and not shared_device(row)
            and _unstalled_median(row) is not None]
    if not ones:
        return [], "no ok world-size-1 cell of this strategy"
    batches = {float(spec(row)["global_batch"]) for row in ones}
    chosen = min(batches, key=lambda b: (abs(math.log(b / batch)), -b))
    return [row for row in ones if float(spec(row)["global_batch"]) == chosen], ""


def step_beyond_ws1(cell: Sequence[Row], rows: Sequence[Row], oversubscribed: bool | None = None) -> dict[str, Any]:
    """`step_beyond_ws1_s`, `_share` and `_note` of one cell (`cell`: its ok launches' rows) against the
    world-size-1 launches among `rows` (module docstring)."""
    none = {"step_beyond_ws1_s": None, "step_beyond_ws1_share": None}
    cell = [row for row in cell if is_ok(row)]
    if not cell or spec(cell[0])["world_size"] < 2:
        return {**none, "step_beyond_ws1_note": ""}
    if shared_device(cell[0]):
        return {**none, "step_beyond_ws1_note": "the ranks shared one GPU: their steps measure the sharing"}
    if oversubscribed:
        return {**none, "step_beyond_ws1_note": "the ranks outnumbered their host's cores, which the "
                                                "world-size-1 step had to itself"}
    key, batch = strategy_key(cell[0]), _per_rank_batch(cell[0])
    ones, why_not = one_rank_launches([row for row in rows if strategy_key(row) == key], batch)
    if not ones:
        return {**none, "step_beyond_ws1_note": why_not}
    one_batch = spec(ones[0])["global_batch"]
    one_step = median(_unstalled_median(row) for row in ones)
    steps = [step for step in map(_unstalled_median, cell) if step is not None]
    if not steps:
        return {**none, "step_beyond_ws1_note": "the host stalled every step"}
    step = median(steps)
    own = one_step * batch / one_batch
    scaled = "" if one_batch == batch else f", scaled to {batch:g} samples per rank: {own * 1e3:.4g} ms"
    return {"step_beyond_ws1_s": step - own, "step_beyond_ws1_share": (step - own) / step,
            "step_beyond_ws1_note": f"against the strategy's world-size-1 step, {one_step * 1e3:.4g} ms at "
                                    f"{one_batch:g} samples{scaled}"}

