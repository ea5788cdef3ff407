"""In which order a run's launches go: every cell's launches are (spec, repeat) pairs, and a matrix picks how they
are interleaved (harness.matrix.LAUNCH_ORDERS; harness.runner walks the order it is given).

- `round_robin`, every matrix's but one: repeat by repeat, every cell's first launch in the matrix's order, then
  every second launch, and so on. A cell's launches spread over the run, so a drift of the machine's speed lands on
  every cell alike (harness.runner's docstring has the measurement).
- `value_first`, the GPU reference set's (scripts/gpu-reference.sh, a lent GPU's few minutes under `--budget`): the
  matrix lists its cells in the order a budget should keep them (harness.matrix.reference: every parity key's plain
  loop first, then the strategies by what a user asks first), and each plain loop's first NOISE_FLOOR_LAUNCHES
  launches go back to back where it is listed: on a GPU parity holds a row against the plain loop's own
  launch-to-launch noise (harness.derive.parity, `noise_floors`), so one plain launch judges nothing. The bare loop's
  launches alternate with its plain loop's remaining ones where the bare loop is listed, so the harness's cost is
  timed on launches that ran side by side (harness.derive.harness_overhead). tests/test_reference_order.py replays
  the order at the launch times of the last GPU run and shows what a budget keeps.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from harness.derive.harness_overhead import BARE_STRATEGY
from harness.derive.parity import NOISE_FLOOR_LAUNCHES, REFERENCE_STRATEGY
from harness.spec import RunSpec

Launch = tuple[RunSpec, int]                     # a cell and the index of one of its launches (its repeat)
LaunchOrder = Callable[[Sequence[RunSpec]], list[Launch]]


def round_robin(specs: Sequence[RunSpec]) -> list[Launch]:
    """Repeat by repeat: every cell's launch 0 in the matrix's order, then every launch 1, and so on."""
    return [(spec, repeat) for repeat in range(max((spec.repeats for spec in specs), default=0))
            for spec in specs if repeat < spec.repeats]


def value_first(specs: Sequence[RunSpec]) -> list[Launch]:
    """The matrix's order, cell by cell: a plain loop's first NOISE_FLOOR_LAUNCHES launches back to back where it is
    listed, the bare loop's alternating with the rest of its plain loop's, every other cell's launches together; a
    plain loop's launches that no bare loop takes go last (the module docstring)."""
    plains = [spec for spec in specs if spec.strategy == REFERENCE_STRATEGY]
    rest = {id(spec): list(range(NOISE_FLOOR_LAUNCHES, spec.repeats)) for spec in plains}
    order: list[Launch] = []
    for spec in specs:
        if spec.strategy == REFERENCE_STRATEGY:
            order += [(spec, repeat) for repeat in range(min(NOISE_FLOOR_LAUNCHES, spec.repeats))]
            continue
        plain = _plain_beside(spec, plains) if spec.strategy == BARE_STRATEGY else None
        theirs = rest[id(plain)] if plain is not None else []
        for repeat in range(spec.repeats):
            order.append((spec, repeat))
            if theirs:
                order.append((plain, theirs.pop(0)))
        order += [(plain, repeat) for repeat in theirs]
        theirs.clear()
    order += [(spec, repeat) for spec in plains for repeat in rest[id(spec)]]
    return order


def _plain_beside(bare: RunSpec, plains: Sequence[RunSpec]) -> RunSpec | None:
    """The plain loop's cell whose spec is the bare loop's but for the strategy (its launches' count aside)."""
    for plain in plains:
        if dataclasses.replace(bare, strategy=REFERENCE_STRATEGY, repeats=plain.repeats) == plain:
            return plain
    return None


__all__ = ["Launch", "LaunchOrder", "round_robin", "value_first"]
