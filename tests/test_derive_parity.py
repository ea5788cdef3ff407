"""Parity verdicts judged at read time (harness.derive.parity) on rows built from a real pair: the plain
gpt-tiny cell and DDP at 2 ranks of results/reference/ci-cpu/smoke.jsonl (schema 1, fp32, stored verdicts
of the old record-time code included).

The bf16 cases reuse those rows' losses with the precision set to bf16: a bf16 run of the same cell
starts from the same weights and data, and its first losses differ from these by 1e-4 at most (measured on
CPU, 1 warm-up + 3 timed steps: 6.251419 / 6.243624 / 6.232904 / 6.213758), a hundredth of the gaps below,
so these are what a bf16 verdict is asked to tell apart. Hand arithmetic on the reference's first four losses
l = 6.251411, 6.243723, 6.232881, 6.213758:
- weights that never change repeat l0: largest gap |l0 - l3| = 0.037653, relative 0.037653 / 6.213758 = 6.1e-3;
- a run one update behind shows l0, l0, l1, l2: largest gap |l2 - l3| = 0.019123, relative 3.1e-3;
- a +0.1 offset: relative 0.1 / 6.213758 = 1.6e-2 at the last step, 0.1 / 6.251411 = 1.6e-2 at step 0.
The old record-time check held bf16 losses to a relative 2e-2, 0.124 absolute at these losses: all three
matched there.
"""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness.derive.parity import TOLERANCE, Quantity, Verdict, judge
from harness.record import append_row, read_results
from harness.runner import summary_table
from harness.spec import RunResult

SMOKE = Path(__file__).resolve().parents[1] / "results" / "reference" / "ci-cpu" / "smoke.jsonl"
# What a schema-2 row of this cell records after its first step (hand-picked, like a real gpt-tiny row).
NORMS = {"gradient_norm_first_step": 0.7272784, "parameter_norm_after_first_step": 25.3156496,
         "update_norm_first_step": 0.4859496}


@pytest.fixture
def smoke():
    """(plain row, ddp row) as raw dicts, as `harness.record.read_rows` gives them."""
    rows = [json.loads(line) for line in SMOKE.read_text().splitlines()]
    by_strategy = {row["spec"]["strategy"]: row for row in rows}
    return by_strategy["plain"], by_strategy["ddp"]


def planted(row, losses=None, precision=None, **measurements):
    """A copy of `row` with some of its losses, precision or measurements replaced."""
    row = copy.deepcopy(row)
    if losses is not None:
        row["measurements"]["loss_per_step"] = [*losses, *row["measurements"]["loss_per_step"][len(losses):]]
    if precision is not None:
        row["spec"]["precision"] = precision
        row["measurements"]["precision_recipe"] = "fp32" if precision == "fp32" else "autocast"
    row["measurements"].update(measurements)
    return row


def with_norms(plain, ddp, precision="fp32"):
    return planted(plain, precision=precision, **NORMS), planted(ddp, precision=precision, **NORMS)


def test_a_row_read_before_its_reference_is_still_judged(smoke):
    plain, ddp = smoke
    assert [p.verdict for p in judge([ddp, plain])] == [Verdict.MATCH, Verdict.REFERENCE]
    assert [p.verdict for p in judge([plain, ddp])] == [Verdict.REFERENCE, Verdict.MATCH]


def test_verdicts_stored_in_old_rows_are_ignored(smoke):
    plain, ddp = smoke
    assert ddp["measurements"]["parity_verdict"] == "match"
    offset = planted(ddp, losses=[x + 0.1 for x in ddp["measurements"]["loss_per_step"][:4]])
    assert judge([offset, plain])[0].verdict is Verdict.MISMATCH
    stored_mismatch = planted(ddp, parity_verdict="mismatch")
    assert judge([stored_mismatch, plain])[0].verdict is Verdict.MATCH


def test_schema_1_rows_are_judged_on_losses_alone_and_say_so(smoke):
    plain, ddp = smoke
    parity = judge([ddp, plain])[0]
    assert set(parity.deviations) == {Quantity.FIRST_LOSS, Quantity.LATER_LOSSES}
    assert "losses alone" in parity.note and "schema 1" in parity.note


def test_a_row_whose_strategy_has_no_norms_is_judged_on_losses_alone_with_its_reason(smoke):
    plain, ddp = with_norms(*smoke)
    pipeline = planted(ddp, norms_unavailable_because="train_batch has no point between reduction and update")
    for name in NORMS:
        del pipeline["measurements"][name]
    parity = judge([pipeline, plain])[0]
    assert parity.verdict is Verdict.MATCH and "train_batch" in parity.note


@pytest.mark.parametrize("case", ["weights never change", "one update behind", "+0.1 offset"])
def test_bf16_planted_loss_errors_on_gpt_tiny_are_mismatches(smoke, case):
    plain, ddp = smoke
    l = plain["measurements"]["loss_per_step"][:4]
    losses = {"weights never change": [l[0]] * 4, "one update behind": [l[0], *l[:3]],
              "+0.1 offset": [x + 0.1 for x in l]}[case]
    reference, honest = planted(plain, precision="bf16"), planted(ddp, precision="bf16")
    assert judge([honest, reference])[0].verdict is Verdict.MATCH
    parity = judge([planted(ddp, losses=losses, precision="bf16"), reference])[0]
    assert parity.verdict is Verdict.MISMATCH and Quantity.LATER_LOSSES in parity.failed, parity
    assert parity.tolerances[Quantity.LATER_LOSSES] == TOLERANCE["bf16"][Quantity.LATER_LOSSES]


def test_an_offset_shows_in_the_first_loss_and_a_late_error_does_not(smoke):
    plain, ddp = smoke
    l = plain["measurements"]["loss_per_step"][:4]
    offset = judge([planted(ddp, losses=[x + 0.1 for x in l], precision="bf16"), planted(plain, precision="bf16")])
    assert Quantity.FIRST_LOSS in offset[0].failed
    behind = judge([planted(ddp, losses=[l[0], *l[:3]], precision="bf16"), planted(plain, precision="bf16")])
    assert Quantity.FIRST_LOSS not in behind[0].failed


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("quantity, value, why", [
    ("gradient_norm_first_step", 0.7272784 * 1.5, "rank 1's gradient doubled: (g0 + 2 g1) / 2 = 1.5 g"),
    ("gradient_norm_first_step", 0.7272784 * 2, "a sum where an average belongs, at 2 ranks"),
    ("gradient_norm_first_step", 0.7272784 * 0.85, "one micro-batch of 4 left out (0.85 measured)"),
    ("update_norm_first_step", 0.0, "weights that never change"),
    ("parameter_norm_after_first_step", 25.3121924, "weights that never change: the initial norm"),
])
def test_planted_norm_errors_are_mismatches_that_name_the_norm(smoke, precision, quantity, value, why):
    plain, ddp = with_norms(*smoke, precision=precision)
    parity = judge([planted(ddp, **{quantity: value}), plain])[0]
    assert parity.verdict is Verdict.MISMATCH and parity.failed == (Quantity(quantity),), (why, parity)


def test_rows_of_another_seed_precision_or_step_count_have_no_reference(smoke):
    plain, ddp = smoke
    for change in ({"seed": 1}, {"precision": "bf16"}, {"timed_steps": 9}):
        other = copy.deepcopy(ddp)
        other["spec"].update(change)
        assert judge([other, plain])[0].verdict is Verdict.NO_REFERENCE, change


def test_failed_rows_are_not_judged_and_a_failed_plain_row_is_no_reference(smoke):
    plain, ddp = smoke
    failed = {**copy.deepcopy(ddp), "status": "failed", "measurements": {}}
    assert judge([failed, plain])[0].verdict is Verdict.NOT_JUDGED
    assert judge([ddp, {**copy.deepcopy(plain), "status": "timeout"}])[0].verdict is Verdict.NO_REFERENCE


def test_a_non_finite_loss_is_a_mismatch(smoke):
    plain, ddp = smoke
    parity = judge([planted(ddp, losses=[6.251411, math.nan]), plain])[0]
    assert parity.verdict is Verdict.MISMATCH and parity.deviations[Quantity.LATER_LOSSES] == math.inf


def test_the_earliest_plain_launch_is_the_reference_whatever_the_order(smoke):
    plain, ddp = smoke
    later = planted(plain, losses=[x + 0.1 for x in plain["measurements"]["loss_per_step"][:4]])
    later["started_at"], later["run_id"] = "2026-11-23T00:00:00+00:00", "a later repeat"
    for rows in ([ddp, plain, later], [later, ddp, plain], [plain, later, ddp]):
        verdicts = {row["run_id"]: p.verdict for row, p in zip(rows, judge(rows))}
        assert verdicts[ddp["run_id"]] is Verdict.MATCH


def test_the_console_summary_judges_against_rows_already_in_the_results_file(smoke, tmp_path):
    plain, ddp = (RunResult.from_dict(planted(row, parity_verdict="stale")) for row in smoke)
    results = tmp_path / "rows.jsonl"
    append_row(results, plain)
    append_row(results, ddp)
    line = lambda table, strategy: next(x for x in table.splitlines() if f"/{strategy}/" in x)  # noqa: E731
    assert "match" in line(summary_table([ddp], results_file=results), "ddp").split()
    both = summary_table([ddp, plain])              # `--strategy ddp,plain`: the reference shown after
    assert "match" in line(both, "ddp").split() and "reference" in line(both, "plain").split()


def test_the_report_judges_every_row_of_its_files(smoke, tmp_path):
    from harness.report import write_report

    plain, ddp = smoke
    results = tmp_path / "rows.jsonl"
    append_row(results, RunResult.from_dict(planted(ddp, parity_verdict="no-reference")))
    append_row(results, RunResult.from_dict(plain))
    written = write_report([results], tmp_path / "report")
    markdown = written[0].read_text()
    ddp_line = next(line for line in markdown.splitlines() if line.startswith("| gpt-tiny | ddp |"))
    assert "| match |" in ddp_line
    assert [r.measurements["parity_verdict"] for r in read_results([results])][0] == "no-reference"


@pytest.mark.launch
def test_the_module_imports_without_torch():
    code = "import sys, harness.derive.parity; print(sorted(m for m in ('torch', 'deepspeed', 'horovod', " \
           "'harness.strategies', 'workloads') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
