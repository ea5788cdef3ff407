"""Multi-node launches for real: a torchrun rendezvous (and DeepSpeed's hostfile launcher) across two network
namespaces standing in for two hosts, and a 2-rank cell submitted through a real one-node Slurm cluster.
Both need root (namespaces, slurmd); `make test` installs slurm-wlm and munge where it can."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from harness.cli import main
from harness.launch.placement import Host, HostfilePlacement, LocalPlacement, make_placement, read_hostfile
from harness.launch.plan import launch_environment, plan_launch
from harness.record import read_results
from harness.spec import RunSpec, SpecError, Status

REPO = Path(__file__).resolve().parents[1]
SHORT = ["--timed-steps", "2", "--warmup-steps", "1", "--timeout", "400"]


# ---- placement, before anything launches ----------------------------------------------------------------

def test_hostfile_is_read_as_deepspeed_writes_it(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode-a slots=8\n\nnode-b slots=4  # smaller\n")
    assert read_hostfile(hostfile) == (Host("node-a", 8), Host("node-b", 4))


@pytest.mark.parametrize("text, message", [
    ("node-a\n", "expected 'HOST slots=N'"),
    ("node-a slots=0\n", "expected 'HOST slots=N' with N >= 1"),
    ("node-a slots=2\nnode-a slots=2\n", "listed twice"),
    ("# nothing\n", "lists no hosts"),
])
def test_a_bad_hostfile_is_one_line_naming_the_line(tmp_path, text, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    with pytest.raises(SpecError, match=message):
        read_hostfile(hostfile)


def test_cells_spread_over_the_nodes_when_they_divide_the_ranks():
    placement = HostfilePlacement(hosts=(Host("a", 2), Host("b", 2)), nnodes=2)
    ddp = RunSpec(workload="gpt-tiny", strategy="ddp", world_size=4, global_batch=16, micro_batch=4)
    assert placement.place(ddp).nnodes == 2 and placement.place(ddp).ranks_per_node == 2
    assert placement.place(ddp.replace(world_size=1)).nnodes == 1                 # too small: first host
    assert placement.place(ddp.replace(strategy="plain", world_size=1)).nnodes == 1
    with pytest.raises(SpecError, match="needs 4 ranks on host a, which has slots=2"):
        HostfilePlacement(hosts=(Host("a", 2), Host("b", 2)), nnodes=1).place(ddp)


def test_each_node_gets_its_own_launcher_and_the_cleanup_reaches_every_host(tmp_path):
    placement = HostfilePlacement(hosts=(Host("10.0.0.1", 1), Host("10.0.0.2", 1)), nnodes=2,
                                  remote_shell="ip netns exec h{node} sh -c")
    ddp = placement.place(RunSpec(workload="gpt-tiny", strategy="ddp", world_size=2, global_batch=16,
                                  micro_batch=4))
    environment = launch_environment(ddp, "t")
    launch = plan_launch(ddp, placement, cell_dir=tmp_path, port="29500", environment=environment, timeout_s=60)
    assert [command[:4] for command in launch.commands] == [("ip", "netns", "exec", "h0"),
                                                            ("ip", "netns", "exec", "h1")]
    node0, node1 = (command[-1] for command in launch.commands)
    assert "--rdzv-endpoint=10.0.0.1:29500" in node0 and "--rdzv-endpoint=10.0.0.1:29500" in node1
    assert "--local-addr=10.0.0.1" in node0 and "is_host=true" in node0 and "is_host=false" in node1
    assert "PARBENCH_CELL_TOKEN=t" in node1 and f"cd {os.getcwd()}" in node1
    assert len(launch.cleanup) == 2 and "pkill" in launch.cleanup[1][-1]

    zero = ddp.replace(strategy="zero2")
    deepspeed = plan_launch(zero, placement, cell_dir=tmp_path, port="29500", environment=environment, timeout_s=60)
    assert "--no_ssh" in deepspeed.commands[1][-1] and "--node_rank=1" in deepspeed.commands[1][-1]
    assert deepspeed.files == ((tmp_path / "hostfile", "10.0.0.1 slots=1\n10.0.0.2 slots=1\n"),)
    assert not (tmp_path / "hostfile").exists()       # planning writes nothing; run_cell writes the plan's files


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2"], "--nnodes 2 needs --hostfile FILE or --slurm"),
    (["--remote-shell", "ssh {host}"], "--remote-shell needs --hostfile"),
    (["--hostfile", "HOSTS", "--nnodes", "3"], "--nnodes 3 but hostfile"),
    (["--hostfile", "HOSTS", "--slurm"], "exclude each other"),
    (["--hostfile", "HOSTS", "--remote-shell", "ssh {hots}"], "only {host} and {node} fields"),
])
def test_bad_placement_is_refused_before_launch(tmp_path, capsys, argv, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=1\n")
    argv = [str(hostfile) if arg == "HOSTS" else arg for arg in argv]
    assert main(["run", "--matrix", "smoke", "--out", str(tmp_path / "r.jsonl"), *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("parbench: error:") and message in error and "\n" not in error
    assert not (tmp_path / "r.jsonl").exists()


# ---- real launches ---------------------------------------------------------------------------------------

def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: hosts 10.77.<n>.1 and .2, each interface named pbeth
    (gloo is told to use it). Yields (hostfile lines, remote shell template)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`; this machine forbids them")
    tag = uuid.uuid4().hex[:6]
    names = [f"pb{tag}h{node}" for node in range(2)]
    subnet = f"10.77.{int(tag, 16) % 250}"
    try:
        for name in names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as error:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {error.stderr.strip()}")
    try:
        _ip("link", "add", f"pb{tag}a", "type", "veth", "peer", "name", f"pb{tag}b")
        for node, (name, end) in enumerate(zip(names, (f"pb{tag}a", f"pb{tag}b"))):
            _ip("link", "set", end, "netns", name)
            _ip("-n", name, "link", "set", end, "name", "pbeth")
            _ip("-n", name, "addr", "add", f"{subnet}.{node + 1}/24", "dev", "pbeth")
            _ip("-n", name, "link", "set", "pbeth", "up")
        yield ([f"{subnet}.1 slots=1", f"{subnet}.2 slots=1"], f"ip netns exec pb{tag}h{{node}} sh -c")
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.launch
def test_torchrun_and_deepspeed_rendezvous_across_two_hosts(two_hosts, tmp_path, monkeypatch):
    lines, remote_shell = two_hosts
    hostfile = tmp_path / "hosts"
    hostfile.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "pbeth")    # forwarded to every node's ranks
    out = tmp_path / "rows.jsonl"
    assert main(["run", "--matrix", "smoke", "--strategy", "ddp,zero2", "--world-sizes", "2", "--out", str(out),
                 "--hostfile", str(hostfile), "--remote-shell", remote_shell, *SHORT]) == 0
    rows = {row.spec.strategy: row for row in read_results([out])}
    for strategy, launcher in (("ddp", "torchrun"), ("zero2", "deepspeed")):
        row = rows[strategy]
        assert row.status is Status.OK, row.message
        assert row.spec.nnodes == 2 and row.measurements["node_rank_by_rank"] == [0, 1]
        assert len(row.node_launch_commands) == 2
        assert all("ip" == c[0] and f"/{launcher} " in c[-1] for c in row.node_launch_commands)
    # Same data, same init: the two ranks on two "hosts" train exactly as DDP does on one.
    assert rows["zero2"].measurements["loss_per_step"] == pytest.approx(rows["ddp"].measurements["loss_per_step"],
                                                                         rel=1e-4)


@pytest.fixture
def slurm_cluster(tmp_path_factory, monkeypatch):
    missing = [tool for tool in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing; scripts/install-test-tools.sh "
                    "installs Debian's slurm-wlm and munge)")
    if os.geteuid() != 0:
        pytest.skip("a one-node Slurm cluster needs root for slurmd")
    folder = tmp_path_factory.mktemp("slurm")
    script = REPO / "scripts" / "slurm-one-node.sh"
    started = subprocess.run([str(script), "start", str(folder)], capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stderr
        monkeypatch.setenv("SLURM_CONF", str(folder / "slurm.conf"))
        yield folder
    finally:
        subprocess.run([str(script), "stop", str(folder)], capture_output=True, timeout=60)


@pytest.mark.launch
def test_two_rank_cells_run_through_slurm_by_torchrun_and_deepspeeds_launcher(slurm_cluster, tmp_path):
    out = tmp_path / "rows.jsonl"
    assert main(["run", "--matrix", "smoke", "--strategy", "ddp,zero2", "--world-sizes", "2", "--out", str(out),
                 "--slurm", *SHORT]) == 0
    rows = {row.spec.strategy: row for row in read_results([out])}
    for strategy, launcher in (("ddp", "torchrun"), ("zero2", "deepspeed")):
        row = rows[strategy]
        assert row.status is Status.OK, row.message
        assert row.launch_command[row.launch_command.index("sbatch") + 1] == "--wait"
        cell = Path(row.artifacts_dir)
        script = (cell / "job.sh").read_text()
        assert "exec srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c " in script
        assert f"/{launcher} " in script.splitlines()[-1]
        assert "steps done" in (cell / "log-slurm.txt").read_text()    # the ranks' output, written by Slurm
        assert len(row.measurements["step_time_s"]) == 2 and row.measurements["data_parallel"] == 2
    # DeepSpeed's hostfile, written inside the job from its node list.
    assert (Path(rows["zero2"].artifacts_dir) / "hostfile").read_text().endswith(" slots=2\n")
    queue = subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=True)
    assert queue.stdout.strip() == ""                     # the job is over, nothing left queued


def test_make_placement_defaults_to_this_host():
    assert make_placement(None, None, None, False, None) == LocalPlacement()
