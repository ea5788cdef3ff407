"""Step time and throughput of one launch, from its recorded per-step times.

Each timed step's time is the slowest rank's (a synchronous step ends when its slowest rank ends), device
synchronised (harness/rank timing). A step during which the host withheld the CPUs (`host_stalled_step_
indices`, harness/rank/timing.py) measures the host, not the software.

    throughput X = global_batch / median(step_time_s)      samples/s, per launch
    tokens/s     = X * tokens_per_sample;  per device: / world_size

The basis (every timed step, or the unstalled ones) is chosen once for a whole set of rows
(`throughput_basis`), so that two cells' throughputs, and every ratio of them (efficiencies), rest on
the same kind of steps. `step_time_on_basis_s` is the median step of that same basis, so that a step
time shown beside a throughput is the one it came from: global_batch / step_time_on_basis_s = X. The
console summary and the report both call this module, so they agree.
"""

from __future__ import annotations

import enum
from statistics import median
from typing import Any, Iterable

from harness.derive.harness_overhead import bare_step_s
from harness.derive.rows import Row, is_ok, measurements, spec


class Basis(enum.StrEnum):
    ALL_STEPS = "all steps"
    UNSTALLED = "unstalled steps"


def step_times(row: Row) -> list[float]:
    """Each timed step's time; for the bare loop, which times its steps as a whole, its one figure: the loop over its
    steps (harness.derive.harness_overhead)."""
    bare = bare_step_s(measurements(row))
    if bare is not None:
        return [bare]
    return [float(t) for t in measurements(row).get("step_time_s") or []]


def unstalled_step_times(row: Row) -> list[float]:
    stalled = set(measurements(row).get("host_stalled_step_indices") or ())
    return [t for index, t in enumerate(step_times(row)) if index not in stalled]


def throughput_basis(rows: Iterable[Row]) -> Basis:
    """Unstalled steps where the host stalled any timed step of these rows and every ok row kept at least
    one unstalled step (stalls hit cells at random, so a ratio of raw throughputs would mostly compare
    their stalls); otherwise every timed step."""
    ok = [row for row in rows if is_ok(row) and step_times(row)]
    if not ok or not any(measurements(row).get("host_stalled_step_indices") for row in ok):
        return Basis.ALL_STEPS
    if all(unstalled_step_times(row) for row in ok):
        return Basis.UNSTALLED
    return Basis.ALL_STEPS


def tokens_per_sample(row: Row) -> float | None:
    """Recorded by the rank since schema 2; older rows stored tokens/s beside samples/s, whose ratio is it."""
    m = measurements(row)
    if m.get("tokens_per_sample") is not None:
        return float(m["tokens_per_sample"])
    if m.get("tokens_per_s") and m.get("samples_per_s"):
        return round(float(m["tokens_per_s"]) / float(m["samples_per_s"]))
    return None


def launch_throughput(row: Row, basis: Basis) -> dict[str, Any]:
    """Step-time medians and throughput of one ok launch on the given basis (None where it has no steps)."""
    every, unstalled = step_times(row), unstalled_step_times(row)
    steps = unstalled if basis is Basis.UNSTALLED else every
    figures: dict[str, Any] = {
        "step_time_median_s": median(every) if every else None,
        "step_time_unstalled_median_s": median(unstalled) if unstalled else None,
        # The launch's fastest step: other load only adds time to a step, so this is its least disturbed
        # reading of what the code costs (the A/B tier's step-time figure beside the median, harness/ab.py).
        "step_time_unstalled_fastest_s": min(unstalled) if unstalled else None,
        "step_time_on_basis_s": median(steps) if steps else None,
        "host_stalled_steps": len(every) - len(unstalled),
        "timed_steps_recorded": len(every),
        "throughput_basis": basis.value,
        "samples_per_s": None, "samples_per_s_all_steps": None, "samples_per_s_per_device": None,
        "tokens_per_s": None,
    }
    if not steps:
        return figures
    s = spec(row)
    samples_per_s = s["global_batch"] / median(steps)
    tokens = tokens_per_sample(row)
    figures.update({
        "samples_per_s": samples_per_s,
        "samples_per_s_all_steps": s["global_batch"] / median(every),
        "samples_per_s_per_device": samples_per_s / s["world_size"],
        "tokens_per_s": samples_per_s * tokens if tokens else None,
    })
    return figures
