"""Each launcher that starts ranks of its own (torchrun's rank kill is tests/test_faults.py's) for real on this
host: a rank killed with SIGKILL becomes a `failed` row that says so, read from what that launcher writes,
and no process of the launch is left."""

from __future__ import annotations

import psutil
import pytest

from harness.matrix import Machine, Selection, build_matrix
from harness.runner import RunOptions, run_specs
from harness.spec import DeviceKind, Status


def processes_naming(folder: str) -> list[psutil.Process]:
    """Processes whose command line names a launch's folder (its launcher and ranks; only this launch's)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(folder in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


@pytest.mark.parametrize("strategy, launcher", [("zero2", "deepspeed"), ("horovod", "horovodrun")])
def test_a_rank_killed_under_the_launcher_is_named_sigkill_and_nothing_is_left(strategy, launcher, tmp_path,
                                                                                monkeypatch):
    pytest.importorskip({"zero2": "deepspeed", "horovod": "horovod.torch"}[strategy])
    monkeypatch.setenv("PARBENCH_FAULT", "kill:rank=1:step=1")
    [spec] = build_matrix("smoke", Machine(device=DeviceKind.CPU, gpus=0, cores=2),
                          Selection(workloads=("gpt-tiny",), strategies=(strategy,), world_sizes=(2,),
                                    overrides=(("warmup_steps", 1), ("timed_steps", 2))))
    [row] = run_specs([spec], RunOptions(results=tmp_path / "rows.jsonl", timeout_s=300))
    assert any(part.endswith(f"/{launcher}") for part in row.launch_command), row.launch_command
    # Without the launcher's own words for it, the row would carry the surviving rank's echo instead
    # (DeepSpeed's launcher exits 247 and Horovod's peers report "Horovod has been shut down").
    assert row.status is Status.FAILED and "killed by SIGKILL" in row.message, row.message
    assert not processes_naming(row.artifacts_dir)
