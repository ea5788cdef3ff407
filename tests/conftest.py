"""Shared test helpers. Tests marked `gpu` are skipped where no CUDA device is visible; tests not marked
`launch` may start no process (tests/launch_guard.py)."""

from __future__ import annotations

import pytest
import torch

from launch_guard import LaunchGuard
from launch_streams import Stream, run_streams


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


# ---- cells launched once per session and shared by the modules that judge them, two streams at a time
# (tests/launch_streams.py: the steps and cores they run with) ---------------------------------------------


@pytest.fixture(scope="session")
def fp32_streams(tmp_path_factory):
    """The fp32 cells of `fp32_rows` and `hybrid_rows`, launched together: three streams, two at a time, keep
    both cores busier than the 4-rank stream alone would."""
    streams = [Stream(workload, ("--workload", workload, "--world-sizes", "2"))   # with the plain loop
               for workload in ("resnet20-cifar", "gpt-tiny")]
    streams.append(Stream("hybrid", ("--workload", "gpt-tiny", "--world-sizes", "4", "--warmup-steps", "1",
                                     "--strategy", "plain,fsdp2-tp,autotp,pipeline")))
    streams += [CHECKPOINTED, SEQUENCE_PARALLEL, LOSS_PARALLEL, CHECKPOINTED_EVERY_2]
    return run_streams(tmp_path_factory.mktemp("fp32"), streams)


# Activation checkpointing (harness.strategies.checkpointing) on gpt-tiny in fp32: every strategy at 2 ranks and
# the plain loop with every block checkpointed, and the plain loop with one block in two.
CHECKPOINTED = Stream("checkpointed", ("--workload", "gpt-tiny", "--world-sizes", "2",
                                       "--option", "activation_checkpointing=blocks"))
CHECKPOINTED_EVERY_2 = Stream("checkpointed-every-2", ("--workload", "gpt-tiny", "--world-sizes", "2", "--strategy",
                                                       "plain", "--option", "activation_checkpointing=every:2"))


# tp with sequence or loss parallelism (fp32), or both (bf16), on gpt-tiny at 2 ranks, each judged against the
# plain loop of its precision's streams.
TP_AT_2 = ("--workload", "gpt-tiny", "--world-sizes", "2", "--strategy", "tp")
SEQUENCE_PARALLEL = Stream("sequence-parallel", (*TP_AT_2, "--option", "sequence_parallel=true"))
LOSS_PARALLEL = Stream("loss-parallel", (*TP_AT_2, "--option", "loss_parallel=true"))
BOTH_IN_BF16 = Stream("bf16-sequence-and-loss-parallel", (*TP_AT_2, "--option", "sequence_parallel=true", "--option",
                                                         "loss_parallel=true", "--precision", "bf16"))


@pytest.fixture(scope="session")
def fp32_rows(fp32_streams):
    """Every strategy at world size 2 on both tiny workloads in fp32, and the plain loop: real rows,
    {(workload, strategy): RunResult} (tests/test_strategies_cpu.py; the no-fault rows of
    tests/test_parity_faults.py; the smoke matrix's cells in tests/test_ddp_cpu.py; the model-state census
    of tests/test_memory.py). DataParallel's rows are skipped on CPU."""
    return {(row.spec.workload, row.spec.strategy): row for name in ("resnet20-cifar", "gpt-tiny")
            for row in fp32_streams[name]}


@pytest.fixture(scope="session")
def bf16_streams(tmp_path_factory):
    """The bf16 cells of `bf16_rows` and `split_tp_rows`, four streams two at a time."""
    from harness.strategies import STRATEGIES

    # At 2 ranks, where the strategies communicate, with the plain loop at 1; two DeepSpeed strategies in the first
    # stream, two in the second, to even them out. (World size 1 in bf16, 7 more launches, was dropped to keep the
    # suite's time: a wrapper's arithmetic at 1 rank is what it does at 2, without the reduction.)
    first = ("plain", "dataparallel", "ddp", "zero2", "zero3")
    split = ("tp", "autotp")
    second = tuple(name for name in STRATEGIES if name not in first + split + ("fsdp2-tp",))
    streams = [Stream(f"bf16-{n}", ("--workload", "gpt-tiny", "--world-sizes", "2", "--precision", "bf16",
                                    "--strategy", ",".join(names)))
               for n, names in enumerate((first, second, split))]
    streams.append(BOTH_IN_BF16)
    return run_streams(tmp_path_factory.mktemp("bf16"), streams)


@pytest.fixture(scope="session")
def bf16_rows(bf16_streams):
    """Every strategy at world size 2 on gpt-tiny in bf16 (`fsdp2-tp` not: at 2 ranks it is `tp` with FSDP2 over one
    rank, and its 2-D bf16 cells are the hybrid matrix's), and the plain loop: real rows,
    {(strategy, world_size): RunResult} (tests/test_strategies_cpu.py; the no-fault rows of
    tests/test_parity_faults.py; ZeRO-2's reductions in tests/test_comm_zero_cpu.py)."""
    return {(row.spec.strategy, row.spec.world_size): row for name, stream in bf16_streams.items()
            if name != BOTH_IN_BF16.name for row in stream}


@pytest.fixture(scope="session")
def split_tp_rows(fp32_streams, bf16_streams):
    """tp at 2 ranks on gpt-tiny with sequence parallelism, with loss parallelism (fp32) and with both (bf16), each
    after the plain loop at its global batch and precision: {stream name: [plain row, tp row]}
    (tests/test_sequence_parallel.py)."""
    plain = {"fp32": next(r for r in fp32_streams["gpt-tiny"] if r.spec.strategy == "plain"),
             "bf16": next(r for r in bf16_streams["bf16-0"] if r.spec.strategy == "plain")}
    return {SEQUENCE_PARALLEL.name: [plain["fp32"], *fp32_streams[SEQUENCE_PARALLEL.name]],
            LOSS_PARALLEL.name: [plain["fp32"], *fp32_streams[LOSS_PARALLEL.name]],
            BOTH_IN_BF16.name: [plain["bf16"], *bf16_streams[BOTH_IN_BF16.name]]}


@pytest.fixture(scope="session")
def checkpointed_rows(fp32_streams):
    """gpt-tiny in fp32 with activation checkpointing, and the plain loop without it, at the same global batch (16)
    and steps: {(strategy, its `activation_checkpointing`): RunResult} (tests/test_checkpointing.py)."""
    plain = next(r for r in fp32_streams["gpt-tiny"] if r.spec.strategy == "plain")
    rows = [plain, *fp32_streams[CHECKPOINTED.name], *fp32_streams[CHECKPOINTED_EVERY_2.name]]
    return {(row.spec.strategy, row.spec.options_dict.get("activation_checkpointing", "none")): row for row in rows}


@pytest.fixture(scope="session")
def hybrid_rows(fp32_streams):
    """The model-parallel layouts that need four ranks on gpt-tiny in fp32, and the plain loop at their global
    batch (32): fsdp2-tp and autotp at dp 2 x tp 2, the pipeline at 2 stages x 2 replicas; one warm-up step (the
    one that counts DTensor's collectives) and three timed, the four steps parity compares. Real rows,
    {strategy: RunResult} (tests/test_hybrid.py, tests/test_pipeline_traffic.py)."""
    return {row.spec.strategy: row for row in fp32_streams["hybrid"]}
