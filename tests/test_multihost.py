"""Across two hosts for real: network-namespace hosts (tests/hosts.py), with an sshd each where Horovod needs it.

- Horovod alone: `horovodrun -H a:1,b:1 --gloo`, started on host 0, reaches host 1 by ssh and the two ranks
  all-reduce across the veth link; independent of the harness.
- Through the CLI (`run --hostfile F --remote-shell "ip netns exec NS{node} sh -c"`): a Horovod cell with a rank
  on each host, and for DDP, Horovod and ZeRO-2 a rank killed on host 1 (PARBENCH_FAULT), which must end as a
  failed row and leave no process of the cell on either host.

Needs root, iproute2 and, for Horovod, openssh-server and Horovod itself; each test skips saying which is missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.cli import main
from harness.record import read_results
from harness.spec import RunResult, Status
from hosts import NamespaceHosts, SshHosts, namespace_hosts, ssh_hosts  # noqa: F401  (fixtures, found by name)

pytestmark = pytest.mark.launch   # every test here starts hosts (namespaces, sshd) and launches across them

REPO = Path(__file__).resolve().parents[1]
SHORT = ["--timed-steps", "2", "--warmup-steps", "1", "--timeout", "400"]
CELL_TOKEN = re.compile(r"PARBENCH_CELL_TOKEN=([0-9a-f]+)")
GONE_WITHIN_S = 10.0     # an ssh session's sshd notices its closed connection a moment after the client dies

# Each rank all-reduces a tensor that depends on its rank and reports what it got, where it ran (its host's
# address on pbeth) and what of the launching environment reached it.
ALLREDUCE_SCRIPT = """\
import json, os, sys
import psutil, torch
import horovod.torch as hvd

hvd.init()
total = hvd.allreduce(torch.arange(4, dtype=torch.float64) * (hvd.rank() + 1), op=hvd.Sum)
address = [a.address for a in psutil.net_if_addrs()["pbeth"] if a.family.name == "AF_INET"]
report = {"rank": hvd.rank(), "size": hvd.size(), "cross_rank": hvd.cross_rank(), "local_size": hvd.local_size(),
          "sum": total.tolist(), "address": address, "probe": os.environ.get("PARBENCH_PROBE"),
          "path_head": os.environ["PATH"].split(":")[0], "cwd": os.getcwd()}
with open(os.path.join(sys.argv[1], f"rank{hvd.rank()}.json"), "w") as out:
    json.dump(report, out)
"""


def _horovodrun() -> Path:
    pytest.importorskip("horovod.torch", reason="Horovod is not installed (scripts/install-horovod.sh builds it)")
    return Path(sys.executable).parent / "horovodrun"


def test_horovodrun_allreduces_across_two_hosts_over_ssh(ssh_hosts: SshHosts, tmp_path):
    runner = _horovodrun()
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_SCRIPT)
    a, b = ssh_hosts.hosts.addresses
    # --network-interface spares the interface probe (a task server started on every host over ssh);
    # --disable-cache keeps horovodrun's cache of ssh checks out of ~/.horovod.
    command = [str(runner), "-np", "2", "-H", f"{a}:1,{b}:1", "--gloo", "--network-interface", "pbeth",
               "--disable-cache", "--start-timeout", "60", sys.executable, str(script), str(tmp_path)]
    line = (f"cd {shlex.quote(str(REPO))} && PATH={ssh_hosts.bin_dir}:$PATH PARBENCH_PROBE=forwarded "
            f"exec {shlex.join(command)}")
    ran = subprocess.run(ssh_hosts.hosts.shell(0, line), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        assert report["size"] == 2 and report["local_size"] == 1 and report["cross_rank"] == rank
        assert report["sum"] == [0.0, 3.0, 6.0, 9.0]                       # arange(4) x 1 + arange(4) x 2
        assert report["address"] == [ssh_hosts.hosts.addresses[rank]]     # rank 1 really ran on host 1
        # horovodrun hands its whole environment to every rank (`env K=V ...` inside the ssh command), and
        # starts remote ranks in its own working folder.
        assert report["probe"] == "forwarded" and report["path_head"] == str(ssh_hosts.bin_dir)
        assert report["cwd"] == str(REPO)
    _assert_gone(lambda: {pid: "an ssh session" for pid in ssh_hosts.sessions()})


# ---- through the CLI -------------------------------------------------------------------------------------

def _run_across(hosts: NamespaceHosts, strategy: str, tmp_path: Path, exit_status: int = 0) -> RunResult:
    """The cell's one row; `harness run` must exit `exit_status` (4: the cell failed)."""
    out = tmp_path / "rows.jsonl"
    assert main(["run", "--matrix", "smoke", "--strategy", strategy, "--world-sizes", "2", "--out", str(out),
                 "--hostfile", str(hosts.hostfile(tmp_path)), "--remote-shell", hosts.remote_shell,
                 *SHORT]) == exit_status
    [row] = read_results([out])
    return row


def _cell_processes(hosts: NamespaceHosts, row: RunResult, keep: set[int]) -> dict[int, str]:
    """What is left of the cell: any process on either host (their namespaces) but `keep`, and anywhere on this
    machine any process carrying the cell's marker or naming its folder (spec file, outputs) in its command."""
    commands = row.node_launch_commands or [row.launch_command]
    tokens = set(CELL_TOKEN.findall(json.dumps(commands)))
    assert len(tokens) == 1, f"the node commands should carry the cell's marker once: {commands}"
    token, cell = tokens.pop(), str(Path(row.artifacts_dir))
    left = {pid: f"on host {node}" for node in range(len(hosts.namespaces)) for pid in hosts.pids(node) - keep}
    for process in psutil.process_iter(["cmdline"]):
        try:
            if cell in " ".join(process.info["cmdline"] or ()):
                left[process.pid] = "naming the cell's folder"
            elif process.environ().get("PARBENCH_CELL_TOKEN") == token:
                left[process.pid] = "carrying the cell's marker"
        except psutil.Error:
            continue
    return left


def _assert_gone(find) -> None:
    """`find()` -> {pid: why} must come back empty, at once or within GONE_WITHIN_S."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = {pid: f"{why}: {_command_of(pid)}" for pid, why in left.items()}
    assert not described, f"processes of the cell outlived it: {described}"


def _command_of(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:200]
    except psutil.Error:
        return "(gone)"


def test_horovod_runs_a_cell_with_a_rank_on_each_host(ssh_hosts: SshHosts, tmp_path, monkeypatch):
    _horovodrun()
    monkeypatch.setenv("PATH", f"{ssh_hosts.bin_dir}:{os.environ['PATH']}")    # forwarded to every node
    row = _run_across(ssh_hosts.hosts, "horovod", tmp_path)
    assert row.status is Status.OK, row.message
    assert row.spec.nnodes == 2 and row.measurements["node_rank_by_rank"] == [0, 1]
    assert row.measurements["data_parallel"] == 2 and len(row.measurements["step_time_s"]) == 2
    a, b = ssh_hosts.hosts.addresses
    # One horovodrun, started on the first host through the remote shell, reaching the second by ssh.
    shown = row.node_launch_commands or [row.launch_command]
    assert len(shown) == 1 and f"ip netns exec {ssh_hosts.hosts.namespaces[0]} sh -c" in " ".join(shown[0])
    assert any("horovodrun" in part and f"{a}:1,{b}:1" in part for part in shown[0])
    _assert_gone(lambda: {**_cell_processes(ssh_hosts.hosts, row, set(ssh_hosts.sshd_pids)),
                          **{pid: "an ssh session" for pid in ssh_hosts.sessions()}})


@pytest.mark.parametrize("strategy", ["ddp", "horovod", "zero2"])
def test_a_rank_killed_on_one_host_fails_the_cell_and_leaves_nothing_on_either(strategy, request, tmp_path,
                                                                               monkeypatch):
    if strategy == "horovod":
        _horovodrun()
        ssh: SshHosts | None = request.getfixturevalue("ssh_hosts")
        hosts, keep = ssh.hosts, set(ssh.sshd_pids)
        monkeypatch.setenv("PATH", f"{ssh.bin_dir}:{os.environ['PATH']}")
    else:                  # torchrun and DeepSpeed's launcher are started on each host by the remote shell
        ssh, hosts, keep = None, request.getfixturevalue("namespace_hosts"), set()
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "pbeth")
    monkeypatch.setenv("PARBENCH_FAULT", "kill:rank=1:step=1")      # rank 1 runs on host 1
    row = _run_across(hosts, strategy, tmp_path, exit_status=4)
    assert row.status is Status.FAILED, (row.status, row.message)
    assert row.spec.nnodes == 2
    # Failed for the planted reason: rank 1 got as far as its steps, and no further.
    log = "".join(path.read_text(errors="replace") for path in Path(row.artifacts_dir).glob("log*.txt"))
    assert re.search(r"\[parbench rank 1\] \S+ model wrapped", log), log[-2000:]
    assert not re.search(r"\[parbench rank 1\] \S+ timed steps done", log)
    _assert_gone(lambda: {**_cell_processes(hosts, row, keep),
                          **({pid: "an ssh session" for pid in ssh.sessions()} if ssh else {})})
