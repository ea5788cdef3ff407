"""The machine a run plans for: described with --gpus-per-node/--cpus-per-node/--nnodes, checked against
this host unless --dry-run, and the one-line warning when CPU ranks outnumber a node's cores. This host's
GPUs and cores are replaced by stand-ins here, so nothing depends on where the tests run; nothing launches."""

import pytest

from harness import machine as machine_module
from harness.cli import build_parser, main
from harness.cli.run import plan_run
from harness.machine import Machine
from harness.spec import DeviceKind


@pytest.fixture
def host(monkeypatch):
    """This host as the test says: GPUs visible and CPU cores."""
    def set_host(gpus: int, cores: int) -> None:
        monkeypatch.setattr(machine_module, "visible_gpus", lambda: gpus)
        monkeypatch.setattr(machine_module, "host_cores", lambda: cores)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return set_host


def run_cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def test_a_dry_run_plans_for_gpus_this_host_does_not_have(host):
    host(gpus=0, cores=2)
    machine = Machine.requested("cuda", gpus_per_node=8, nodes=4, dry_run=True)
    assert machine == Machine(device=DeviceKind.CUDA, devices_per_node=8, nodes=4)
    assert machine.devices == 32
    # --gpus-per-node alone says cuda
    assert Machine.requested(None, gpus_per_node=8, dry_run=True).device is DeviceKind.CUDA


def test_a_dry_run_cli_plans_an_8_gpu_node_on_a_host_without_gpus(host, capsys):
    host(gpus=0, cores=2)
    code, out, err = run_cli(capsys, "run", "--matrix", "full", "--device", "cuda", "--gpus-per-node", "8",
                             "--dry-run")
    assert code == 0 and err == []
    for label in ("resnet50/ddp/ws8/gb2048/mb256/bf16/cuda", "gpt2-small/dataparallel/ws8/gb128/mb16/bf16/cuda"):
        assert label in out


def test_without_a_dry_run_the_machine_must_be_here(host):
    host(gpus=0, cores=2)
    assert Machine.requested("cpu", cpus_per_node=2) == Machine(device=DeviceKind.CPU, devices_per_node=2)
    assert Machine.requested("cpu", cpus_per_node=1) == Machine(device=DeviceKind.CPU, devices_per_node=1)
    assert Machine.requested(None) == Machine(device=DeviceKind.CPU, devices_per_node=2)
    host(gpus=4, cores=16)
    assert Machine.requested(None, nodes=2) == Machine(device=DeviceKind.CUDA, devices_per_node=4, nodes=2)
    assert Machine.requested("cuda", gpus_per_node=2).devices_per_node == 2


@pytest.mark.parametrize("gpus, cores, args, fragment", [
    (0, 2, ["--device", "cuda"], "device cuda requested but no CUDA device is visible"),
    (0, 2, ["--gpus-per-node", "8"], "device cuda requested but no CUDA device is visible"),
    (1, 16, ["--device", "cuda", "--gpus-per-node", "8"], "--gpus-per-node 8 but this host has 1 GPU(s) visible; "
                                                          "allowed: 1..1"),
    (0, 2, ["--device", "cpu", "--cpus-per-node", "64"], "--cpus-per-node 64 but this host has 2 CPU core(s); "
                                                         "allowed: 1..2"),
    (0, 2, ["--device", "cpu", "--gpus-per-node", "2"], "--gpus-per-node goes with --device cuda"),
    (1, 2, ["--device", "cuda", "--cpus-per-node", "2"], "--cpus-per-node goes with --device cpu"),
    (0, 2, ["--gpus-per-node", "2", "--cpus-per-node", "2"], "exclude each other"),
    (0, 2, ["--cpus-per-node", "0", "--dry-run"], "--cpus-per-node must be >= 1, got 0"),
    (0, 2, ["--device", "cuda", "--dry-run"], "needs --gpus-per-node N"),
])
def test_devices_that_are_not_there_are_one_line_errors(host, capsys, tmp_path, monkeypatch, gpus, cores, args,
                                                        fragment):
    host(gpus=gpus, cores=cores)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "run", "--matrix", "smoke", *args)
    assert code == 2 and len(err) == 1 and err[0].startswith("parbench: error: ")
    assert fragment in err[0]
    assert not any(tmp_path.iterdir())          # nothing launched, nothing written


def test_two_cpu_ranks_on_one_core_warn_in_one_line_before_launch(host, capsys):
    host(gpus=0, cores=1)
    args = build_parser().parse_args(["run", "--matrix", "smoke", "--device", "cpu"])
    specs, _ = plan_run(args)                       # planning only: what a real run does before launching
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert [s.world_size for s in specs] == [1, 2]
    assert err == ["parbench: warning: 1 CPU cell(s) run more rank threads on a node than its 1 core(s), up to 2 "
                   "(gpt-tiny/ddp/ws2/gb16/mb4/fp32/cpu: 2 rank(s) per node x 1 thread(s)); their step times "
                   "measure the sharing of the cores, not the strategy"]


def test_ranks_that_fit_the_cores_do_not_warn(host, capsys):
    host(gpus=0, cores=2)
    code, _, err = run_cli(capsys, "run", "--matrix", "wide", "--device", "cpu", "--cpus-per-node", "2",
                           "--dry-run")
    # Every cell of 2 ranks fits; ps-async's 2 workers and its server (3 ranks, one cell a workload: ResNet-20,
    # gpt-tiny, llama-tiny) do not.
    assert code == 0 and err == [
        "parbench: warning: 3 CPU cell(s) run more rank threads on a node than its 2 core(s), up to 3 "
        "(resnet20-cifar/ps-async/ws3/gb16/mb4/fp32/cpu: 3 rank(s) per node x 1 thread(s)); their step times "
        "measure the sharing of the cores, not the strategy"]
    code, _, err = run_cli(capsys, "run", "--matrix", "full", "--device", "cpu", "--cpus-per-node", "2",
                           "--strategy", "plain,ddp,ps", "--dry-run")
    assert code == 0 and err == []


def test_threads_per_rank_count_toward_the_cores(host, capsys, monkeypatch):
    # 2 ranks x 2 threads (OMP_NUM_THREADS, which the harness passes on to every rank) on 2 cores; the plain
    # loop's 1 x 2 fits.
    host(gpus=0, cores=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    code, _, err = run_cli(capsys, "run", "--matrix", "smoke", "--device", "cpu", "--dry-run")
    assert code == 0 and len(err) == 1
    assert err[0].startswith("parbench: warning: 1 CPU cell(s) run more rank threads on a node than its 2 core(s), "
                             "up to 4 (gpt-tiny/ddp/ws2/")


def test_ranks_spread_over_nodes_count_per_node(host):
    from harness.machine import oversubscription_warning
    from harness.matrix import build_matrix

    machine = Machine(device=DeviceKind.CPU, devices_per_node=2, nodes=2)
    specs = [spec.replace(nnodes=2) if spec.world_size % 2 == 0 else spec for spec in build_matrix("full", machine)]
    assert max(spec.world_size for spec in specs) == 4
    assert oversubscription_warning(specs, machine, lambda spec: 1) is None          # 2 ranks per node on 2 cores
    assert "up to 4" in oversubscription_warning(specs, machine, lambda spec: 2)     # 2 x 2 threads per node


def test_gpu_cells_never_warn_about_cpu_cores(host):
    from harness.machine import oversubscription_warning
    from harness.matrix import build_matrix

    machine = Machine(device=DeviceKind.CUDA, devices_per_node=8)
    assert oversubscription_warning(build_matrix("full", machine), machine, lambda spec: 64) is None
