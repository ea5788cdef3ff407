"""Silent corruption that loss parity must catch: one rank's gradients scaled by 2 before they are reduced,
and one rank leaving a micro-batch out of its accumulation, planted in real 2-rank cells (harness.rank.faults)
of DDP, Horovod, ZeRO-2 and FSDP2 on gpt-tiny, in fp32 and in bf16.

AdamW's first update is lr * g / (|g| + eps) per element, nearly blind to a gradient's scale, so the
losses of a few steps move little; the gradient norm of the first step cannot miss either fault. With rank
1's gradient g1 doubled the averaged gradient is (g0 + 2 g1) / 2 = g + g1 / 2: larger than g wherever g1
points with the batch's gradient (measured: 1.55 times). With rank 1's first of its 2 micro-batches left
out it is g - m / 4 for that micro-batch's gradient m: smaller where m points with g (measured: 0.85
times; the 4 micro-batches' gradients only partly agree). Both faults fire in step 0, the probed step
(these cells run the steps of tests/conftest.py's, 2 warm-up and 3 timed, so the no-fault rows of those
session fixtures are the references and the controls).
"""

import pytest

from harness.derive.parity import Quantity, Verdict, judge
from harness.rank.faults import FAULT_ENV
from harness.matrix import Machine, Selection, build_matrix
from harness.record import read_results
from harness.runner import RunOptions, run_specs
from harness.spec import DeviceKind, Status

pytestmark = pytest.mark.launch   # every test here reads cells launched for real

PARITY_OVERRIDES = (("warmup_steps", 2), ("timed_steps", 3))   # tests/conftest.py's: its plain rows are references

STRATEGIES = ("ddp", "horovod", "zero2", "fsdp2")
FAULTS = ("grad-scale:factor=2:rank=1:step=0", "skip-microbatch:rank=1:step=0")
PRECISIONS = ("fp32", "bf16")


@pytest.fixture(scope="module")
def faulty_rows(tmp_path_factory):
    """{(fault, precision, strategy): row} of the 16 planted cells."""
    folder = tmp_path_factory.mktemp("faults")
    rows = {}
    for fault in FAULTS:
        for precision in PRECISIONS:
            out = folder / f"{fault.split(':')[0]}-{precision}.jsonl"
            specs = build_matrix("full", Machine(device=DeviceKind.CPU, devices_per_node=2),
                                 Selection(workloads=("gpt-tiny",), strategies=STRATEGIES, world_sizes=(2,),
                                           overrides=(*PARITY_OVERRIDES, ("precision", precision))))
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv(FAULT_ENV, fault)
                run_specs(specs, RunOptions(results=out, timeout_s=300))
            rows.update({(fault, precision, row.spec.strategy): row for row in read_results([out])})
    return rows


def no_fault(fp32_rows, bf16_rows, precision, strategy):
    if precision == "fp32":
        return fp32_rows["gpt-tiny", strategy]
    return bf16_rows[strategy, 2 if strategy != "plain" else 1]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_without_a_fault_the_cell_matches(fp32_rows, bf16_rows, precision, strategy):
    row, reference = (no_fault(fp32_rows, bf16_rows, precision, name) for name in (strategy, "plain"))
    assert row.status is Status.OK and FAULT_ENV not in row.environment["env"]
    assert judge([row.to_dict(), reference.to_dict()])[0].verdict is Verdict.MATCH


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_silently_corrupted_gradient_is_a_mismatch_named_by_the_gradient_norm(
        faulty_rows, fp32_rows, bf16_rows, fault, precision, strategy):
    row = faulty_rows[fault, precision, strategy]
    reference = no_fault(fp32_rows, bf16_rows, precision, "plain")
    assert row.status is Status.OK, row.message
    assert row.environment["env"][FAULT_ENV] == fault
    parity = judge([row.to_dict(), reference.to_dict()])[0]
    assert parity.verdict is Verdict.MISMATCH
    assert Quantity.GRADIENT_NORM in parity.failed, parity
    # The first loss is computed before any gradient: the fault cannot move it.
    assert Quantity.FIRST_LOSS not in parity.failed
    ratio = row.measurements["gradient_norm_first_step"] / reference.measurements["gradient_norm_first_step"]
    assert ratio > 1 if fault.startswith("grad-scale") else ratio < 1, ratio
