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

Errors confined to some tensors (issue 33), on the first step's norms of a real gpt-tiny bf16 row of the
plain loop (seed 0; BY_TENSOR below holds some of its tensors): global gradient norm G = 0.7272517, update
norm U = 0.4860154; the four c_attn.weight gradients (21% of the parameters) 0.0236635, 0.0232619,
0.0216717, 0.0198066, squares summing to 1.963041e-3; the squares of all 18 LayerNorm gradients sum to
8.6247e-5.
- every c_attn.weight gradient halved: G' = sqrt(G^2 - 3/4 x 1.963041e-3) = 0.7262388, 1.393e-3 off G, under
  the 3e-3 that ZeRO's bf16 gradient communication needs; each of those tensors is off by 0.5;
- every LayerNorm gradient doubled: G' = sqrt(G^2 + 3 x 8.6247e-5) = G (1 + 2.446e-4); each off by 1;
- a random error of 2% of |g| orthogonal to g, as spread over the 236,928 elements (each tensor's share of
  |e|^2 its share of the elements, orthogonal to g_t within it): G' = G sqrt(1 + 0.02^2) = G (1 + 2.0e-4);
  tensor t of n_t elements is off by sqrt(1 + (0.02 G)^2 n_t / 236,928 / |g_t|^2) - 1, most where the gradient
  is small for its size: 1.ln_1.weight, sqrt(1 + 2.11558e-4 x 64 / 236,928 / 0.000373026^2) - 1 = 0.18773;
- one LayerNorm weight left unchanged (its update 0.0080005 lost): U' = sqrt(U^2 - 0.0080005^2) = U (1 -
  1.355e-4), within the 1e-2 allowed on the update norm; that tensor's update is off by 1.
The old judge, of the global norms alone, matched all four in bf16 (its 3e-3 on the gradient norm, 1e-2 on the
update norm); a row that reduced its gradients in bf16 (ZeRO) is still held to those, and to 3e-2 tensor by
tensor for the gradient, 0.1 for the update.
"""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness.derive.parity import TENSOR_NORMS, TOLERANCE, Quantity, Verdict, judge
from harness.record import append_row, read_results
from harness.runner import summary_table
from harness.spec import RunResult

SMOKE = Path(__file__).resolve().parents[1] / "results" / "reference" / "ci-cpu" / "smoke.jsonl"
# What a schema-2 row of this cell records after its first step (hand-picked, like a real gpt-tiny row).
NORMS = {"gradient_norm_first_step": 0.7272784, "parameter_norm_after_first_step": 25.3156496,
         "update_norm_first_step": 0.4859496}
# A real gpt-tiny bf16 row of the plain loop after its first step (seed 0): the global norms, and the gradient's
# and update's norms of some of its tensors (the docstring's hand arithmetic uses them).
BF16_NORMS = {"gradient_norm_first_step": 0.7272517, "parameter_norm_after_first_step": 25.3156719,
              "update_norm_first_step": 0.4860154}
GRADIENTS_BY_TENSOR = {"0.wte.weight": 0.3133971, "1.ln_1.weight": 0.000373026, "1.ln_1.bias": 0.0012393136,
                       "1.ln_2.weight": 0.0017189720, "1.ln_2.bias": 0.0016168752, "1.c_attn.weight": 0.0236635,
                       "2.c_attn.weight": 0.0232619, "3.c_attn.weight": 0.0216717, "4.c_attn.weight": 0.0198066}
UPDATES_BY_TENSOR = {"0.wte.weight": 0.1810055, "1.ln_1.weight": 0.0080005, "1.ln_1.bias": 0.0079983,
                     "1.ln_2.weight": 0.0079917, "1.ln_2.bias": 0.0079988, "1.c_attn.weight": 0.1103182,
                     "2.c_attn.weight": 0.1103173, "3.c_attn.weight": 0.1103072, "4.c_attn.weight": 0.1102903}
# What a row says it reduced its gradients in, for each bf16 tolerance key: DDP's fp32, or ZeRO's torch_autocast
# section (bf16 for Linear weights, fp32 for the rest).
REDUCED_IN = {"fp32": ["float32"], "bf16": ["float32"], "bf16-comm": ["bfloat16", "float32"]}


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
    # These rows do not say what they reduced their gradients in: held to the wider set, as before.
    assert parity.tolerances[Quantity.LATER_LOSSES] == TOLERANCE["bf16-comm"][Quantity.LATER_LOSSES]


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


def by_tensor(plain, ddp, key, gradients=None, updates=None, **measurements):
    """(reference, row) holding BF16_NORMS and the norms by tensor, in the precision and with the row reducing
    its gradients as tolerance key `key` says, with its gradients' or updates' norms by tensor or other
    measurements replaced (an fp32 row's norms differ from these by bf16's rounding of the forward, which
    changes nothing below)."""
    rows = []
    for row, reduced_in in ((plain, []), (ddp, REDUCED_IN[key])):
        rows.append(planted(row, precision="fp32" if key == "fp32" else "bf16", **BF16_NORMS,
                            gradient_reduce_dtypes=reduced_in,
                            gradient_norm_by_tensor_first_step=dict(GRADIENTS_BY_TENSOR),
                            update_norm_by_tensor_first_step=dict(UPDATES_BY_TENSOR)))
    reference, row = rows
    row["measurements"]["gradient_norm_by_tensor_first_step"].update(gradients or {})
    row["measurements"]["update_norm_by_tensor_first_step"].update(updates or {})
    row["measurements"].update(measurements)
    return reference, row


C_ATTN = [name for name in GRADIENTS_BY_TENSOR if name.endswith(".c_attn.weight")]
# gpt-tiny's tensors' elements: 512 x 64 token embedding, 64-wide LayerNorms, 192 x 64 c_attn weights
ELEMENTS = {"0.wte.weight": 512 * 64, **{n: 64 for n in GRADIENTS_BY_TENSOR if ".ln_" in n},
            **{n: 192 * 64 for n in GRADIENTS_BY_TENSOR if n.endswith(".c_attn.weight")}}
LAYER_NORMS = [name for name in GRADIENTS_BY_TENSOR if ".ln_" in name]
# (the gradients' norms by tensor that change, the global gradient norm, the largest deviation, where)
CONFINED = {
    "c_attn.weight halved": ({n: GRADIENTS_BY_TENSOR[n] * 0.5 for n in C_ATTN}, 0.7262388, 0.5, None),
    "LayerNorm x2": ({n: GRADIENTS_BY_TENSOR[n] * 2 for n in LAYER_NORMS}, 0.7272517 * (1 + 2.446e-4), 1.0, None),
    "2% random, orthogonal": ({n: math.hypot(g, 0.02 * 0.7272517 * math.sqrt(ELEMENTS[n] / 236_928))
                               for n, g in GRADIENTS_BY_TENSOR.items()}, 0.7272517 * (1 + 2.0e-4), 0.18773,
                              "1.ln_1.weight"),
}


@pytest.mark.parametrize("key", REDUCED_IN)
def test_honest_norms_by_tensor_match(smoke, key):
    reference, row = by_tensor(*smoke, key)
    parity = judge([row, reference])[0]
    assert parity.verdict is Verdict.MATCH and set(TENSOR_NORMS) <= set(parity.deviations) and not parity.note
    assert parity.tolerances[Quantity.GRADIENT_NORM_BY_TENSOR] == TOLERANCE[key][Quantity.GRADIENT_NORM_BY_TENSOR]


@pytest.mark.parametrize("key", REDUCED_IN)
@pytest.mark.parametrize("case", CONFINED)
def test_a_gradient_error_confined_to_some_tensors_is_a_mismatch_naming_the_tensor(smoke, key, case):
    gradients, global_norm, deviation, where = CONFINED[case]
    reference, row = by_tensor(*smoke, key, gradients=gradients, gradient_norm_first_step=global_norm)
    parity = judge([row, reference])[0]
    assert parity.verdict is Verdict.MISMATCH and Quantity.GRADIENT_NORM_BY_TENSOR in parity.failed, parity
    assert parity.deviations[Quantity.GRADIENT_NORM_BY_TENSOR] == pytest.approx(deviation, rel=1e-3)
    tensor = parity.tensors[Quantity.GRADIENT_NORM_BY_TENSOR]
    assert tensor == where if where else tensor in gradients
    assert f"{tensor} off by" in parity.note
    if key == "bf16-comm":          # the global norm alone lets it through, where ZeRO's bf16 noise must pass
        assert Quantity.GRADIENT_NORM not in parity.failed, parity


def test_a_tensor_left_unchanged_is_a_mismatch_of_the_update_norms_by_tensor(smoke):
    reference, row = by_tensor(*smoke, "bf16-comm", updates={"1.ln_1.weight": 0.0},
                               update_norm_first_step=0.4860154 * (1 - 1.355e-4))
    parity = judge([row, reference])[0]
    assert parity.verdict is Verdict.MISMATCH and parity.failed == (Quantity.UPDATE_NORM_BY_TENSOR,), parity
    assert parity.tensors[Quantity.UPDATE_NORM_BY_TENSOR] == "1.ln_1.weight"
    assert parity.deviations[Quantity.UPDATE_NORM_BY_TENSOR] == 1.0


def test_a_tensor_one_row_does_not_name_is_a_mismatch_naming_it(smoke):
    reference, row = by_tensor(*smoke, "bf16")
    del row["measurements"]["gradient_norm_by_tensor_first_step"]["0.wte.weight"]
    parity = judge([row, reference])[0]
    assert parity.verdict is Verdict.MISMATCH and parity.failed == (Quantity.GRADIENT_NORM_BY_TENSOR,)
    assert parity.tensors[Quantity.GRADIENT_NORM_BY_TENSOR] == "0.wte.weight"
    assert parity.deviations[Quantity.GRADIENT_NORM_BY_TENSOR] == math.inf


def test_a_bf16_row_is_held_to_the_tolerances_of_the_dtype_it_reduced_its_gradients_in(smoke):
    for key in REDUCED_IN:                      # fp32 whatever it reduced in
        reference, row = by_tensor(*smoke, key)
        assert judge([row, reference])[0].tolerances == TOLERANCE[key], key
    reference, row = by_tensor(*smoke, "bf16")
    del row["measurements"]["gradient_reduce_dtypes"]        # a row written before rows said
    parity = judge([row, reference])[0]
    assert parity.tolerances == TOLERANCE["bf16-comm"] and "does not record gradient_reduce_dtypes" in parity.note
    # A strategy that reduces in fp32 is held to the plain loop's rounding: 0.2% off the global norm
    # tolerated with bf16 communication is a mismatch there.
    for key, verdict in (("bf16", Verdict.MISMATCH), ("bf16-comm", Verdict.MATCH)):
        reference, row = by_tensor(*smoke, key, gradient_norm_first_step=0.7272517 * (1 + 2e-3))
        assert judge([row, reference])[0].verdict is verdict, key


def test_rows_without_norms_by_tensor_are_judged_on_the_global_norms_and_say_so(smoke):
    plain, ddp = with_norms(*smoke)
    parity = judge([ddp, plain])[0]
    assert parity.verdict is Verdict.MATCH and not set(TENSOR_NORMS) & set(parity.deviations)
    assert "not tensor by tensor" in parity.note and "the reference" not in parity.note
    reference, row = by_tensor(*smoke, "bf16")
    del reference["measurements"]["gradient_norm_by_tensor_first_step"]
    del reference["measurements"]["update_norm_by_tensor_first_step"]
    parity = judge([row, reference])[0]
    assert parity.verdict is Verdict.MATCH and "the reference was written before" in parity.note


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


# ---- an MoE model's router choices (harness.rank.routing) ------------------------------------------------------------

# Two blocks of 4 experts, 2 steps; 8 tokens x 2 choices a block. The near-tie counts are at (1e-6, 1e-4, 1e-2).
ROUTED = [[[5, 3, 4, 4], [4, 4, 4, 4]], [[6, 2, 4, 4], [3, 5, 4, 4]]]


def routed(tokens, near_ties=((0, 0, 0), (0, 0, 0))):
    return {"routing": {"tokens_per_expert_by_step": tokens, "smallest_margin_by_step": [0.01, 0.02],
                        "near_tie_margins": [1e-6, 1e-4, 1e-2], "near_ties_by_step": [list(n) for n in near_ties],
                        "load_imbalance": 1.5}}


def test_the_same_routing_matches_and_one_token_sent_elsewhere_is_a_mismatch(smoke):
    plain, ddp = smoke
    reference = planted(plain, **routed(ROUTED))
    assert judge([reference, planted(ddp, **routed(ROUTED))])[1].verdict is Verdict.MATCH
    # Step 1, block 0: one token's choice moved from expert 0 to expert 1 (losses and norms unchanged).
    moved = [ROUTED[0], [[5, 3, 4, 4], ROUTED[1][1]]]
    parity = judge([reference, planted(ddp, **routed(moved))])[1]
    assert parity.verdict is Verdict.MISMATCH and parity.failed == (Quantity.ROUTING,)
    assert "step 1: 1 choice(s) moved" in parity.note


def test_a_moved_choice_within_the_references_near_ties_is_reported_not_failed(smoke):
    plain, ddp = smoke
    moved = [ROUTED[0], [[5, 3, 4, 4], ROUTED[1][1]]]
    # fp32 takes the count under 1e-6: one near-tie in the plain loop covers one moved choice, not two.
    one_tie = ((0, 0, 0), (1, 3, 9))
    parity = judge([planted(plain, **routed(ROUTED, one_tie)), planted(ddp, **routed(moved))])[1]
    assert parity.verdict is Verdict.MATCH and "step 1: 1 moved, 1 near-tie(s)" in parity.note
    two_moved = [ROUTED[0], [[5, 3, 4, 4], [3, 5, 5, 3]]]
    parity = judge([planted(plain, **routed(ROUTED, one_tie)), planted(ddp, **routed(two_moved))])[1]
    assert parity.verdict is Verdict.MISMATCH and "2 choice(s) moved, against 1 near-tie(s)" in parity.note
    # Ties counted only under a wider gap (1e-4, 1e-2) do not excuse an fp32 row.
    wide_ties = ((0, 0, 0), (0, 3, 9))
    assert judge([planted(plain, **routed(ROUTED, wide_ties)), planted(ddp, **routed(moved))])[1].verdict \
        is Verdict.MISMATCH
    # Nor do the row's own near-ties (a router collapsed to equal probabilities has a near-tie in every token).
    parity = judge([planted(plain, **routed(ROUTED)), planted(ddp, **routed(moved, ((8, 8, 8), (8, 8, 8))))])[1]
    assert parity.verdict is Verdict.MISMATCH


def test_every_step_is_judged_and_a_dropped_choice_is_never_excused(smoke):
    plain, ddp = smoke
    ties = ((2, 2, 2), (1, 1, 1))
    # Step 0 within its ties, step 1 beyond them: the second step fails even though the first was excused.
    both = [[[6, 2, 4, 4], [4, 4, 4, 4]], [[5, 3, 4, 4], [2, 6, 4, 4]]]
    parity = judge([planted(plain, **routed(ROUTED, ties)), planted(ddp, **routed(both))])[1]
    assert parity.verdict is Verdict.MISMATCH and "step 1: 2 choice(s) moved, against 1" in parity.note
    # One choice lost from block 0 of step 1 (a count of 15, not 16): half of 1 is not 0 moved, it is a dropped token.
    dropped = [ROUTED[0], [[6, 2, 4, 3], ROUTED[1][1]]]
    parity = judge([planted(plain, **routed(ROUTED, ((9, 9, 9), (9, 9, 9)))), planted(ddp, **routed(dropped))])[1]
    assert parity.verdict is Verdict.MISMATCH and "routed [15, 16] choices against [16, 16]" in parity.note
