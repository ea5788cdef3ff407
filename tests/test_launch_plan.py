"""Every launcher under every placement, planned for four 8-GPU nodes without launching anything: the
commands `--dry-run` prints (harness.launch.dry_run.describe_plan) are parsed back and checked node by node,
and the Slurm job scripts are run with a stand-in scontrol and srun that print each node's command."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.cli import main
from harness.launch.cell import launch_dir
from harness.launch.dry_run import describe_plan, planned_environment
from harness.launch.placement import Host, HostfilePlacement, LocalPlacement, SlurmPlacement, make_placement
from harness.launch.placement.base import free_port
from harness.launch.plan import LaunchError
from harness.spec import DeviceKind, Precision, RunSpec, SpecError
from harness.strategies import register
from harness.strategies.base import Strategy

HOSTS = ("gpu-a", "gpu-b", "gpu-c", "gpu-d")
REMOTE_SHELL = "ssh -p 2222 {host}"
HOSTFILE = HostfilePlacement(hosts=tuple(Host(name, 8) for name in HOSTS), remote_shell=REMOTE_SHELL, nnodes=4)


def cuda_spec(strategy: str, world_size: int) -> RunSpec:
    return RunSpec(workload="gpt2-small", strategy=strategy, world_size=world_size, global_batch=256, micro_batch=4,
                   precision=Precision.BF16, device=DeviceKind.CUDA, repeats=3)


# One cell per launcher: the plain loop (python), DDP (torchrun), ZeRO-2 (DeepSpeed's), Horovod (horovodrun).
SPECS = {"python": cuda_spec("plain", 1), "torchrun": cuda_spec("ddp", 32), "deepspeed": cuda_spec("zero2", 32),
         "horovodrun": cuda_spec("horovod", 32)}


@dataclass
class PlannedCell:
    header: str
    commands: list[tuple[str, list[str]]] = field(default_factory=list)   # (target, argv started here)
    cleanup: list[tuple[str, list[str]]] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


def planned(placement, results: Path) -> dict[str, PlannedCell]:
    """describe_plan's output for SPECS, parsed back: {launcher: cell}."""
    specs = [placement.place(spec, 8) for spec in SPECS.values()]
    text = describe_plan(specs, placement, results=results, timeout_s=600)
    cells, current, file_name = {}, None, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and " x3: " in line:
            current = PlannedCell(header=line)
            cells[line.split(": ", 1)[1].split(",")[0]] = current
        elif not line.startswith(" "):      # a line about the whole plan (the header, cells skipped here)
            current = None
        elif current is None:
            continue
        elif line.startswith("    | "):
            current.files[file_name] += line[len("    | "):] + "\n"
        elif line.startswith("  file "):
            file_name = line[len("  file "):-1]
            current.files[file_name] = ""
        elif line.startswith("  clean-up on "):
            target, command = line[len("  clean-up on "):].split(": ", 1)
            current.cleanup.append((target, shlex.split(command)))
        else:
            target, command = line.strip().split(": ", 1)
            current.commands.append((target, shlex.split(command)))
    assert set(cells) == set(SPECS), text
    return cells


def flags(argv: list[str]) -> dict[str, str]:
    return {arg.split("=", 1)[0]: arg.split("=", 1)[1] for arg in argv if arg.startswith("--") and "=" in arg}


def through_remote_shell(argv: list[str], host: str) -> tuple[dict[str, str], list[str]]:
    """The environment and the launcher's argv that a node's remote-shell command runs on `host`."""
    assert argv[:4] == ["ssh", "-p", "2222", host]
    script = shlex.split(argv[4])
    assert len(argv) == 5 and script[:5] == ["cd", os.getcwd(), "&&", "exec", "env"]
    words = script[5:]
    count = next(index for index, word in enumerate(words) if "=" not in word)
    return dict(word.split("=", 1) for word in words[:count]), words[count:]


# ---- a hostfile's hosts ----------------------------------------------------------------------------------

def test_torchrun_runs_on_every_host_with_the_rendezvous_on_the_first(tmp_path):
    cell = planned(HOSTFILE, tmp_path / "rows.jsonl")["torchrun"]
    assert cell.header.endswith("torchrun, 4 node(s) x 8 rank(s)")
    assert [target for target, _ in cell.commands] == [f"node {i} ({host})" for i, host in enumerate(HOSTS)]
    for node, (host, (_, argv)) in enumerate(zip(HOSTS, cell.commands)):
        environment, torchrun = through_remote_shell(argv, host)
        assert Path(torchrun[0]).name == "torchrun" and environment["PARBENCH_CELL_TOKEN"] == "<token>"
        options = flags(torchrun)
        assert (options["--nnodes"], options["--nproc-per-node"]) == ("4", "8")
        assert options["--rdzv-endpoint"] == "gpu-a:<port>" and options["--local-addr"] == host
        assert options["--rdzv-conf"] == f"is_host={'true' if node == 0 else 'false'}"


def test_deepspeed_runs_on_every_host_from_a_hostfile_of_the_cells_hosts(tmp_path):
    cell = planned(HOSTFILE, tmp_path / "rows.jsonl")["deepspeed"]
    [(hostfile, text)] = cell.files.items()
    assert text == "gpu-a slots=8\ngpu-b slots=8\ngpu-c slots=8\ngpu-d slots=8\n"
    assert len(cell.commands) == 4
    for node, (host, (_, argv)) in enumerate(zip(HOSTS, cell.commands)):
        _, deepspeed = through_remote_shell(argv, host)
        options = flags(deepspeed)
        assert Path(deepspeed[0]).name == "deepspeed" and "--no_ssh" in deepspeed
        assert options["--node_rank"] == str(node) and options["--hostfile"] == hostfile
        assert (options["--master_addr"], options["--master_port"]) == ("gpu-a", "<port>")


def test_horovodrun_runs_once_on_the_first_host_and_every_host_is_swept(tmp_path):
    cell = planned(HOSTFILE, tmp_path / "rows.jsonl")["horovodrun"]
    [(target, argv)] = cell.commands
    assert target == "node 0 (gpu-a), reaching gpu-b, gpu-c, gpu-d itself"
    environment, horovodrun = through_remote_shell(argv, "gpu-a")
    assert environment["PARBENCH_CELL_TOKEN"] == "<token>"      # forwarded as for every launcher
    np, hosts = horovodrun[horovodrun.index("-np") + 1], horovodrun[horovodrun.index("-H") + 1]
    assert (np, hosts) == ("32", "gpu-a:8,gpu-b:8,gpu-c:8,gpu-d:8")
    # Clean-up reaches the hosts horovodrun reached over ssh, not only the one it was started on.
    assert [c[0] for c in cell.cleanup] == [f"node {i} ({host})" for i, host in enumerate(HOSTS)]
    spec_file = launch_dir(tmp_path / "rows.jsonl", HOSTFILE.place(SPECS["horovodrun"]), 0,
                           environment=planned_environment(HOSTFILE)) / "spec.json"
    for host, (_, argv) in zip(HOSTS, cell.cleanup):
        assert argv[:4] == ["ssh", "-p", "2222", host] and argv[4].startswith("pkill -KILL -f ")
        assert re.escape(str(spec_file)) in argv[4]


def test_a_single_process_cell_runs_on_the_first_host_alone(tmp_path):
    cell = planned(HOSTFILE, tmp_path / "rows.jsonl")["python"]
    assert cell.header.endswith("python, 1 node(s) x 1 rank(s)")
    [(target, argv)] = cell.commands
    _, python = through_remote_shell(argv, "gpu-a")
    assert python[:3] == [sys.executable, "-m", "harness.rank.worker"] and len(cell.cleanup) == 1


def test_dry_run_with_nnodes_alone_plans_for_placeholder_hosts():
    placement = make_placement(None, 4, None, False, None, dry_run=True)
    assert [host.name for host in placement.hosts] == ["host0", "host1", "host2", "host3"]
    text = describe_plan([placement.place(SPECS["torchrun"])], placement, results=Path("r.jsonl"), timeout_s=60)
    assert sum("4 placeholder hosts" in line for line in text.splitlines()) == 1
    assert "--rdzv-endpoint=host0:<port>" in text
    with pytest.raises(SpecError, match="--nnodes 4 needs --hostfile FILE or --slurm"):
        make_placement(None, 4, None, False, None)


def test_the_dry_run_prints_the_plan_launches_nothing_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    # One core per node: the smoke matrix's 2-rank DDP cell needs both nodes.
    assert main(["run", "--matrix", "smoke", "--dry-run", "--device", "cpu", "--cpus-per-node", "1", "--nnodes", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 placeholder hosts" in printed and "ssh -o BatchMode=yes host1" in printed
    assert list(tmp_path.iterdir()) == []


DATA_PARALLEL = ("ddp", "horovod", "fsdp2", "zero1", "zero2", "zero3")


@pytest.mark.parametrize("matrix", ["scaling", "full", "smoke", "zero-memory"])
def test_a_cluster_of_four_8_gpu_nodes_is_planned_from_a_cpu_host(tmp_path, capsys, matrix):
    """The plan a user checks from a laptop before booking four 8-GPU nodes: every cell with each node's
    command, a cell packed on the fewest nodes that hold it (8 GPUs each), the scaling matrices reaching 32."""
    assert main(["run", "--matrix", matrix, "--dry-run", "--device", "cuda", "--gpus-per-node", "8", "--nnodes", "4",
                 "--out", str(tmp_path / "rows.jsonl")]) == 0
    lines = capsys.readouterr().out.splitlines()
    sizes: dict[str, set[int]] = {}
    for number, line in enumerate(lines):
        heading = re.match(r"[\w.-]+/(\w+)(\[[^]]*\])?/ws(\d+)(x(\d+)nodes)?/.*: (\w+), (\d+) node\(s\) x (\d+) rank", line)
        if not heading:
            continue
        strategy, world_size = heading.group(1), int(heading.group(3))
        nodes = int(heading.group(7))
        sizes.setdefault(strategy, set()).add(world_size)
        assert nodes == max(1, world_size // 8) and int(heading.group(8)) * nodes == world_size, line
        assert nodes == int(heading.group(5) or 1), line
        block = lines[number + 1:]
        block = block[:block.index("")] if "" in block else block      # a cell's lines end at a blank line
        node_lines = [l for l in block if l.startswith("  node ")]
        launcher = heading.group(6)
        # horovodrun reaches the other hosts itself: one command on the first host; the others, one per node
        assert len(node_lines) == (1 if launcher == "horovodrun" else nodes), line
        assert all(f"host{n}" in node_lines[n] for n in range(len(node_lines)))
    assert not list(tmp_path.iterdir())
    expected = {"scaling": {1, 2, 4, 8, 16, 32}, "full": {1, 2, 4, 8, 16, 32}, "smoke": {2}, "zero-memory": {32}}
    planned_strategies = {"smoke": ("ddp",), "zero-memory": ("ddp", "zero1", "zero2", "zero3", "fsdp2")}
    for strategy in planned_strategies.get(matrix, DATA_PARALLEL):
        assert sizes[strategy] == expected[matrix], strategy
    if matrix == "full":
        # One process drives one node's GPUs; at world size 1 it is not parallel: left out, and named.
        assert sizes["dataparallel"] == {2, 4, 8}
        assert "DataParallel over one device is not parallel (world size 1) (4): " in "\n".join(lines)


def test_a_cell_goes_on_the_fewest_nodes_that_hold_it():
    four = HostfilePlacement(hosts=tuple(Host(name, 8) for name in HOSTS), remote_shell=REMOTE_SHELL, nnodes=4)
    # 8 ranks fit one 8-slot node; 16 need two; 24 three (8 each); 32 all four
    specs = [cuda_spec("ddp", 1).replace(world_size=size, global_batch=96) for size in (1, 4, 8, 16, 24, 32)[:3]]
    specs += [cuda_spec("ddp", 16), cuda_spec("ddp", 1).replace(world_size=24, global_batch=96), cuda_spec("ddp", 32)]
    assert [four.place(spec).nnodes for spec in specs] == [1, 1, 1, 2, 3, 4]
    # a hostfile's slots decide, whatever the machine's devices; without slots (placeholders) the devices do
    assert four.place(cuda_spec("ddp", 16), devices_per_node=16).nnodes == 2
    unknown = HostfilePlacement(hosts=tuple(Host(name, None) for name in HOSTS), remote_shell=REMOTE_SHELL, nnodes=4)
    assert unknown.place(cuda_spec("ddp", 16), devices_per_node=16).nnodes == 1
    assert unknown.place(cuda_spec("ddp", 16), devices_per_node=4).nnodes == 4
    assert unknown.place(cuda_spec("ddp", 16).replace(world_size=12, global_batch=48), devices_per_node=8).nnodes == 2
    eleven = cuda_spec("ddp", 16).replace(world_size=11, global_batch=44)   # 2, 3 and 4 nodes all split it unevenly
    with pytest.raises(SpecError, match="no count of nodes from 2 to 4 holds evenly at <= 8 per node"):
        unknown.place(eleven, devices_per_node=8)
    assert four.place(cuda_spec("plain", 1)).nnodes == 1


# ---- this host -------------------------------------------------------------------------------------------

def test_this_host_runs_each_launcher_once_with_the_rendezvous_on_loopback(tmp_path):
    cells = planned(LocalPlacement(), tmp_path / "rows.jsonl")
    commands = {launcher: cell.commands for launcher, cell in cells.items()}
    assert all(len(c) == 1 and c[0][0] == "this host" for c in commands.values())
    torchrun = commands["torchrun"][0][1]
    assert flags(torchrun)["--nnodes"] == "1" and flags(torchrun)["--nproc-per-node"] == "32"
    assert flags(torchrun)["--rdzv-endpoint"] == "127.0.0.1:<port>"
    # Told its address and that it serves the store, so torchrun never looks up this host's own name.
    assert flags(torchrun)["--local-addr"] == "127.0.0.1" and flags(torchrun)["--rdzv-conf"] == "is_host=true"
    deepspeed = commands["deepspeed"][0][1]
    assert flags(deepspeed)["--node_rank"] == "0" and flags(deepspeed)["--master_addr"] == "127.0.0.1"
    assert list(cells["deepspeed"].files.values()) == ["localhost slots=32\n"]
    horovodrun = commands["horovodrun"][0][1]
    assert horovodrun[horovodrun.index("-H") + 1] == "localhost:32"
    assert all(not cell.cleanup for cell in cells.values())   # the marker sweep here is all it needs


def test_a_rendezvous_host_that_does_not_resolve_stops_the_rank_at_once_in_one_line():
    from harness.strategies.base import check_rendezvous_host

    check_rendezvous_host("127.0.0.1")
    check_rendezvous_host("localhost")
    with pytest.raises(RuntimeError) as error:
        check_rendezvous_host("parbench-nowhere.invalid")     # .invalid never resolves (RFC 6761)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and "MASTER_ADDR='parbench-nowhere.invalid'" in message


# ---- Slurm -----------------------------------------------------------------------------------------------

FAKE_SRUN = r"""#!/bin/bash
# srun as a job's nodes would run it, printing each node's command instead of running it
nodes=1
while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && nodes=${1#--nodes=}; shift; done
[[ $1 == bash && $2 == -c ]] || exit 3
for ((id = 0; id < nodes; id++)); do SLURM_NODEID=$id bash -c "set -- $3; printf 'node$id %s\n' \"\$@\""; done
"""


@pytest.fixture
def stand_in_slurm(tmp_path, monkeypatch):
    """scontrol and srun of a stand-in 4-node job (nodes n1..n4) first on PATH, where the job script's
    exported PATH (the harness's own, forwarded) finds them too."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'n1\\nn2\\nn3\\nn4\\n'\n")
    (fake / "srun").write_text(FAKE_SRUN)
    for tool in ("scontrol", "srun"):
        (fake / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-4]")


def run_job_script(script: str) -> dict[str, list[str]]:
    """Run a job script in the stand-in job: {node: argv} of what each node would run (the key "batch" for
    a command the script runs itself, on the job's first node)."""
    *body, last = script.rstrip("\n").split("\n")
    if not last.startswith("exec srun "):     # a launcher the script runs itself: print it instead
        last = last.replace("exec ", "set -- ", 1) + "; printf 'batch %s\\n' \"$@\""
    ran = subprocess.run(["bash", "-c", "\n".join([*body, last])], capture_output=True, text=True, check=True)
    argvs: dict[str, list[str]] = {}
    for line in ran.stdout.splitlines():
        node, _, word = line.partition(" ")
        argvs.setdefault(node, []).append(word)
    return argvs


@pytest.mark.launch
def test_slurm_submits_a_job_whose_script_starts_each_launcher_on_the_jobs_nodes(tmp_path, stand_in_slurm):
    results = tmp_path / "runs with a space" / "rows.jsonl"
    cells = planned(SlurmPlacement(nnodes=4), results)
    for launcher, cell in cells.items():
        [(target, sbatch)] = cell.commands
        assert sbatch[:2] == ["sbatch", "--wait"] and flags(sbatch)["--nodes"] == ("1" if launcher == "python" else "4")
        assert flags(sbatch)["--gpus-per-node"] == ("1" if launcher == "python" else "8")
        assert cell.cleanup == [("this host", ["scancel", "--name=parbench-<token>"])]
        [(job_file, script)] = [(path, text) for path, text in cell.files.items() if path.endswith("job.sh")]
        assert sbatch[-1] == job_file
        Path(job_file).parent.mkdir(parents=True)     # the cell folder, as run_cell leaves it before sbatch
    by_node = {launcher: run_job_script(cell.files[next(p for p in cell.files if p.endswith("job.sh"))])
               for launcher, cell in cells.items()}

    torchrun = by_node["torchrun"]
    assert sorted(torchrun) == ["node0", "node1", "node2", "node3"]
    endpoints = {flags(argv)["--rdzv-endpoint"] for argv in torchrun.values()}
    [endpoint] = endpoints                        # every node meets at the job's first node, on one port
    host, port = endpoint.split(":")
    assert host == "n1" and port.isdigit() and flags(torchrun["node3"])["--nnodes"] == "4"

    deepspeed = by_node["deepspeed"]
    assert [flags(deepspeed[f"node{i}"])["--node_rank"] for i in range(4)] == ["0", "1", "2", "3"]
    assert {flags(argv)["--master_addr"] for argv in deepspeed.values()} == {"n1"}
    assert flags(deepspeed["node0"])["--master_port"].isdigit()
    hostfile = Path(flags(deepspeed["node0"])["--hostfile"])
    assert hostfile.read_text() == "n1 slots=8\nn2 slots=8\nn3 slots=8\nn4 slots=8\n"   # written by the job
    assert "runs with a space" in str(hostfile) and deepspeed["node0"][-1] == str(hostfile.parent)

    horovodrun = by_node["horovodrun"]["batch"]      # from the batch script, on the first node, reaching the rest
    assert horovodrun[horovodrun.index("-H") + 1] == "n1:8,n2:8,n3:8,n4:8"
    assert by_node["python"]["node0"][1:3] == ["-m", "harness.rank.worker"]


# ---- rendezvous ports and launcher names ------------------------------------------------------------------

@pytest.mark.launch
def test_a_hostfile_rendezvous_port_is_probed_on_the_first_host_through_the_remote_shell(tmp_path):
    seen = tmp_path / "seen"
    # A remote shell that records which host it was asked to reach, then runs the command here.
    shell = f"sh -c 'echo {{host}} >> {seen}; exec sh -c \"$0\"'"
    placement = HostfilePlacement(hosts=(Host("first", 1), Host("second", 1)), remote_shell=shell, nnodes=2)
    port = placement.rendezvous_port(SPECS["torchrun"])
    assert port.isdigit() and 1024 <= int(port) < 65536 and seen.read_text() == "first\n"
    unreachable = HostfilePlacement(hosts=(Host("first", 1),), remote_shell="false {host}", nnodes=1)
    with pytest.raises(LaunchError, match="could not choose a rendezvous port on first"):
        unreachable.rendezvous_port(SPECS["torchrun"])


def test_a_local_rendezvous_port_is_free_here():
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", free_port()))       # raises if the port were taken


class _Mpirun(Strategy):
    name = "mpirun-toy"
    launcher = "mpirun"
    description = "a strategy naming a launcher nobody registered"

    def start(self, spec):
        raise AssertionError("never launched")

    def wrap(self, spec, context, workload, layers):
        raise AssertionError("never launched")


def test_a_strategy_naming_an_unknown_launcher_is_refused_when_it_registers():
    with pytest.raises(SpecError, match="names launcher 'mpirun'; known launchers: python, torchrun, horovodrun, "
                                        "deepspeed"):
        register({"mpirun-toy": _Mpirun()})
