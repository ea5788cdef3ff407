"""What a run on CPU will take, known before it starts: each launch's seconds as measured on the 2-core VM, by
strategy. `harness run` prints it in its first line, and the default matrix is held to a budget with it
(`DEFAULT_RUN_BUDGET_S`, tests/test_run_cost.py), so that `make run` stays a newcomer's few minutes as strategies
join: a new one's cells go past it until others move to `--matrix wide`.

On GPUs the wall time is projected from the model and the cluster instead (`run --dry-run --cluster`,
harness.launch.dry_run): a launch there is its steps, not interpreter start-up.
"""

from __future__ import annotations

from typing import Iterable

from harness.spec import DeviceKind, RunSpec

# A launch's seconds on the 2-core VM, launcher and ranks from start to exit (a row's wall_time_s), for gpt-tiny at 2
# ranks (the plain and bare loops at 1) with 3 warm-up and 10 timed steps: the `make run` of a fresh clone there,
# 2026-11-28, one launch at a time. On CPU a tiny workload's launch is the interpreters and libraries starting: the
# same strategy's launches on llama-tiny and ResNet-20 in that run were within 15% of these (ZeRO-3 25.5, 23.7, 24.9 s).
CPU_LAUNCH_S = {"plain": 7.1, "bare": 7.0, "dataparallel": 0.0, "ddp": 10.0, "horovod": 10.8, "zero1": 20.7,
                "zero2": 20.2, "zero3": 25.5, "fsdp2": 12.4, "pipeline": 19.2, "tp": 16.5, "fsdp2-tp": 18.2,
                "autotp": 22.0, "ps": 9.8, "ps-async": 11.8}
# A strategy measured nowhere yet (a new one): as the slowest above.
UNMEASURED_LAUNCH_S = max(CPU_LAUNCH_S.values())
# `harness run` itself: the interpreter, the environment's capture, the table at the end (5.8 s measured there).
HARNESS_START_S = 6.0
# The default matrix on CPU (`make run`: `run --matrix full`) in at most this: with `make setup`'s 1.3 minutes from a
# fresh clone (uv, measured 2026-11-29 on the 2-core VM), under the 6.5 minutes a newcomer should wait. There a
# fresh clone's `make run` took 292, 302 and 308 s (its launches 3.6-3.9 minutes against this estimate's 3.5).
DEFAULT_RUN_BUDGET_S = 225.0


def launch_seconds(spec: RunSpec) -> float:
    """One launch of `spec` on CPU, from CPU_LAUNCH_S (DataParallel's is its skip: nothing launches)."""
    return CPU_LAUNCH_S.get(spec.strategy, UNMEASURED_LAUNCH_S)


def planned_seconds(launches: Iterable[RunSpec]) -> float | None:
    """The wall time of a run of these launches (one spec per launch) on the 2-core VM; None where any is not a CPU
    launch (a GPU's is projected by the dry run instead)."""
    launches = list(launches)
    if any(spec.device is not DeviceKind.CPU for spec in launches):
        return None
    return HARNESS_START_S + sum(launch_seconds(spec) for spec in launches)
