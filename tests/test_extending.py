"""docs/extending.md's worked examples, run as the doc shows them.

The code comes from the doc's marked blocks (tests/doc_blocks.py), so the doc cannot drift from what runs.
The strategy, saved to a file of its own, joins the registry through PARBENCH_EXTRA_STRATEGIES
(harness/strategies/__init__.py), which the ranks inherit, and runs through matrix, launch, worker and
report: no file of the harness names it, so if the harness needed a table entry somewhere for a new
strategy, these tests would fail. The workload is registered and planned by the doc's two registry lines,
and its plain cell's rank program runs in this process.
"""

from __future__ import annotations

import math
import shlex

import pytest

from doc_blocks import code_block, load_module
from harness.strategies import EXTRA_STRATEGIES_ENV, register

DOC = "docs/extending.md"
SHORT = ("--warmup-steps", "2", "--timed-steps", "2")   # 2 warm-up steps: the memory reading needs the second


@pytest.fixture(scope="module")
def toy_rows(tmp_path_factory):
    from harness.cli import main
    from harness.derive.rows import load_rows

    folder = tmp_path_factory.mktemp("extending")
    (folder / "hand_allreduce.py").write_text(code_block(DOC, "hand_allreduce.py"))
    command = shlex.split(code_block(DOC, "run-hand-allreduce"))
    variable, _, value = command[0].partition("=")
    assert variable == EXTRA_STRATEGIES_ENV and command[1:4] == ["python", "-m", "harness"], command
    file_name, _, dict_name = value.partition(":")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv(variable, f"{folder / file_name}:{dict_name}")     # what the launched ranks read
    # This process imported the registry before the variable was set: register the file's dict here too.
    register(getattr(load_module(folder / file_name), dict_name))
    try:
        out = folder / "rows.jsonl"
        # --device cpu: on a GPU machine the smoke matrix would pick GPT-2 small.
        assert main([*command[4:], *SHORT, "--device", "cpu", "--out", str(out)]) == 0
        yield out, load_rows([out])
    finally:
        monkeypatch.undo()


@pytest.mark.launch
def test_a_strategy_from_its_own_file_trains_like_the_plain_loop(toy_rows):
    from harness.derive.cells import cell_table

    _, rows = toy_rows
    toy = next(row for row in rows if row["spec"]["strategy"] == "hand-allreduce")
    assert toy["status"] == "ok", toy["message"]
    assert "torchrun" in " ".join(toy["launch_command"]) and toy["spec"]["world_size"] == 2
    cells = cell_table(rows).set_index("strategy")
    toy_cell = cells.loc["hand-allreduce"]
    assert toy_cell["status"] == "ok"
    # Loss, gradient-norm and parameter-norm parity with the plain loop (harness.derive.parity).
    assert toy_cell["parity"] == "match", toy_cell["parity_failed"]
    # Every gradient all-reduced once per step: 236,928 fp32 gpt-tiny parameters = 947,712 bytes, which a
    # ring all-reduce of 2 ranks sends 2 x (2 - 1) / 2 = 1 time over: 947,712 wire bytes per rank, counted
    # and as the strategy's own traffic model says.
    assert toy_cell["comm_wire_bytes_per_step"] == 947_712
    assert toy_cell["comm_expected_wire_bytes_per_step"] == 947_712
    # Its model states by the default (unsharded) plan: 16 bytes per parameter, fp32 weights, gradients and
    # two AdamW moments: 16 x 236,928 = 3,790,848 bytes per rank; the census measured the same tensors
    # (plus AdamW's 4-byte step counter per parameter tensor).
    assert toy_cell["model_state_bytes_predicted"] == 3_790_848
    assert 0 <= toy_cell["model_state_census_bytes_max"] - 3_790_848 < 4 * 100


@pytest.mark.launch
def test_the_report_shows_the_strategy(toy_rows, tmp_path):
    from harness.cli import main

    out, _ = toy_rows
    assert main(["report", str(out), "--out", str(tmp_path)]) == 0
    assert "| gpt-tiny | hand-allreduce |" in (tmp_path / "report.md").read_text()


# ---- the workload ------------------------------------------------------------------------------------

# Worked out by hand for 32x32 RGB images, widths 16 and 32, 10 classes (docs/extending.md):
CONV_1_MACS = 16 * 32 * 32 * 3 * 9          # 442,368: 3 -> 16 channels, 3x3, at 32x32
CONV_2_MACS = 32 * 16 * 16 * 16 * 9         # 1,179,648: 16 -> 32 channels, 3x3, at 16x16 after pooling
HEAD_MACS = 32 * 10
TRAIN_FLOPS_PER_SAMPLE = 2 * 3 * (CONV_1_MACS + CONV_2_MACS + HEAD_MACS)    # 9,734,016
PARAMETERS = 3 * 16 * 9 + 2 * 16 + 16 * 32 * 9 + 2 * 32 + 32 * 10 + 10     # 5,466
PARAMETER_TENSORS = 8       # two convolution weights, two BatchNorm weights and biases, the head's weight and bias


@pytest.fixture
def small_cnn(tmp_path, monkeypatch):
    """The doc's workload module, registered in WORKLOADS and given a CPU batch plan by the doc's own lines."""
    from harness.matrix import CPU_PLANS, BatchPlan
    from workloads import WORKLOADS

    (tmp_path / "small_cnn.py").write_text(code_block(DOC, "workloads/small_cnn.py"))
    module = load_module(tmp_path / "small_cnn.py")
    # Each registry block is one entry of a dict literal, as it is pasted into the registry.
    entries = eval("{" + code_block(DOC, "WORKLOADS entry") + "}", vars(module))
    plans = eval("{" + code_block(DOC, "CPU_PLANS entry") + "}", {"BatchPlan": BatchPlan})
    for name, workload in entries.items():
        monkeypatch.setitem(WORKLOADS, name, workload)
    for name, plan in plans.items():
        monkeypatch.setitem(CPU_PLANS, name, plan)
    assert list(entries) == list(plans) == ["small-cnn"]
    return WORKLOADS["small-cnn"]


def test_the_doc_workload_has_the_parameters_and_flops_worked_out_by_hand(small_cnn, capsys):
    from harness.cli import main
    from workloads import count_parameters

    assert TRAIN_FLOPS_PER_SAMPLE == 9_734_016 and PARAMETERS == 5_466
    assert count_parameters(small_cnn.build_model()) == PARAMETERS
    assert small_cnn.train_flops_per_sample == TRAIN_FLOPS_PER_SAMPLE
    assert small_cnn.layer_count == len(small_cnn.build_layers())    # what a pipeline's stage check relies on
    assert main(["list"]) == 0
    assert "small-cnn" in capsys.readouterr().out


def test_the_full_matrix_plans_the_doc_workload_and_its_plain_cell_trains(small_cnn):
    from harness.matrix import Machine, Selection, build_matrix
    from harness.rank.comm_counter import CollectiveCounter
    from harness.rank.worker import run_cell
    from harness.spec import DeviceKind
    from harness.strategies import get_strategy

    specs = build_matrix("full", Machine(device=DeviceKind.CPU, devices_per_node=2),
                         Selection(workloads=("small-cnn",), overrides=(("warmup_steps", 2), ("timed_steps", 2))))
    # The doc's plan: per-device batch 8 at the largest world size, 2, so a global batch of 16 everywhere.
    # (ps-async's launch holds a server beside its 2 workers: 3 ranks.)
    assert {spec.global_batch for spec in specs} == {16}
    assert {spec.world_size for spec in specs if spec.strategy != "ps-async"} == {1, 2}
    assert {"plain", "ddp", "zero3", "fsdp2", "pipeline"} <= {spec.strategy for spec in specs}

    plain = next(spec for spec in specs if spec.strategy == "plain")
    strategy = get_strategy("plain")
    # The rank program every launcher starts, run here: the plain loop needs no process group.
    measurements = run_cell(plain, strategy, strategy.start(plain), CollectiveCounter())
    losses = measurements["loss_per_step"]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert measurements["parameters"] == PARAMETERS
    assert measurements["train_flops_per_sample"] == TRAIN_FLOPS_PER_SAMPLE
    assert measurements["workload_family"] == "resnet"
    assert measurements["micro_batches_per_step"] == 16 // 4
    # fp32 AdamW: 4-byte weights and gradients, two 4-byte moments, and a 4-byte step counter per tensor.
    assert measurements["model_state_census_bytes_by_rank"] == [
        {"weights": 4 * PARAMETERS, "gradients": 4 * PARAMETERS, "optimizer": 8 * PARAMETERS + 4 * PARAMETER_TENSORS}]
