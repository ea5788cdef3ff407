"""The asv suite runs: asv itself runs every benchmark once (`asv run --python=same --quick`, as the docs say),
over this checkout, and each figure it records is the one its name and unit promise.

asv is run once for the module (about 20 s on 2 cores: the plain and DDP cells of the figures' shared
setup_cache, then one short launch of each for `time_launch_one_cell`), so that what only asv does is
exercised too: discovery, params, setup_cache, the config. Everything it writes (config, machine file,
results, its temporary files and the cells' rows) lands in the test's temporary folder, not the checkout.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parent.parent
ASV = Path(sys.executable).parent / "asv"
MACHINE = "parbench-test"


def committed_config() -> dict:
    from asv.util import load_json     # JSON with comments, read as asv reads it (which drops "version")

    return load_json(str(ROOT / "suite" / "asv.conf.json"), api_version=1, js_comments=True)


def run_asv(folder: Path) -> dict:
    """Runs the committed suite under the committed config, with every path asv writes moved into `folder`;
    returns its exit status and output, the benchmarks it discovered and the results it recorded."""
    config = {"version": 1, **committed_config(), "repo": str(ROOT),
              "benchmark_dir": str(ROOT / "suite" / "benchmarks"), "results_dir": str(folder / "results"),
              "html_dir": str(folder / "html"), "env_dir": str(folder / "env")}
    (folder / "asv.conf.json").write_text(json.dumps(config))
    (folder / "tmp").mkdir()
    # asv drops PYTHONPATH from a benchmark's environment and takes ASV_PYTHONPATH instead: this checkout's
    # harness is measured even where the venv's editable install points at another checkout. TMPDIR holds the
    # suite's rows (tempfile.mkdtemp) and asv's own temporary files; HOME holds the machine file.
    env = {**os.environ, "HOME": str(folder), "TMPDIR": str(folder / "tmp"), "ASV_PYTHONPATH": str(ROOT),
           "PYTHONDONTWRITEBYTECODE": "1"}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    subprocess.run([str(ASV), "machine", "--yes", "--machine", MACHINE], cwd=folder, env=env, check=True,
                   capture_output=True)
    done = subprocess.run([str(ASV), "run", "--python=same", "--quick", "--machine", MACHINE,
                           f"--set-commit-hash={head}", "--show-stderr"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    recorded = list((folder / "results" / MACHINE).glob(f"{head[:8]}-*.json"))
    return {"returncode": done.returncode, "output": done.stdout + done.stderr, "head": head,
            "benchmarks": json.loads((folder / "results" / "benchmarks.json").read_text()),
            "results": json.loads(recorded[0].read_text()) if len(recorded) == 1 else None,
            "rows": folder / "tmp"}


@pytest.fixture(scope="module")
def asv_run(tmp_path_factory) -> dict:
    return run_asv(tmp_path_factory.mktemp("asv"))


def declared_benchmarks() -> dict[str, int]:
    """{asv name: number of parameter combinations} of every track_/time_ method of every class in the suite."""
    module = importlib.import_module("suite.benchmarks.cells")
    found = {}
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        for name in dir(cls):
            if name.startswith(("track_", "time_")):
                found[f"cells.{cls.__name__}.{name}"] = math.prod(len(values) for values in cls.params)
    return found


def recorded_values(asv_run: dict) -> dict[str, dict[str, float | None]]:
    """{benchmark: {parameter: value}} as asv recorded them; asv records a failure or a NaN as null."""
    results = asv_run["results"]
    columns = results["result_columns"]
    values = {}
    for name, entry in results["results"].items():
        record = dict(zip(columns, entry))
        labels = [", ".join(combo) for combo in _combinations(record["params"])]
        values[name] = {label.strip("'"): value for label, value in zip(labels, record["result"])}
    return values


def _combinations(params: list[list[str]]) -> list[tuple[str, ...]]:
    combos: list[tuple[str, ...]] = [()]
    for values in params:
        combos = [combo + (value,) for combo in combos for value in values]
    return combos


def test_asv_runs_every_benchmark_and_each_records_a_value(asv_run):
    tail = "\n".join(asv_run["output"].splitlines()[-60:])
    assert asv_run["returncode"] == 0, f"asv run exited {asv_run['returncode']}:\n{tail}"
    declared = declared_benchmarks()
    assert declared, "the suite declares no benchmark"
    discovered = {name for name in asv_run["benchmarks"] if name != "version"}
    assert discovered == set(declared), f"asv discovered {sorted(discovered)}, the suite declares {sorted(declared)}"
    assert asv_run["results"] is not None, f"asv recorded no results for {asv_run['head']}:\n{tail}"
    values = recorded_values(asv_run)
    assert set(values) == set(declared), f"asv recorded {sorted(values)}:\n{tail}"
    for name, by_parameter in values.items():
        assert len(by_parameter) == declared[name], (name, by_parameter)
        # Every combination is expected to give a value: none is skipped (NotImplementedError in setup) today.
        missing = [p for p, v in by_parameter.items() if v is None or not math.isfinite(v)]
        assert not missing, f"{name} recorded no value (raised, or returned NaN) for {missing}:\n{tail}"


def _rows(folder: Path, file_name: str) -> list[dict]:
    files = list(folder.glob(f"parbench-asv-*/{file_name}"))
    return [json.loads(line) for path in files for line in path.read_text().splitlines() if line.strip()]


def test_each_figure_is_the_one_its_name_and_unit_promise(asv_run):
    """Each value asv recorded, against the same figure worked out by hand from the launched rows (the
    formulas of docs/methodology.md and README "Exposed communication"), so that a benchmark reading the
    wrong column or scaling it to the wrong unit fails here."""
    values = recorded_values(asv_run)
    cells = {row["spec"]["strategy"]: row for row in _rows(asv_run["rows"], "cells.jsonl")}
    assert set(cells) == {"plain", "ddp"}, f"setup_cache's rows: {sorted(cells)}"
    assert all(row["status"] == "ok" for row in cells.values())
    # The suite measured this checkout (ASV_PYTHONPATH), not the one the venv's install points at.
    measured = {row["environment"]["git_sha"] for row in cells.values()}
    assert measured == {asv_run["head"]}, f"the suite's rows name commit {measured}, this checkout is {asv_run['head']}"

    def steps(row, unstalled):
        stalled = set(row["measurements"].get("host_stalled_step_indices") or ()) if unstalled else set()
        return [t for i, t in enumerate(row["measurements"]["step_time_s"]) if i not in stalled]

    # samples/s = global batch / median timed step, on unstalled steps for both cells where either had a
    # stall and both kept an unstalled step (the throughput basis of a set), else on every step.
    unstalled = (any(row["measurements"].get("host_stalled_step_indices") for row in cells.values())
                 and all(steps(row, True) for row in cells.values()))
    for strategy, row in cells.items():
        expected = row["spec"]["global_batch"] / median(steps(row, unstalled))
        assert values["cells.CellFigures.track_samples_per_s"][strategy] == pytest.approx(expected, rel=1e-9)
        # MiB: the largest rank's peak RSS over the timed steps, 2**20 bytes to the MiB.
        expected = max(row["measurements"]["peak_rss_bytes_by_rank"]) / 2**20
        assert values["cells.CellFigures.track_peak_rss_per_rank"][strategy] == pytest.approx(expected, rel=1e-9)

    # Exposed communication, in %, of DDP's 2 ranks: 100 x (median real step - median compute-only step) /
    # median real step, a step being its slowest rank's and leaving out the steps the host stalled on any rank.
    m = cells["ddp"]["measurements"]
    compute_stalled = {i for i, flags in enumerate(zip(*m["compute_only_host_stalled_by_rank"])) if any(flags)}
    compute = [max(ranks) for i, ranks in enumerate(zip(*m["compute_only_step_time_s_by_rank"]))
               if i not in compute_stalled]
    real = steps(cells["ddp"], True)
    expected = 100 * (median(real) - median(compute)) / median(real)
    assert values["cells.CommunicationFigures.track_exposed_comm_share"]["ddp"] == pytest.approx(expected, rel=1e-9)

    # Seconds of the whole launch, which holds the launch's own wall time as its row records it.
    launches = {row["spec"]["strategy"]: row for row in _rows(asv_run["rows"], "launch.jsonl")}
    assert set(launches) == {"plain", "ddp"}
    for strategy, row in launches.items():
        assert row["spec"]["timed_steps"] == 1 and row["spec"]["warmup_steps"] == 1
        assert values["cells.LaunchLatency.time_launch_one_cell"][strategy] >= row["wall_time_s"]
