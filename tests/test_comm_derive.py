"""Communication figures against hand arithmetic: nccl-tests' factors, wire bytes of DDP and ZeRO, the bytes
each precision recipe really moves, and exposed communication with its notes."""

import math
from pathlib import Path

import pytest

from harness.derive.comm import bus_bandwidth, comm_columns, wire_bytes
from harness.derive.exposed import SCHEMA_1_KIND, exposed_communication
from harness.spec import RunSpec
from harness.strategies import get_strategy
from harness.strategies.base import TrafficBytes
from harness.derive.cells import launch_table
from harness.derive.rows import load_rows
from workloads import get_workload

REFERENCE_ROWS = Path(__file__).parent.parent / "results" / "reference" / "ci-cpu" / "smoke.jsonl"


# ---- nccl-tests' factors (NVIDIA/nccl-tests src/*.cu *GetBw, doc/PERFORMANCE.md) --------------------------

@pytest.mark.parametrize("collective, ranks, factor", [
    ("all_reduce", 8, 1.75), ("all_reduce", 2, 1.0), ("all_gather", 2, 0.5), ("reduce_scatter", 4, 0.75),
    ("all_to_all", 4, 0.75), ("broadcast", 8, 1.0), ("reduce", 4, 1.0), ("send", 2, 1.0)])
def test_busbw_uses_nccl_tests_factors(collective, ranks, factor):
    algbw, busbw = bus_bandwidth(collective, 2e9, 0.5, ranks)
    assert algbw == 4e9
    assert math.isclose(busbw, 4e9 * factor)


def test_a_ring_all_reduce_sends_twice_what_an_all_gather_of_the_same_size_sends():
    # 8 ranks, 8 MB: all-reduce sends 2 * 7/8 * 8 MB = 14 MB per rank, all-gather 7/8 * 8 MB = 7 MB.
    assert wire_bytes("all_reduce", 8e6, 8) == 14e6
    assert wire_bytes("all_gather", 8e6, 8) == 7e6
    assert wire_bytes("all_reduce", 8e6, 1) == 0.0            # one rank: nothing on the wire


# ---- wire bytes per step: DDP vs ZeRO (Rajbhandari et al. 2020, sec. 7) ------------------------------------

P = 1_000_000          # parameters
FP32 = TrafficBytes(parameters=P, gradients_reduced=4 * P, parameters_gathered=4 * P)


def _row(strategy: str, ranks: int, counted: dict) -> dict:
    """Measurements as the worker writes them: each rank's counted collectives and the expected traffic."""
    expected = get_strategy(strategy).expected_collectives(
        data_parallel=ranks, micro_batches=1, options=get_strategy(strategy).resolve_options({}), traffic=FP32)
    return {"data_parallel": ranks, "comm_expected_per_step": expected.to_dict(),
            "comm_per_step_by_rank": [counted] * ranks}


def _counted(**sizes: float) -> dict:
    return {collective: {"bytes": size, "calls": 1.0} for collective, size in sizes.items()}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero_1_and_2_put_as_many_bytes_on_the_wire_as_ddp_and_zero_3_half_again(n):
    g = 4 * P                                 # fp32 gradients = fp32 weights = 4 MB
    ddp = 2 * (n - 1) / n * g                 # ring all-reduce of g
    zero12 = (n - 1) / n * g + (n - 1) / n * g   # reduce-scatter g + all-gather g = 2(n-1)/n g = DDP's
    zero3 = 2 * (n - 1) / n * g + (n - 1) / n * g  # two all-gathers (forward, backward) + reduce-scatter = 1.5 DDP
    assert zero12 == pytest.approx(ddp) and zero3 == pytest.approx(1.5 * ddp)

    # Counted as an ideal implementation issues them (sizes in nccl-tests' sense: every buffer is g).
    cases = {"ddp": (_counted(all_reduce=g), ddp),
             "zero1": (_counted(reduce_scatter=g, all_gather=g), zero12),
             "zero2": (_counted(reduce_scatter=g, all_gather=g), zero12),
             "zero3": (_counted(all_gather=2 * g, reduce_scatter=g), zero3)}
    for strategy, (counted, wire) in cases.items():
        columns = comm_columns(_row(strategy, n, counted))
        assert columns["comm_wire_bytes_per_step"] == pytest.approx(wire), strategy
        assert columns["comm_expected_wire_bytes_per_step"] == pytest.approx(wire), strategy
        assert columns["comm_wire_over_expected"] == pytest.approx(1.0)


def test_fsdp2_keeps_parameters_from_forward_to_backward_without_resharding():
    # 2 ranks, K = 2 micro-batches: gathers 2 * K (reshard) or K (no reshard) times, one reduce-scatter.
    fsdp2 = get_strategy("fsdp2")
    for reshard, gathers in ((True, 4), (False, 2)):
        expected = fsdp2.expected_collectives(data_parallel=2, micro_batches=2, traffic=FP32,
                                              options={"reshard_after_forward": reshard, "mixed_precision": "autocast"})
        row = {"data_parallel": 2, "comm_expected_per_step": expected.to_dict(), "comm_per_step_by_rank": [{}]}
        # all-gather: gathers x 4 MB x 1/2; reduce-scatter: 4 MB x 1/2.
        assert comm_columns(row)["comm_expected_wire_bytes_per_step"] == gathers * 2e6 + 2e6


def test_zero3_splits_its_gathers_where_a_row_measured_the_parameters_it_keeps_whole():
    # 10**6 parameters, 4 MB of fp32 weights, K = 4 micro-batches. None known kept whole: 2K = 8 gathers of
    # 4 MB. A quarter kept whole (1 MB): 8 gathers of the other 3 MB and one of that 1 MB, once a step.
    zero3 = get_strategy("zero3")
    options = zero3.resolve_options({})

    def gathers(kept):
        traffic = TrafficBytes(parameters=P, gradients_reduced=4 * P, parameters_gathered=4 * P,
                               parameters_kept_whole=kept)
        expected = zero3.expected_collectives(data_parallel=2, micro_batches=4, options=options, traffic=traffic)
        return sorted((c.size_bytes, c.calls) for c in expected.collectives if c.collective.value == "all_gather")

    assert gathers(0) == [(4 * P, 8)]
    assert gathers(P // 4) == [(P, 1), (3 * P, 8)]
    assert gathers(P) == [(4 * P, 1)]


def test_counted_bytes_split_by_group_size_use_each_groups_factor():
    # 3 MB all-reduced among 4 ranks (2 * 3/4 * 3 MB = 4.5 MB) and 1 MB among 2 ranks (2 * 1/2 * 1 MB = 1 MB);
    # 1 MB received from a pipeline neighbour is not sent by this rank.
    counted = {"all_reduce": {"bytes": 4e6, "calls": 2.0, "bytes_by_group_size": {"4": 3e6, "2": 1e6}},
               "recv": {"bytes": 1e6, "calls": 1.0, "bytes_by_group_size": {"8": 1e6}}}
    columns = comm_columns({"data_parallel": 8, "comm_per_step_by_rank": [counted]})
    assert columns["comm_all_reduce_wire_bytes_per_step"] == 5.5e6
    assert columns["comm_recv_wire_bytes_per_step"] == 1e6
    assert columns["comm_wire_bytes_per_step"] == 5.5e6
    assert columns["comm_expected_wire_bytes_per_step"] is None


def test_pipeline_says_its_traffic_is_not_modelled_and_why():
    expected = get_strategy("pipeline").expected_collectives(data_parallel=1, micro_batches=4, options={},
                                                             traffic=FP32)
    assert not expected.collectives and "activations" in expected.not_modelled_because


# ---- bytes the precision recipes really move (gpt-tiny) -----------------------------------------------------

def _gpt_tiny_counts() -> tuple[int, int]:
    # gpt-tiny: vocab 512, 64 tokens, 4 blocks of width 64 (workloads/gpt.py), head tied to the embedding.
    v, t, layers, d = 512, 64, 4, 64
    linear = layers * ((d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d))   # 198,912
    other = v * d + t * d + layers * 2 * (2 * d) + 2 * d                                          # 38,016
    return linear, other


def _expected(strategy: str, **spec_fields) -> dict:
    spec = RunSpec(workload="gpt-tiny", strategy=strategy, world_size=2, global_batch=8, micro_batch=4, **spec_fields)
    import torch

    torch.manual_seed(0)
    traffic = get_strategy(strategy).expected_traffic(spec, get_workload("gpt-tiny").build_layers())
    return {c.collective.value: c.size_bytes * c.calls for c in traffic.collectives}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_deepspeed_bf16_section_moves_half_the_bytes_of_fp32(strategy):
    linear, other = _gpt_tiny_counts()
    p = linear + other                                                   # 236,928
    fp32 = _expected(strategy, precision="fp32")
    bf16 = _expected(strategy, precision="bf16", options={"precision_recipe": "deepspeed-bf16"})
    assert sum(fp32.values()) == 4 * p * (2 if strategy != "zero3" else 3)   # K = 1
    assert bf16 == {collective: size // 2 for collective, size in fp32.items()}


def test_deepspeed_torch_autocast_reduces_linear_gradients_in_bf16_and_the_rest_in_fp32():
    # DeepSpeed 0.19.8 runtime/torch_autocast.py: parameters of exact nn.Linear/Conv modules get comm_dtype
    # bf16; the embeddings (also the tied head) and LayerNorms keep fp32.
    linear, other = _gpt_tiny_counts()
    gradients = 2 * linear + 4 * other                                   # 549,888 bytes
    assert _expected("zero2", precision="bf16") == {"reduce_scatter": gradients, "all_gather": 4 * (linear + other)}
    assert _expected("zero3", precision="bf16") == {"all_gather": 2 * gradients, "reduce_scatter": gradients}


def test_fsdp2_policy_gathers_bf16_and_reduces_fp32():
    linear, other = _gpt_tiny_counts()
    p = linear + other
    assert _expected("fsdp2", precision="bf16", options={"mixed_precision": "policy"}) == {
        "all_gather": 2 * 2 * p, "reduce_scatter": 4 * p}
    assert _expected("fsdp2", precision="bf16") == {"all_gather": 2 * 4 * p, "reduce_scatter": 4 * p}


# ---- exposed communication ----------------------------------------------------------------------------------

def _timed(real, compute, real_stalled=(), compute_stalled=None, kind="same work") -> dict:
    compute_stalled = compute_stalled or [[False] * len(compute[0])] * len(compute)
    return {"step_time_s": real, "host_stalled_step_indices": list(real_stalled), "compute_only_kind": kind,
            "compute_only_step_time_s_by_rank": compute, "compute_only_host_stalled_by_rank": compute_stalled}


def test_exposed_time_is_the_difference_of_unstalled_medians():
    # Real steps 100, 110, 900 (stalled), 104 ms -> median of 100, 104, 110 = 104 ms. Compute-only: slowest
    # rank per step 80, 86, 84 ms (step 3, stalled on rank 1, is dropped) -> median 84 ms. 20 ms, 20/104.
    m = _timed([0.100, 0.110, 0.900, 0.104], [[0.080, 0.070, 0.084, 0.086], [0.075, 0.086, 0.082, 0.500]],
               real_stalled=[2], compute_stalled=[[False] * 4, [False, False, False, True]])
    exposed = exposed_communication(m)
    assert exposed.exposed_comm_s == pytest.approx(0.020)
    assert exposed.exposed_comm_share == pytest.approx(0.020 / 0.104)
    assert exposed.note == "" and exposed.compute_only_kind == "same work"


def test_a_negative_share_is_kept_and_said_to_be_within_noise():
    # Real 100, 104, 102 ms (median 102, spread 4); compute-only 103, 101, 105 (median 103): -1 ms < 4 ms.
    exposed = exposed_communication(_timed([0.100, 0.104, 0.102], [[0.103, 0.101, 0.105]]))
    assert exposed.exposed_comm_s == pytest.approx(-0.001)
    assert exposed.exposed_comm_share == pytest.approx(-0.001 / 0.102)
    assert exposed.note.startswith("negative within noise")


def test_a_negative_share_beyond_the_spread_says_the_baseline_was_slower():
    # Real 100, 101, 102 ms; compute-only 120, 121, 122 ms: -20 ms against a 2 ms spread.
    exposed = exposed_communication(_timed([0.100, 0.101, 0.102], [[0.120, 0.121, 0.122]]))
    assert exposed.exposed_comm_share == pytest.approx(-0.020 / 0.101)
    assert exposed.note.startswith("negative beyond noise") and "baseline was slower" in exposed.note


def test_a_bound_baseline_keeps_its_label():
    kind = "bound: the real step runs the optimizer on the host"
    assert exposed_communication(_timed([0.2, 0.2], [[0.1, 0.1]], kind=kind)).compute_only_kind == kind


def test_reference_rows_of_schema_1_still_read_with_wire_bytes_and_their_stored_exposed_share():
    table = launch_table(load_rows([REFERENCE_ROWS]))
    ddp = table[table["strategy"] == "ddp"].iloc[0]
    # 236,928 fp32 gradients all-reduced among 2 ranks: 947,712 B size, 2 * 1/2 * 947,712 B on the wire.
    assert ddp["comm_all_reduce_bytes_per_step"] == 947_712
    assert ddp["comm_wire_bytes_per_step"] == 947_712
    assert ddp["exposed_comm_share"] == pytest.approx(-0.062003, abs=1e-6)
    assert ddp["compute_only_kind"] == SCHEMA_1_KIND and ddp["exposed_comm_note"].startswith("negative")


@pytest.mark.launch
def test_the_communication_figures_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, harness.derive.comm, harness.derive.exposed; "
            "print(sorted(m for m in ('torch', 'deepspeed', 'horovod', 'harness.strategies', 'workloads') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parent.parent)
    assert result.stdout.strip() == "[]"
