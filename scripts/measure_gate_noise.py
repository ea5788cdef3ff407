"""Measure launch-to-launch variation and the regression gate's false-positive rate on this machine.

    python scripts/measure_gate_noise.py results/fp --runs 8         # ~1 min per run on a quiet 2-core VM
    python scripts/measure_gate_noise.py results/fp results/fp-check # analyse the files of both, pooled

Runs the smoke matrix (plain loop and DDP at 2 ranks on gpt-tiny) with --repeats launches per cell (5 by
default: the gate judges its 5 metrics as one family, and 1 / C(10, 5) = 1/252 <= 0.05 / 5; at 3 it judges
none) into
DIR/run1.jsonl .. DIR/runK.jsonl, skipping files already there, and logs /proc/loadavg before and after
each run in DIR/machine.log (other users of a shared machine are part of what is measured). Then, from the
files alone, it prints:
- each cell's per-launch values (harness/derive/gate.py: one value per launch) in every file;
- their variation: the spread of the launches within one file and over all files, and the largest
  separation between two files' launches (how far every launch of one file lay beyond every launch of
  another: the smallest threshold that would have kept every pair of these files quiet);
- the gate run on every ordered pair of distinct files (identical software, so every exit 1 is a false
  positive), at the gate's default thresholds and at threshold 0 (where the rule fires on a metric with
  chance 1 / C(n + m, n) for exchangeable launches, and a comparison exits 1 with chance at most alpha),
  and on the disjoint pairs (1, 2), (3, 4), ...
  (independent of each other, unlike the ordered pairs, which reuse every file);
- the gate on run1 against copies of it with every step time, or every peak memory figure, 1.3 times
  larger: whether a planted 30% regression is caught.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.derive.cells import launch_record  # noqa: E402
from harness.derive.gate import DEFAULT_ALPHA, METRICS, Margin, Verdict, gate, separation  # noqa: E402
from harness.derive.rows import load_rows  # noqa: E402
from harness.derive.throughput import Basis  # noqa: E402
from harness.spec import DeviceKind  # noqa: E402


def run(folder: Path, runs: int, repeats: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(1, runs + 1):
        out = folder / f"run{k}.jsonl"
        if out.exists():
            continue
        _log(folder, f"run{k} before")
        with open(folder / f"run{k}.out", "w") as log:
            subprocess.run([sys.executable, "-m", "harness", "run", "--matrix", "smoke", "--repeats", str(repeats),
                            "--out", str(out)], check=True, stdout=log, stderr=subprocess.STDOUT)
        _log(folder, f"run{k} after")


def _log(folder: Path, what: str) -> None:
    with open("/proc/loadavg") as load, open(folder / "machine.log", "a") as log:
        log.write(f"{what} {datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ} load {load.read().strip()}\n")


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("run*.jsonl"), key=lambda p: int(p.stem.removeprefix("run")))


def _per_launch(rows) -> dict[tuple[str, str], list[float]]:
    values: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if row["status"] != "ok":
            continue
        launch = launch_record(row, Basis.UNSTALLED)
        for metric in METRICS:
            value = metric.per_launch(launch)
            if value is not None:
                values.setdefault((launch["label"], metric.name), []).append(value)
    return values


def _show(metric, value: float | None) -> str:
    if value is None:
        return "overlap"
    return f"{value * 100:+.1f} pt" if metric.margin is Margin.ABSOLUTE else f"{value:+.1%}"


def _spread(metric, values: list[float]) -> float:
    return max(values) - min(values) if metric.margin is Margin.ABSOLUTE else max(values) / min(values) - 1


def analyse(folders: list[Path]) -> None:
    files = [path for folder in folders for path in _files(folder)]
    rows = {(path.stem if len(folders) == 1 else f"{path.parent.name}/{path.stem}"): load_rows([path])
            for path in files}
    values = {name: _per_launch(r) for name, r in rows.items()}
    metrics = {m.name: m for m in METRICS}
    keys = sorted({key for v in values.values() for key in v})
    for folder in folders:
        print(f"{len(_files(folder))} files in {folder}")
        if (folder / "machine.log").exists():
            print((folder / "machine.log").read_text())

    print("per-launch values (step time in ms, memory in MiB, exposed share in %):")
    for label, name in keys:
        metric = metrics[name]
        print(f"  {label} {name}")
        for file, per in values.items():
            shown = ", ".join(f"{v * metric.scale:.4g}" for v in per.get((label, name), []))
            print(f"    {file:>14}: {shown}")

    print("\nvariation:")
    for label, name in keys:
        metric = metrics[name]
        per_file = [v[(label, name)] for v in values.values() if len(v.get((label, name), [])) >= 2]
        if not per_file:
            continue
        within = max(_spread(metric, v) for v in per_file)
        overall = _spread(metric, [x for v in per_file for x in v])
        gaps = [separation(a, b, metric.margin) for a, b in itertools.permutations(per_file, 2)]
        worst = max((abs(g) for g in gaps if g is not None), default=None)
        apart = sum(g is not None for g in gaps)
        print(f"  {label} {name}: within one file up to {_show(metric, within)}, over all files "
              f"{_show(metric, overall)}; file pairs with no overlap {apart}/{len(gaps)}, largest separation "
              f"{_show(metric, worst)} (CPU threshold now {_show(metric, metric.thresholds[DeviceKind.CPU])})")

    names = list(rows)
    for title, pairs in (("every ordered pair", list(itertools.permutations(names, 2))),
                         ("disjoint pairs", [(names[i], names[i + 1]) for i in range(0, len(names) - 1, 2)])):
        print(f"\ngate on {title} of files ({len(pairs)} pairs):")
        for thresholds, what in ((None, "default thresholds"), ({"*": 0.0}, "threshold 0")):
            exits, fired, judged, by_metric = 0, 0, 0, {}
            for a, b in pairs:
                result = gate(rows[a], rows[b], thresholds)
                exits += result.regressed
                judged += sum(j.verdict is not Verdict.NOT_JUDGED for j in result.judgements)
                fired += result.count(Verdict.REGRESSION)
                for j in result.judgements:
                    if j.verdict is Verdict.REGRESSION:
                        key = f"{j.label.split('/')[1]} {j.metric.name}"
                        by_metric[key] = by_metric.get(key, 0) + 1
            print(f"  {what}: {exits}/{len(pairs)} pairs exit 1 (at most {DEFAULT_ALPHA:g} expected); {fired}/"
                  f"{judged} judged metrics called a regression ({fired / max(judged, 1):.3f}; at threshold 0 "
                  f"1 / C(n + m, n) a metric): "
                  + (", ".join(f"{k} {v}" for k, v in sorted(by_metric.items())) or "none"))

    first = names[0]
    for what, change in (("step time", _scaled_steps), ("peak memory", _scaled_memory)):
        result = gate(rows[first], [change(r, 1.3) for r in rows[first]])
        flagged = [f"{j.label} {j.metric.name} {_show(j.metric, j.separation)}" for j in result.judgements
                   if j.verdict is Verdict.REGRESSION]
        missed = [f"{j.label} {j.metric.name} separation {_show(j.metric, j.separation)}"
                  for j in result.judgements if j.verdict is not Verdict.REGRESSION
                  and (what == "step time") == j.metric.name.startswith("step_time")]
        print(f"\n{first} against itself with {what} x 1.3: exit {int(result.regressed)}; flagged: "
              f"{'; '.join(flagged) or 'nothing'}; not flagged: {'; '.join(missed) or 'nothing'}")


def _scaled_steps(row, factor: float):
    m = dict(row["measurements"])
    m["step_time_s"] = [t * factor for t in m.get("step_time_s", [])]
    return {**row, "measurements": m}


def _scaled(value, factor: float):
    if isinstance(value, list):
        return [_scaled(v, factor) for v in value]
    return value * factor if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _scaled_memory(row, factor: float):
    """Every peak-memory figure of the row (per rank, and the stored maxima of schema-1 rows) x factor."""
    m = {k: (_scaled(v, factor) if k.startswith("peak_") and k.endswith(("_max", "_by_rank")) else v)
         for k, v in row["measurements"].items()}
    return {**row, "measurements": m}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+", help="where the runs are (made in the first)")
    parser.add_argument("--runs", type=int, default=0, help="make run1..runN in the first folder (those missing)")
    parser.add_argument("--repeats", type=int, default=5, help="launches per cell in each run (default 5)")
    args = parser.parse_args()
    # Ranks started by torchrun import the harness of this checkout, not an installed one.
    root = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    run(args.folders[0], args.runs, args.repeats)
    analyse(args.folders)


if __name__ == "__main__":
    main()
