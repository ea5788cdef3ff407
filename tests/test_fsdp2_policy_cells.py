"""FSDP2's MixedPrecisionPolicy, the recipe its users run (harness.matrix USERS_RECIPES: bf16 parameters gathered for
compute, gradients reduced in fp32), in the matrices. On CPU the full matrix runs it in bf16 at world sizes 1 and 2 on
the transformers, beside the plain loop in bf16, its parity reference (ResNet-20's BatchNorm refuses it); on GPUs every
16-bit FSDP2 cell of a transformer runs it, autocast kept beside it at FSDP2's smallest world size in full; the user's
--option mixed_precision wins over both.

The launching tests run the full matrix's policy cell at 2 ranks on gpt-tiny with the plain loop in bf16, and the same
cell with one rank's micro-batch left out (harness.rank.faults), at tests/conftest.py's steps:

    .venv/bin/python -m pytest tests/test_fsdp2_policy_cells.py -m matrix
"""

from __future__ import annotations

import pytest

from harness.derive.comm import comm_columns
from harness.derive.parity import Quantity, Verdict, arithmetic, judge, reference_key
from harness.matrix import MATRICES, Machine, Selection, build_matrix
from harness.rank.faults import FAULT_ENV
from harness.spec import DeviceKind, Status
from launch_streams import Stream, run_streams
from workloads import get_workload
from workloads.base import Family

POLICY = {"mixed_precision": "policy"}
TRANSFORMERS = ("gpt-tiny", "llama-tiny")
CPU_2 = Machine(device=DeviceKind.CPU, devices_per_node=2)
GPU_SHAPES = [Machine(device=DeviceKind.CUDA, devices_per_node=gpus, nodes=nodes)
              for gpus in (1, 8) for nodes in (1, 2)]
# The matrices that run FSDP2 in bf16 or fp16 on GPUs, written out: every other runs it in fp32 (smoke, ci) or not at
# all (parameter-server).
SIXTEEN_BIT_FSDP2_MATRICES = {"full", "wide", "scaling", "zero-memory", "hybrid", "memory-techniques", "fault-tolerance",
                              "reference", "moe", "long-context"}
# Where the autocast variant is kept beside the policy, at FSDP2's smallest world size.
AUTOCAST_VARIANT_MATRICES = {"full", "wide"}


def shape_id(machine: Machine) -> str:
    return f"{machine.device.value}-{machine.devices_per_node}x{machine.nodes}"


def sixteen_bit(specs, strategy: str, workload: str):
    return [s for s in specs if s.strategy == strategy and s.workload == workload and s.precision != "fp32"]


# ---- the matrices, planned here (no launch) ----------------------------------------------------------------------

@pytest.mark.parametrize("cores", (1, 2, 8))
def test_the_cpu_full_matrix_runs_fsdp2_s_policy_in_bf16_beside_the_plain_loop_in_bf16(cores):
    specs = build_matrix("wide", Machine(device=DeviceKind.CPU, devices_per_node=cores))
    for workload in TRANSFORMERS:
        cells = {(s.strategy, s.world_size, tuple(s.options), s.precision.value, s.repeats)
                 for s in specs if s.workload == workload and s.precision != "fp32"}
        # One launch of the bf16 plain loop: it is parity's reference alone (the CPU repeats itself bit for bit),
        # with no bare loop in bf16 to hold the harness's cost against.
        assert cells == {("plain", 1, (), "bf16", 1)} | {("fsdp2", size, tuple(POLICY.items()), "bf16", 1)
                                                         for size in (1, 2) if size <= cores}, workload
        bf16 = [s for s in specs if s.workload == workload and s.precision == "bf16"]
        assert len({reference_key(s.to_dict()) for s in bf16}) == 1      # the plain loop is the policy's reference
    # ResNet-20 stays fp32: its BatchNorm's fp32 running statistics meet the policy's bf16 weights.
    assert {s.precision.value for s in specs if s.workload == "resnet20-cifar"} == {"fp32"}


def test_the_bf16_plain_loop_comes_only_with_the_policy_cells():
    for strategies in (("plain",), ("plain", "ddp")):
        specs = build_matrix("wide", CPU_2, Selection(strategies=strategies))
        assert {s.precision.value for s in specs} == {"fp32"}, strategies
    # Sizes the policy's cells do not run at, and a precision the user set for every cell (the policy is then
    # theirs to ask for), leave them out.
    at_4 = build_matrix("wide", CPU_2, Selection(strategies=("plain", "fsdp2"), world_sizes=(4,)))
    assert {s.precision.value for s in at_4} == {"fp32"}
    in_bf16 = build_matrix("wide", CPU_2, Selection(strategies=("plain", "fsdp2"), overrides=(("precision", "bf16"),)))
    assert {s.precision.value for s in in_bf16} == {"bf16"}
    assert not [s for s in in_bf16 if "mixed_precision" in s.options_dict]


@pytest.mark.parametrize("machine", GPU_SHAPES, ids=shape_id)
@pytest.mark.parametrize("matrix", list(MATRICES))
def test_every_16_bit_fsdp2_cell_of_a_transformer_on_gpus_runs_the_policy_autocast_only_as_a_variant(matrix, machine):
    specs = build_matrix(matrix, machine)
    transformers = {s.workload for s in specs if get_workload(s.workload).family is not Family.RESNET}
    found = [s for workload in transformers for s in sixteen_bit(specs, "fsdp2", workload)]
    assert bool(found) == (matrix in SIXTEEN_BIT_FSDP2_MATRICES)
    policy = [s for s in found if s.options_dict.get("mixed_precision") == "policy"]
    autocast = [s for s in found if s not in policy]
    # An autocast cell is the policy cell's twin without the option, at FSDP2's smallest world size, where kept.
    twins = {s.replace(options={k: v for k, v in s.options if k != "mixed_precision"}).cell_id for s in policy}
    for spec in autocast:
        assert matrix in AUTOCAST_VARIANT_MATRICES and "mixed_precision" not in spec.options_dict, spec.label
        assert spec.cell_id in twins, spec.label
        assert spec.world_size == min(s.world_size for s in found if s.workload == spec.workload), spec.label
    if matrix in AUTOCAST_VARIANT_MATRICES:
        assert {s.workload for s in autocast} == transformers


@pytest.mark.parametrize("machine", GPU_SHAPES, ids=shape_id)
def test_resnet_50_s_fsdp2_cells_keep_autocast_on_gpus(machine):
    for matrix in MATRICES:
        for spec in build_matrix(matrix, machine):
            if spec.workload == "resnet50" and spec.strategy == "fsdp2":
                assert "mixed_precision" not in spec.options_dict, spec.label


@pytest.mark.parametrize("given", ("autocast", "policy"))
def test_the_user_s_mixed_precision_option_wins_over_the_matrix_s_recipe(given):
    gpus = Machine(device=DeviceKind.CUDA, devices_per_node=8)
    for matrix in SIXTEEN_BIT_FSDP2_MATRICES:
        specs = build_matrix(matrix, gpus, Selection(options=(("mixed_precision", given),)))
        fsdp2 = [s for s in specs if s.strategy == "fsdp2"]
        assert fsdp2 and {s.options_dict["mixed_precision"] for s in fsdp2} == {given}, matrix
    # On CPU the policy cells of full are the user's recipe too, in bf16 beside their reference.
    cpu = build_matrix("wide", CPU_2, Selection(strategies=("plain", "fsdp2"), options=(("mixed_precision", given),)))
    assert {(s.world_size, s.options_dict["mixed_precision"]) for s in cpu
            if s.strategy == "fsdp2" and s.precision == "bf16"} == {(1, given), (2, given)}


# ---- the full matrix's policy cell launched on CPU -----------------------------------------------------------------

# gpt-tiny (tests/test_memory.py counts it by hand): 236,928 parameters in 5 FSDP2 units (4 blocks and the root).
PSI = 236_928
UNITS = 5
# tests/conftest.py's shared cells' steps and batch: global 16 in micro-batches of 4, so 2 a rank at 2 ranks.
STEPS = (("warmup_steps", 2), ("timed_steps", 3))
MICRO_BATCHES_A_RANK = 2
SKIP_MICROBATCH = "skip-microbatch:rank=1:step=0"
# The policy cell and the plain loop in bf16: --precision bf16 sets every cell's precision and --option its recipe,
# the full matrix's own cells (checked below), launched without the fp32 ones beside them.
AT_2_WITH_POLICY = ("--workload", "gpt-tiny", "--world-sizes", "2", "--precision", "bf16",
                    "--option", "mixed_precision=policy")


@pytest.fixture(scope="module")
def policy_rows(tmp_path_factory):
    """{"honest": {strategy: row}, "planted": the policy row with rank 1's first micro-batch left out of step 0}."""
    streams = [Stream("fsdp2-policy", (*AT_2_WITH_POLICY, "--strategy", "plain,fsdp2")),
               Stream("fsdp2-policy-skip-microbatch", (*AT_2_WITH_POLICY, "--strategy", "fsdp2"),
                      {FAULT_ENV: SKIP_MICROBATCH})]
    rows = run_streams(tmp_path_factory.mktemp("fsdp2-policy"), streams)
    return {"honest": {row.spec.strategy: row for row in rows["fsdp2-policy"]},
            "planted": rows["fsdp2-policy-skip-microbatch"][0]}


@pytest.mark.launch
@pytest.mark.matrix
def test_the_policy_cell_at_two_ranks_trains_like_the_plain_loop_in_bf16(policy_rows):
    plain, policy = policy_rows["honest"]["plain"], policy_rows["honest"]["fsdp2"]
    planned = {s.cell_id for s in build_matrix("wide", CPU_2, Selection(workloads=("gpt-tiny",), overrides=STEPS))}
    assert {plain.spec.cell_id, policy.spec.cell_id} <= planned      # the full matrix's own cells
    for row in (plain, policy):
        assert row.status is Status.OK, row.message
        assert FAULT_ENV not in row.environment["env"]
    assert plain.measurements["precision_recipe"] == "autocast"
    assert policy.measurements["precision_recipe"] == "fsdp-mp-policy"
    assert policy.measurements["gradient_reduce_dtypes"] == ["float32"]
    assert arithmetic(policy.to_dict()) == "bf16-weights"
    verdict = judge([plain.to_dict(), policy.to_dict()])[1]
    assert verdict.verdict is Verdict.MATCH, verdict
    assert Quantity.GRADIENT_NORM_BY_TENSOR in verdict.deviations
    assert Quantity.UPDATE_NORM_BY_TENSOR.value in verdict.note       # not judged on bf16 weights, and said so


@pytest.mark.launch
@pytest.mark.matrix
def test_the_policy_gathers_bf16_parameters_and_reduce_scatters_fp32_gradients(policy_rows):
    # Every unit gathered for each micro-batch's forward and again for its backward, 2 bytes a parameter; its
    # gradients reduce-scattered once a step, 4 bytes a parameter (nccl-tests sizes: the whole buffer).
    m = policy_rows["honest"]["fsdp2"].measurements
    assert m["parameters"] == PSI
    for counted in m["comm_per_step_by_rank"]:
        assert (counted["all_gather"]["calls"], counted["all_gather"]["bytes"]) == (
            UNITS * 2 * MICRO_BATCHES_A_RANK, 2 * MICRO_BATCHES_A_RANK * 2 * PSI)
        assert (counted["reduce_scatter"]["calls"], counted["reduce_scatter"]["bytes"]) == (UNITS, 4 * PSI)
    assert comm_columns(m)["comm_wire_over_expected"] == pytest.approx(1.0)


@pytest.mark.launch
@pytest.mark.matrix
def test_a_micro_batch_lost_under_the_policy_is_a_mismatch_named_by_the_gradient_norm(policy_rows):
    planted, plain = policy_rows["planted"], policy_rows["honest"]["plain"]
    assert planted.status is Status.OK, planted.message
    assert planted.environment["env"][FAULT_ENV] == SKIP_MICROBATCH
    verdict = judge([plain.to_dict(), planted.to_dict()])[1]
    assert verdict.verdict is Verdict.MISMATCH and Quantity.GRADIENT_NORM in verdict.failed, verdict
