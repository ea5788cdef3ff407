"""torch.compile of each block (harness.strategies.compiling): the option on every strategy and the refusals, the
order it wraps in, the figures a row keeps (compile seconds, frames, recompiles inside the timed steps), parity held
against the compiled plain loop, and compiled cells of the plain loop, DDP and FSDP2 run end to end."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from torch import nn

from harness.derive.parity import Verdict, judge
from harness.spec import RunSpec, Status
from harness.strategies import STRATEGIES, checked
from harness.strategies.base import is_block, unwrapped_parameter_names
from harness.strategies.compiling import blocks_as_run, compile_figures
from one_line import assert_one_line_error
from workloads import get_workload

# The strategies whose wrap compiles the blocks (the bare loop through the plain loop's wrap; ZeRO through DeepSpeed's
# engine.compile()), and those that refuse a compiled cell before launch.
COMPILING = {"plain", "bare", "ddp", "horovod", "zero1", "zero2", "zero3", "fsdp2", "tp", "fsdp2-tp"}
REFUSING = {"dataparallel", "pipeline", "autotp", "ps", "ps-async", "ep", "horovod-ep", "deepspeed-moe", "ulysses",
            "cp"}
SMOKE = Path(__file__).resolve().parents[1] / "results" / "reference" / "ci-cpu" / "smoke.jsonl"


def test_every_strategy_takes_the_option_so_a_matrix_never_runs_one_eager_unsaid():
    assert set(STRATEGIES) == COMPILING | REFUSING
    for name, strategy in STRATEGIES.items():
        assert "compile" in strategy.options, name
        assert strategy.options["compile"].default is False, name
    spec = RunSpec(workload="gpt-tiny", strategy="ddp", world_size=2, global_batch=16, micro_batch=4,
                   options={"compile": "yes"})
    assert_one_line_error(lambda: checked(spec), ["compile", "False, True"])


@pytest.mark.parametrize("name", sorted(REFUSING))
def test_a_strategy_that_cannot_compile_skips_the_cell_in_one_line_naming_why(name):
    spec = RunSpec(workload="gpt-tiny", strategy=name, world_size=2, global_batch=16, micro_batch=4,
                   options={"compile": True})
    reason = STRATEGIES[name].compile_refusal(spec)
    assert reason and "\n" not in reason and reason.startswith(f"{name} cannot run compile=true: ")
    assert STRATEGIES[name].compile_refusal(spec.replace(options={})) is None       # eager: nothing to refuse


@pytest.mark.parametrize("name", sorted(COMPILING))
def test_a_strategy_that_compiles_refuses_nothing(name):
    spec = RunSpec(workload="gpt-tiny", strategy=name, world_size=1, global_batch=16, micro_batch=4,
                   options={"compile": True})
    assert STRATEGIES[name].compile_refusal(spec) is None


def test_blocks_are_checkpointed_then_compiled_and_keep_their_parameters_and_names():
    layers = get_workload("gpt-tiny").build_layers()     # embedding, 4 blocks, final norm, head
    ran = blocks_as_run(layers, {"compile": True, "activation_checkpointing": "every:2"})
    # Blocks 0 and 2 checkpointed; every block compiled around whatever wraps it (torchtitan's order).
    assert [type(layer).__name__ for layer in ran] == ["TokenEmbedding", *["OptimizedModule"] * 4, "FinalNorm", "LMHead"]
    assert [type(layer._orig_mod).__name__ for layer in ran[1:5]] == ["CheckpointWrapper", "Block",
                                                                      "CheckpointWrapper", "Block"]
    assert all(is_block(layer) for layer in ran[1:5]) and not is_block(ran[0])
    whole, compiled = nn.Sequential(*layers), nn.Sequential(*ran)
    assert [id(p) for p in compiled.parameters()] == [id(p) for p in whole.parameters()]
    assert unwrapped_parameter_names(compiled) == [name for name, _ in whole.named_parameters()]
    assert blocks_as_run(layers, {"compile": False}) == layers


def test_a_row_keeps_compile_seconds_before_the_timed_steps_and_counts_recompiles_inside_them():
    # Two ranks' readings: rank 1 compiled one frame again inside its timed steps (a guard failed there).
    readings = [{"timed_start": {"seconds": 14.0, "frames": 1, "graph_breaks": 0, "cache_hits": 0},
                 "timed_end": {"seconds": 14.0, "frames": 1, "graph_breaks": 0, "cache_hits": 0}},
                {"timed_start": {"seconds": 13.5, "frames": 1, "graph_breaks": 0, "cache_hits": 2},
                 "timed_end": {"seconds": 15.0, "frames": 2, "graph_breaks": 1, "cache_hits": 2}}]
    assert compile_figures(True, readings) == {
        "compiled": True, "compile_seconds_by_rank": [14.0, 13.5], "compiled_frames_by_rank": [1, 1],
        "recompiles_in_timed_steps_by_rank": [0, 1], "graph_breaks_by_rank": [0, 1],
        "compile_cache_hits_by_rank": [0, 2]}
    assert compile_figures(False, readings) == {"compiled": False}
    stopped = [{"timed_start": readings[0]["timed_start"], "timed_end": readings[0]["timed_end"]}, {}]
    assert compile_figures(True, stopped)["compile_unmeasured_because"] == "no timed step ran"


def _compiled(row):
    row = copy.deepcopy(row)
    row["spec"]["options"] = {**row["spec"].get("options", {}), "compile": True}
    return row


def test_a_compiled_row_is_held_against_the_compiled_plain_loop_and_never_the_eager_one():
    rows = {row["spec"]["strategy"]: row for row in map(json.loads, SMOKE.read_text().splitlines())}
    plain, ddp = rows["plain"], rows["ddp"]
    # Only the eager plain loop beside it: a compiled DDP row has no reference, and says what it lacks.
    alone = judge([plain, _compiled(ddp)])[1]
    assert alone.verdict is Verdict.NO_REFERENCE and "compile setting" in alone.note
    # The compiled plain loop beside it, read after an eager one whose losses are off: held against the compiled one.
    eager_off = copy.deepcopy(plain)
    eager_off["measurements"]["loss_per_step"] = [x * 1.01 for x in plain["measurements"]["loss_per_step"]]
    verdicts = judge([eager_off, _compiled(plain), _compiled(ddp)])
    assert verdicts[1].verdict is Verdict.REFERENCE
    assert verdicts[2].verdict is Verdict.MATCH and "compiled plain loop" in verdicts[2].note
    # And an eager row is never held against the compiled loop: against the eager one that is 1% off, a mismatch.
    assert judge([_compiled(plain), eager_off, ddp])[2].verdict is Verdict.MISMATCH


# ---- compiled cells, end to end (the `compiled` stream, tests/conftest.py) --------------------------------------


@pytest.mark.launch
@pytest.mark.matrix
def test_compiled_ddp_and_fsdp2_at_two_ranks_match_the_compiled_plain_loop_with_no_recompile_in_timed_steps(
        compiled_rows):
    assert set(compiled_rows) == {"plain", "ddp", "fsdp2"}
    for name, row in compiled_rows.items():
        assert row.status is Status.OK, (name, row.message)
        m = row.measurements
        ranks = row.spec.world_size
        assert m["compiled"] is True and len(m["compile_seconds_by_rank"]) == ranks
        assert all(seconds > 0 for seconds in m["compile_seconds_by_rank"]), name
        assert all(frames >= 1 for frames in m["compiled_frames_by_rank"]), name
        assert m["recompiles_in_timed_steps_by_rank"] == [0] * ranks, name
    verdicts = judge([row.to_dict() for row in compiled_rows.values()])
    by_strategy = dict(zip(compiled_rows, verdicts))
    assert by_strategy["plain"].verdict is Verdict.REFERENCE
    for name in ("ddp", "fsdp2"):
        assert compiled_rows[name].spec.world_size == 2
        assert by_strategy[name].verdict is Verdict.MATCH, (name, by_strategy[name].note)
        assert "compiled plain loop" in by_strategy[name].note


def test_a_compiled_cell_with_fewer_than_two_warm_up_steps_is_refused_in_one_line_before_launch(capsys):
    # Issue 61: `--warmup-steps 0 --option compile=true` was accepted, and its first timed step (6,023 ms) compiled.
    from harness.cli import main

    for steps in ("0", "1"):
        assert main(["run", "--workload", "gpt-tiny", "--strategy", "ddp", "--world-sizes", "2", "--device", "cpu",
                     "--option", "compile=true", "--warmup-steps", steps, "--dry-run"]) == 2
        error = capsys.readouterr().err.strip()
        assert error == (f"parbench: error: compile=true needs --warmup-steps of at least 2 (got {steps}): the first "
                         "step compiles and the next may recompile, and a timed step that compiles times the compiler")
    assert main(["run", "--workload", "gpt-tiny", "--strategy", "ddp", "--world-sizes", "2", "--device", "cpu",
                 "--option", "compile=true", "--warmup-steps", "2", "--dry-run"]) == 0
