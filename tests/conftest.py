"""Shared test helpers. Tests marked `gpu` are skipped where no CUDA device is visible; tests not marked
`launch` may start no process (tests/launch_guard.py)."""

from __future__ import annotations

import pytest
import torch

from harness.matrix import EXPERT_PARALLEL, SEQUENCE_PARALLEL_STRATEGIES
from harness.strategies import STRATEGIES
from launch_budget import LaunchBudget, add_options
from launch_guard import LaunchGuard
import launch_streams
from launch_streams import Stream, StreamBank


def pytest_addoption(parser):
    add_options(parser)


def pytest_configure(config):
    guard = LaunchGuard()
    guard.install()
    config.pluginmanager.register(guard, "launch-guard")
    # Registered here, not in pyproject.toml: that file is an input of the image's dependency layer (Dockerfile).
    config.addinivalue_line("markers", "core: the launch `make test` makes (tests/test_core_launch.py): each launcher "
                                       "once, end to end; every other launch test runs in CI's budgeted launch tier")
    streams = {fixture: [stream.name for stream in read] for fixture, read in STREAMS_READ_BY.items()}
    config.pluginmanager.register(LaunchBudget(config, streams), "launch-budget")


def pytest_unconfigure(config):
    guard = config.pluginmanager.get_plugin("launch-guard")
    if guard is not None:
        guard.uninstall()


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items if "matrix" not in item.keywords
                and set(item.fixturenames) & set(MATRIX_FIXTURES)]
    if unmarked:    # it would launch the matrix tier's streams in `make test`
        raise pytest.UsageError(f"mark `matrix` the tests that read {', '.join(MATRIX_FIXTURES)}: "
                                f"{', '.join(unmarked)}")
    # The first test to read the shared streams launches every one the session reads (StreamBank), in its own time:
    # pytest's 600 s (pyproject.toml) bounds one test, not that. Each launch is bounded by its own --timeout
    # (launch_streams.COMMON), so a hang still ends; the first demand of the matrix tier ran past 600 s on a 2-core
    # VM whose unit tier took 257 s at the base commit.
    # So do the modules that launch streams of their own (the fault-tolerance matrix's 21 cells took 5 min 52 s on a
    # day this VM ran the unit tier in 50 s, and past pytest's 600 s on one it took 269 s).
    for item in items:
        if set(item.fixturenames) & set(STREAMS_READ_BY) or _launches_streams(item):
            item.add_marker(pytest.mark.timeout(STREAM_BANK_TIMEOUT_S))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _launches_streams(item) -> bool:
    """Whether the test's module launches streams of cells itself (launch_streams.run_streams)."""
    module = getattr(item, "module", None)
    return module is not None and vars(module).get("run_streams") is launch_streams.run_streams


# ---- cells launched once per session and shared by the modules that judge them, two streams at a time
# (tests/launch_streams.py: the steps and cores they run with). A fixture below names the streams it reads;
# the first fixture asked for launches every stream that any selected test will read, so that the streams
# of `make test` and of `make test-matrix` each launch together, and neither launches the other's. --------


def _fp32(name: str, workload: str, strategies: tuple[str, ...]) -> Stream:
    return Stream(name, ("--workload", workload, "--world-sizes", "2", "--strategy", ",".join(strategies)))


# The strategies the shared streams run: all but ps-async, whose losses are never the plain loop's and whose own
# launches are in tests/test_parameter_server_async.py, the bare loop, which measures nothing those streams judge
# (tests/test_bare_loop.py launches its own), and expert parallelism, which shards an MoE model's experts and skips
# these dense workloads (tests/test_moe_cells.py launches the moe matrix).
SHARED = tuple(s for s in STRATEGIES if s not in ("ps-async", "bare", *EXPERT_PARALLEL, *SEQUENCE_PARALLEL_STRATEGIES))

# Every strategy at 2 ranks on gpt-tiny in fp32, and the plain loop: the ci matrix's cells. Two streams of about
# the same length (measured one at a time: the three ZeRO stages 16-17 s a launch, the pipeline 12 s, the rest
# 2-14 s), launched side by side.
DEEPSPEED_BUT_AUTOTP = ("zero1", "zero2", "zero3", "pipeline")
GPT_TINY = (_fp32("gpt-tiny", "gpt-tiny", tuple(s for s in SHARED if s not in DEEPSPEED_BUT_AUTOTP)),
            _fp32("gpt-tiny-deepspeed", "gpt-tiny", DEEPSPEED_BUT_AUTOTP))
# llama-tiny's cells of the ci matrix (harness.matrix.CI_CELLS_OF): the plain loop, FSDP2 and tp at 2 ranks in fp32.
LLAMA_TINY = _fp32("llama-tiny", "llama-tiny", ("plain", "fsdp2", "tp"))
# ResNet-20's smoke cells (the plain loop, DDP), and its other strategies.
RESNET_SMOKE = _fp32("resnet20-cifar-smoke", "resnet20-cifar", ("plain", "ddp"))
RESNET = (RESNET_SMOKE, _fp32("resnet20-cifar", "resnet20-cifar",
                              tuple(s for s in SHARED if s not in ("plain", "ddp"))))
HYBRID = Stream("hybrid", ("--workload", "gpt-tiny", "--world-sizes", "4", "--warmup-steps", "1",
                           "--strategy", "plain,fsdp2-tp,autotp,pipeline"))

# Activation checkpointing (harness.strategies.checkpointing) on gpt-tiny in fp32: every strategy at 2 ranks and
# the plain loop with every block checkpointed, and the plain loop with one block in two.
CHECKPOINTED = Stream("checkpointed", ("--workload", "gpt-tiny", "--world-sizes", "2", "--strategy", ",".join(SHARED),
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


def _bf16(name: str, strategies: tuple[str, ...]) -> Stream:
    return Stream(name, ("--workload", "gpt-tiny", "--world-sizes", "2", "--precision", "bf16",
                         "--strategy", ",".join(strategies)))


# Every strategy at 2 ranks on gpt-tiny in bf16, with the plain loop at 1 (World size 1 in bf16, 7 more launches,
# was dropped to keep the suite's time: a wrapper's arithmetic at 1 rank is what it does at 2, without the
# reduction); two DeepSpeed strategies in the first stream, two in the second, to even them out.
BF16_FIRST, BF16_SPLIT = ("plain", "dataparallel", "ddp", "zero2", "zero3"), ("tp", "autotp")
BF16 = (_bf16("bf16-0", BF16_FIRST),
        _bf16("bf16-1", tuple(s for s in SHARED if s not in BF16_FIRST + BF16_SPLIT + ("fsdp2-tp",))),
        _bf16("bf16-2", BF16_SPLIT))

# ZeRO-Offload on gpt-tiny at 2 ranks in fp32 (DeepSpeed's CPU Adam; its first launch on a machine JIT-builds the op,
# 41 s here): every stage with offload_optimizer, and ZeRO-3 with offload_param too (tests/test_offload.py).
ZERO_OFFLOAD = (Stream("zero-offload-optimizer", ("--workload", "gpt-tiny", "--world-sizes", "2", "--strategy",
                                                  "zero1,zero2,zero3", "--option", "offload_optimizer=cpu")),
                Stream("zero-offload-param", ("--workload", "gpt-tiny", "--world-sizes", "2", "--strategy", "zero3",
                                              "--option", "offload_optimizer=cpu", "--option", "offload_param=cpu")))

# torch.compile of each block (harness.strategies.compiling) on gpt-tiny in fp32: the plain loop, DDP and FSDP2 at 2
# ranks, each judged against the compiled plain loop (tests/test_compile.py).
COMPILED = Stream("compiled", ("--workload", "gpt-tiny", "--world-sizes", "2", "--strategy", "plain,ddp,fsdp2",
                               "--option", "compile=true"))

# What each fixture reads, and the order streams launch in: the longest first.
STREAMS_READ_BY = {"gpt_tiny_fp32": GPT_TINY, "llama_tiny_fp32": (LLAMA_TINY,), "resnet_smoke_fp32": (RESNET_SMOKE,), "resnet_fp32": RESNET,
                   "hybrid_rows": (HYBRID,), "checkpointed_rows": (GPT_TINY[0], CHECKPOINTED, CHECKPOINTED_EVERY_2),
                   "bf16_rows": BF16, "split_tp_rows": (GPT_TINY[0], SEQUENCE_PARALLEL, LOSS_PARALLEL, BF16[0],
                                                         BOTH_IN_BF16),
                   "offload_rows": (GPT_TINY[0], *ZERO_OFFLOAD), "compiled_rows": (COMPILED,)}
# A test reading the shared streams may launch them all (pytest_collection_modifyitems): its limit, seconds.
STREAM_BANK_TIMEOUT_S = 3600
# The fixtures only tests marked `matrix` may read (`make test-matrix`).
MATRIX_FIXTURES = ("resnet_fp32", "hybrid_rows", "checkpointed_rows", "bf16_rows", "split_tp_rows", "offload_rows",
                   "compiled_rows")
LONGEST_FIRST = (CHECKPOINTED, GPT_TINY[1], GPT_TINY[0], RESNET[1], HYBRID, *BF16, ZERO_OFFLOAD[0], LLAMA_TINY,
                 RESNET_SMOKE,
                 COMPILED, SEQUENCE_PARALLEL, LOSS_PARALLEL, CHECKPOINTED_EVERY_2, BOTH_IN_BF16, ZERO_OFFLOAD[1])


@pytest.fixture(scope="session")
def stream_bank(request, tmp_path_factory):
    """The shared streams, each launched once, the first time a fixture reads any: with every other stream the
    session's selected tests read."""
    wanted = {stream.name for item in request.session.items for fixture, streams in STREAMS_READ_BY.items()
              if fixture in item.fixturenames for stream in streams}
    return StreamBank(tmp_path_factory.mktemp("streams"), [s for s in LONGEST_FIRST if s.name in wanted])


def _by_strategy(rows) -> dict:
    return {row.spec.strategy: row for row in rows}


@pytest.fixture(scope="session")
def gpt_tiny_fp32(stream_bank):
    """Every strategy at world size 2 on gpt-tiny in fp32, and the plain loop: real rows, {strategy: RunResult}
    (tests/test_strategies_cpu.py; the no-fault rows of tests/test_parity_faults.py; the smoke matrix's cells
    in tests/test_ddp_cpu.py; the model-state census of tests/test_memory.py). DataParallel's row is skipped
    on CPU."""
    return _by_strategy(stream_bank.rows(*GPT_TINY))


@pytest.fixture(scope="session")
def llama_tiny_fp32(stream_bank):
    """The plain loop, FSDP2 and tp at world size 2 on llama-tiny in fp32, the ci matrix's llama cells: real rows,
    {strategy: RunResult} (tests/test_llama.py)."""
    return _by_strategy(stream_bank.rows(LLAMA_TINY))


@pytest.fixture(scope="session")
def resnet_smoke_fp32(stream_bank):
    """The plain loop and DDP at world size 2 on resnet20-cifar in fp32: {strategy: RunResult}."""
    return _by_strategy(stream_bank.rows(RESNET_SMOKE))


@pytest.fixture(scope="session")
def resnet_fp32(stream_bank):
    """Every strategy at world size 2 on resnet20-cifar in fp32, and the plain loop: {strategy: RunResult}; the
    transformer-only strategies' rows are skipped."""
    return _by_strategy(stream_bank.rows(*RESNET))


@pytest.fixture(scope="session")
def bf16_rows(stream_bank):
    """Every strategy at world size 2 on gpt-tiny in bf16 (`fsdp2-tp` not: at 2 ranks it is `tp` with FSDP2 over one
    rank, and its 2-D bf16 cells are the hybrid matrix's), and the plain loop: real rows,
    {(strategy, world_size): RunResult} (tests/test_strategies_cpu.py; the no-fault rows of
    tests/test_parity_faults.py; ZeRO-2's reductions in tests/test_comm_zero_cpu.py)."""
    return {(row.spec.strategy, row.spec.world_size): row for row in stream_bank.rows(*BF16)}


@pytest.fixture(scope="session")
def split_tp_rows(stream_bank):
    """tp at 2 ranks on gpt-tiny with sequence parallelism, with loss parallelism (fp32) and with both (bf16), each
    after the plain loop at its global batch and precision: {stream name: [plain row, tp row]}
    (tests/test_sequence_parallel.py)."""
    plain = {precision: next(r for r in stream_bank.rows(stream) if r.spec.strategy == "plain")
             for precision, stream in (("fp32", GPT_TINY[0]), ("bf16", BF16[0]))}
    return {SEQUENCE_PARALLEL.name: [plain["fp32"], *stream_bank.rows(SEQUENCE_PARALLEL)],
            LOSS_PARALLEL.name: [plain["fp32"], *stream_bank.rows(LOSS_PARALLEL)],
            BOTH_IN_BF16.name: [plain["bf16"], *stream_bank.rows(BOTH_IN_BF16)]}


@pytest.fixture(scope="session")
def checkpointed_rows(stream_bank):
    """gpt-tiny in fp32 with activation checkpointing, and the plain loop without it, at the same global batch (16)
    and steps: {(strategy, its `activation_checkpointing`): RunResult} (tests/test_checkpointing.py)."""
    plain = next(r for r in stream_bank.rows(GPT_TINY[0]) if r.spec.strategy == "plain")
    rows = [plain, *stream_bank.rows(CHECKPOINTED, CHECKPOINTED_EVERY_2)]
    return {(row.spec.strategy, row.spec.options_dict.get("activation_checkpointing", "none")): row for row in rows}


@pytest.fixture(scope="session")
def hybrid_rows(stream_bank):
    """The model-parallel layouts that need four ranks on gpt-tiny in fp32, and the plain loop at their global
    batch (32): fsdp2-tp and autotp at dp 2 x tp 2, the pipeline at 2 stages x 2 replicas; one warm-up step (the
    one that counts DTensor's collectives) and three timed, the four steps parity compares. Real rows,
    {strategy: RunResult} (tests/test_hybrid.py, tests/test_pipeline_traffic.py)."""
    return _by_strategy(stream_bank.rows(HYBRID))


@pytest.fixture(scope="session")
def offload_rows(stream_bank):
    """ZeRO-Offload at 2 ranks on gpt-tiny in fp32 after the plain loop at its global batch: [plain row, then each
    offload cell's row] (tests/test_offload.py)."""
    plain = next(r for r in stream_bank.rows(GPT_TINY[0]) if r.spec.strategy == "plain")
    return [plain, *stream_bank.rows(*ZERO_OFFLOAD)]


@pytest.fixture(scope="session")
def compiled_rows(stream_bank):
    """The plain loop, DDP and FSDP2 on gpt-tiny in fp32 with every block compiled (`compile=true`), the plain loop at
    1 rank and the others at 2: {strategy: RunResult} (tests/test_compile.py)."""
    return _by_strategy(stream_bank.rows(COMPILED))
