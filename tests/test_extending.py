"""A strategy defined in this file, and nowhere else, runs through matrix, launch, worker and report.

`HandAllReduce` is data parallelism written out by hand: replicated model, every gradient all-reduced
and divided by the world size after the micro-batches, then the common AdamW. It joins the registry
through PARBENCH_EXTRA_STRATEGIES (harness/strategies/__init__.py), which the ranks inherit, so no file
of the harness names it. If the harness needed a table entry somewhere for a new strategy, this test
would fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from harness.derive.comm import Collective
from harness.rank.memory_model import torch_model_state_tensors
from harness.spec import Precision
from harness.strategies import EXTRA_STRATEGIES_ENV, register
from harness.strategies.base import (ExpectedCollective, ExpectedTraffic, PrecisionRecipe, Strategy, Trainer,
                                     accumulate, make_adamw, optimizer_description, replicated_gradients,
                                     replicated_parameters, torchrun_context)

pytestmark = pytest.mark.launch   # every test here reads cells launched for real


@dataclass
class HandAllReduceTrainer(Trainer):
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    workload: object = None
    spec: object = None

    def train_step(self, micro_batches, gradients_ready=None):
        loss = accumulate(self.model, self.workload.loss, micro_batches, self.spec, self.context.device)
        for parameter in self.model.parameters():
            torch.distributed.all_reduce(parameter.grad)
            parameter.grad /= self.context.world_size
        if gradients_ready is not None:
            gradients_ready()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def model_state_tensors(self):
        return torch_model_state_tensors(self.model, self.optimizer)

    def local_parameters(self):               # whole replicas: the parity probe's norms need no collective
        return replicated_parameters(self.model)

    def local_gradients(self):
        return replicated_gradients(self.model)


class HandAllReduce(Strategy):
    name = "hand-allreduce"
    launcher = "torchrun"          # a key of harness.launch.launcher.LAUNCHERS
    description = "data parallel, one all-reduce per gradient, written by hand (a test's toy)"

    def start(self, spec):
        return torchrun_context(spec.device)

    def expected_collectives(self, *, data_parallel, micro_batches, options, traffic):
        # Its own fact: one all-reduce of each gradient per step (model_state_plan: the default, unsharded).
        return ExpectedTraffic(collectives=(ExpectedCollective(collective=Collective.ALL_REDUCE,
                                                               size_bytes=traffic.gradients_reduced, calls=1,
                                                               ranks=data_parallel),))

    def wrap(self, spec, context, workload, layers):
        model = nn.Sequential(*layers).to(context.device)
        for parameter in model.parameters():      # every rank starts from rank 0's weights
            torch.distributed.broadcast(parameter.data, src=0)
        recipe = PrecisionRecipe.AUTOCAST if spec.precision is Precision.BF16 else PrecisionRecipe.FP32
        return HandAllReduceTrainer(context=context, model=model, workload=workload, spec=spec,
                                    optimizer=make_adamw(model.parameters(), context.device),
                                    precision_recipe=recipe, config=optimizer_description(context.device))


STRATEGIES = {"hand-allreduce": HandAllReduce()}


@pytest.fixture(scope="module")
def toy_rows(tmp_path_factory):
    from harness.derive.rows import load_rows
    from harness.matrix import Machine, Selection, build_matrix
    from harness.runner import RunOptions, run_specs
    from harness.spec import DeviceKind

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv(EXTRA_STRATEGIES_ENV, f"{__file__}:STRATEGIES")
    register(STRATEGIES)
    try:
        out = tmp_path_factory.mktemp("extending") / "rows.jsonl"
        specs = build_matrix("smoke", Machine(device=DeviceKind.CPU, devices_per_node=2),
                             Selection(workloads=("gpt-tiny",), strategies=("plain", "hand-allreduce"),
                                       world_sizes=(2,), overrides=(("warmup_steps", 2), ("timed_steps", 2))))
        run_specs(specs, RunOptions(results=out, timeout_s=300))
        yield out, load_rows([out])
    finally:
        monkeypatch.undo()


def test_a_strategy_from_a_test_file_trains_like_the_plain_loop(toy_rows):
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


def test_the_report_shows_the_strategy(toy_rows, tmp_path):
    from harness.cli import main

    out, _ = toy_rows
    assert main(["report", str(out), "--out", str(tmp_path)]) == 0
    assert "| gpt-tiny | hand-allreduce |" in (tmp_path / "report.md").read_text()
