"""Regression benchmarks over a small CPU matrix, run through the harness's Python API.

Each `track_*` benchmark returns one figure of one cell (asv records it per commit), measured by launching
the cells exactly as `python -m harness run` does: the plain loop and DDP at two ranks on gpt-tiny. The
cells run once per benchmark session (`setup_cache`) and their figures come from `harness.derive`, as in
`harness report`; the `time_*` benchmark measures the harness's own overhead, the wall time of launching
one short cell.
"""

import tempfile
from pathlib import Path

from harness.derive.cells import cell_table
from harness.derive.rows import load_rows
from harness.matrix import Machine, Selection, build_matrix
from harness.runner import RunOptions, run_specs
from harness.spec import DeviceKind, Status

MACHINE = Machine(device=DeviceKind.CPU, devices_per_node=2)
STRATEGIES = ["plain", "ddp"]


def run_small_matrix() -> dict:
    """{strategy: derived cell figures} of the plain and DDP (2 ranks) gpt-tiny cells."""
    out = Path(tempfile.mkdtemp(prefix="parbench-asv-")) / "cells.jsonl"
    specs = build_matrix("smoke", MACHINE, Selection(workloads=("gpt-tiny",)))
    run_specs(specs, RunOptions(results=out, timeout_s=600))
    cells = cell_table(load_rows([out]))
    return {cell["strategy"]: cell for cell in cells.to_dict("records") if cell["status"] == "ok"}


def small_matrix_cells(_benchmark) -> dict:
    """The classes' shared `setup_cache`: asv keys a cache by the function's module and line, so one function
    launches the cells once for every class that names it, not once per class."""
    return run_small_matrix()


small_matrix_cells.timeout = 900    # asv's limit on a setup_cache, read from the function


def _figure(cache: dict, strategy: str, key: str, scale: float = 1.0) -> float:
    value = cache.get(strategy, {}).get(key)
    return float("nan") if value is None or value != value else value * scale


class CellFigures:
    """Throughput and peak memory per rank of each cell."""

    params = (STRATEGIES,)
    param_names = ["strategy"]
    timeout = 900

    setup_cache = small_matrix_cells

    def track_samples_per_s(self, cache, strategy):
        return _figure(cache, strategy, "samples_per_s")

    track_samples_per_s.unit = "samples/s"

    def track_peak_rss_per_rank(self, cache, strategy):
        return _figure(cache, strategy, "peak_rss_bytes_max", 1 / (1 << 20))

    track_peak_rss_per_rank.unit = "MiB"


class CommunicationFigures:
    """Exposed communication share of the DDP cell (the plain loop has no communication)."""

    params = (["ddp"],)
    param_names = ["strategy"]
    timeout = 900

    setup_cache = small_matrix_cells

    def track_exposed_comm_share(self, cache, strategy):
        return _figure(cache, strategy, "exposed_comm_share", 100.0)

    track_exposed_comm_share.unit = "%"


class LaunchLatency:
    """Wall time of launching one short cell (one warm-up, one timed step): the harness's overhead."""

    params = (["plain", "ddp"],)
    param_names = ["strategy"]
    number = 1
    repeat = 1
    timeout = 600

    def setup(self, strategy):
        select = Selection(workloads=("gpt-tiny",), strategies=(strategy,), world_sizes=(2,),
                           overrides=(("warmup_steps", 1), ("timed_steps", 1)))
        self.specs = build_matrix("smoke", MACHINE, select)
        self.out = Path(tempfile.mkdtemp(prefix="parbench-asv-")) / "launch.jsonl"

    def time_launch_one_cell(self, strategy):
        results = run_specs(self.specs, RunOptions(results=self.out, timeout_s=600))
        if any(r.status is not Status.OK for r in results) or not results:
            raise RuntimeError(f"launch failed: {[r.message for r in results]}")
