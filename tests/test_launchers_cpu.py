"""Each launcher that starts ranks of its own (torchrun's rank kill is tests/test_faults.py's) for real on this
host: a rank killed with SIGKILL becomes a `failed` row that says so, read from what that launcher writes,
and no process of the launch is left."""

from __future__ import annotations

import json
import os
import shlex

import psutil
import pytest

from harness.matrix import Machine, Selection, build_matrix
from harness.runner import RunOptions, run_specs
from harness.spec import DeviceKind, RunSpec, Status


def processes_naming(folder: str) -> list[psutil.Process]:
    """Processes whose command line names a launch's folder (its launcher and ranks; only this launch's)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(folder in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


@pytest.mark.launch
@pytest.mark.parametrize("strategy, launcher", [("zero2", "deepspeed"), ("horovod", "horovodrun")])
def test_a_rank_killed_under_the_launcher_is_named_sigkill_and_nothing_is_left(strategy, launcher, tmp_path,
                                                                                monkeypatch):
    pytest.importorskip({"zero2": "deepspeed", "horovod": "horovod.torch"}[strategy])
    monkeypatch.setenv("PARBENCH_FAULT", "kill:rank=1:step=1")
    [spec] = build_matrix("smoke", Machine(device=DeviceKind.CPU, devices_per_node=2),
                          Selection(workloads=("gpt-tiny",), strategies=(strategy,), world_sizes=(2,),
                                    overrides=(("warmup_steps", 1), ("timed_steps", 2))))
    [row] = run_specs([spec], RunOptions(results=tmp_path / "rows.jsonl", timeout_s=300))
    assert any(part.endswith(f"/{launcher}") for part in row.launch_command), row.launch_command
    # Without the launcher's own words for it, the row would carry the surviving rank's echo instead
    # (DeepSpeed's launcher exits 247 and Horovod's peers report "Horovod has been shut down").
    # DeepSpeed's launcher logs only the first non-zero exit it polls, the victim's or the echo's; either way
    # the row names the killed rank, not the echo.
    assert row.status is Status.FAILED, row.message
    assert "killed by SIGKILL" in row.message or "rank 1 died without a report" in row.message, row.message
    assert not processes_naming(row.artifacts_dir)


@pytest.mark.parametrize("rank0_says, expected", [
    ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32653",
     "rank 1 died without a report of its own"),
    ("RuntimeError: planted crash at step 1", "RuntimeError: planted crash at step 1"),
])
def test_a_rank_silent_beside_echoes_is_named_and_a_real_fault_is_kept(tmp_path, rank0_says, expected):
    """Without the launcher's words (DeepSpeed's names whichever exit it polls first), a rank that left no
    report while every other rank reports only a vanished peer is the root cause; a rank's own fault is not
    an echo and stays the message (the launcher then killed the silent rank)."""
    from harness.launch.cell import launch_outcome
    from harness.launch.launcher import LAUNCHERS

    (tmp_path / "rank0.error.json").write_text(json.dumps({"status": "failed", "message": rank0_says}))
    spec = RunSpec(workload="gpt-tiny", strategy="zero2", world_size=2, global_batch=16, micro_batch=4)
    row = launch_outcome(tmp_path, 1, False, LAUNCHERS["deepspeed"], {"spec": spec, "run_id": "r"})
    assert row.status is Status.FAILED and row.message.startswith(expected), row.message


@pytest.mark.launch
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "horovod"])
def test_cells_run_on_a_host_whose_own_name_does_not_resolve(strategy, tmp_path):
    """As in a container with its own host name and no network (`docker run --network none --hostname X`):
    a new network and UTS namespace with only loopback, named something no resolver knows. torchrun and
    DeepSpeed's ranks must meet on loopback without looking the host's name up (torchrun's agent waited out
    its 600 s join timeout before LocalPlacement told it its address and that it serves the store)."""
    import shutil
    import subprocess
    import sys

    pytest.importorskip({"ddp": "torch", "zero2": "deepspeed", "horovod": "horovod.torch"}[strategy])
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux's unshare for a network and UTS namespace")
    out = tmp_path / "rows.jsonl"
    inner = (f"ip link set lo up && hostname parbench-unresolvable && {shlex.quote(sys.executable)} -m harness run "
             f"--matrix smoke --workload gpt-tiny --strategy {strategy} --world-sizes 2 --warmup-steps 1 "
             f"--timed-steps 2 --timeout 240 --out {shlex.quote(str(out))}")
    done = subprocess.run(["unshare", "--net", "--uts", "bash", "-c", inner], capture_output=True, text=True,
                          timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if strategy != "horovod":
        assert done.returncode == 0 and [row["status"] for row in rows] == ["ok"], done.stderr[-2000:]
        return
    # Horovod's Gloo start-up needs the name (it died of SIGSEGV): the row must say why, in the rank's words.
    assert done.returncode == 4 and [row["status"] for row in rows] == ["failed"], done.stderr[-2000:]
    assert "'parbench-unresolvable' does not resolve" in rows[0]["message"], rows[0]["message"]
