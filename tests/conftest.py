"""Shared test helpers. Tests marked `gpu` are skipped where no CUDA device is visible; tests not marked
`launch` may start no process (tests/launch_guard.py)."""

from __future__ import annotations

import pytest
import torch

from launch_guard import LaunchGuard


def pytest_configure(config):
    guard = LaunchGuard()
    guard.install()
    config.pluginmanager.register(guard, "launch-guard")


def pytest_unconfigure(config):
    guard = config.pluginmanager.get_plugin("launch-guard")
    if guard is not None:
        guard.uninstall()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- cells launched once per session and shared by the modules that judge them -------------------------

# Five steps: the four parity compares (harness.derive.parity.PARITY_STEPS) and a second warm-up step, in which
# the model-state census is read (it needs the optimizer's state, made by the first step's update), so that
# tests/test_memory.py judges these rows too; three timed steps, so that a timed step the host stalled
# (harness.rank.timing) still leaves others for tests/test_ddp_cpu.py's figures.
PARITY_OVERRIDES = (("warmup_steps", 2), ("timed_steps", 3))


@pytest.fixture(scope="session")
def fp32_rows(tmp_path_factory):
    """Every strategy at world size 2 on both tiny workloads in fp32, and the plain loop: real rows,
    {(workload, strategy): RunResult} (tests/test_strategies_cpu.py; the no-fault rows of
    tests/test_parity_faults.py; the smoke matrix's cells in tests/test_ddp_cpu.py; the model-state census
    of tests/test_memory.py)."""
    from harness.matrix import Machine, Selection, build_matrix
    from harness.record import read_results
    from harness.runner import RunOptions, run_specs
    from harness.spec import DeviceKind

    out = tmp_path_factory.mktemp("fp32") / "rows.jsonl"
    specs = build_matrix("full", Machine(device=DeviceKind.CPU, devices_per_node=2),
                         Selection(workloads=("resnet20-cifar", "gpt-tiny"), world_sizes=(2,),
                                   overrides=PARITY_OVERRIDES))   # every strategy, DataParallel skipped
    run_specs(specs, RunOptions(results=out, timeout_s=300))
    return {(row.spec.workload, row.spec.strategy): row for row in read_results([out])}


@pytest.fixture(scope="session")
def bf16_rows(tmp_path_factory):
    """Every strategy at world sizes 1 and 2 on gpt-tiny in bf16, and the plain loop: real rows,
    {(strategy, world_size): RunResult} (tests/test_strategies_cpu.py; the no-fault rows of
    tests/test_parity_faults.py; ZeRO-2's reductions in tests/test_comm_zero_cpu.py)."""
    from harness.matrix import Machine, Selection, build_matrix
    from harness.record import read_results
    from harness.runner import RunOptions, run_specs
    from harness.spec import DeviceKind

    out = tmp_path_factory.mktemp("bf16") / "rows.jsonl"
    specs = build_matrix("full", Machine(device=DeviceKind.CPU, devices_per_node=2),
                         Selection(workloads=("gpt-tiny",), world_sizes=(1, 2),
                                   overrides=(*PARITY_OVERRIDES, ("precision", "bf16"))))
    run_specs(specs, RunOptions(results=out, timeout_s=300))
    return {(row.spec.strategy, row.spec.world_size): row for row in read_results([out])}
