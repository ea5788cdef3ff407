"""Failure isolation on real launches: a rank killed, hung, out of memory or crashed mid-cell, and a missing
dependency, each become a row with the right status; the next cell runs; no rank is left behind."""

import sys

import psutil
import pytest

from harness.cli import main
from harness.launch.cell import CELL_TOKEN_ENV
from harness.matrix import Machine, Selection, build_matrix
from harness.record import read_results
from harness.runner import RunOptions, run_specs
from harness.spec import DeviceKind, Status

MACHINE = Machine(device=DeviceKind.CPU, devices_per_node=2)
SHORT = (("warmup_steps", 1), ("timed_steps", 2))


def cells(strategies: tuple[str, ...]):
    """DDP at 2 ranks (or another strategy), then the plain loop: the cell after the faulty one."""
    specs = build_matrix("smoke", MACHINE, Selection(workloads=("gpt-tiny",), strategies=strategies,
                                                     overrides=SHORT))
    return sorted(specs, key=lambda spec: spec.strategy == "plain")


def hide_horovod(monkeypatch) -> None:
    """Make horovod look not installed. find_spec answers None for a name that sys.modules maps to None; every
    horovod module already imported in this process (harness doctor imports horovod.torch) is hidden too, since
    find_spec answers an imported submodule from sys.modules without asking its parent."""
    for name in ["horovod", *(name for name in sys.modules if name.startswith("horovod."))]:
        monkeypatch.setitem(sys.modules, name, None)


def leftover_ranks() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if CELL_TOKEN_ENV in process.environ():
                found.append(process)
        except psutil.Error:
            continue
    return found


@pytest.mark.launch
@pytest.mark.parametrize("fault, status, timeout_s, message", [
    ("kill:rank=1:step=1", Status.FAILED, 300, "SIGKILL"),
    ("oom:rank=1:step=1", Status.OOM, 300, "OutOfMemoryError: injected"),
    # The timeout is what the hung cell costs; the plain cell after it, which runs under the same timeout,
    # takes about 5 s here. A DDP cell slower than that to reach its hang still times out.
    ("hang:rank=1:step=1", Status.TIMEOUT, 15, "all ranks killed"),
])
def test_a_faulty_rank_becomes_a_row_and_the_next_cell_runs(fault, status, timeout_s, message, tmp_path,
                                                            monkeypatch):
    monkeypatch.setenv("PARBENCH_FAULT", fault)     # rank 1 only: the plain cell after it has rank 0 alone
    out = tmp_path / "rows.jsonl"
    results = run_specs(cells(("ddp", "plain")), RunOptions(results=out, timeout_s=timeout_s))
    faulty, after = results
    assert faulty.spec.strategy == "ddp" and faulty.status is status, faulty.message
    assert message in faulty.message
    assert after.spec.strategy == "plain" and after.status is Status.OK, after.message
    assert [r.status for r in read_results([out])] == [status, Status.OK]
    assert not leftover_ranks()


@pytest.mark.launch
def test_a_missing_dependency_is_a_skipped_row_with_the_reason(tmp_path, monkeypatch):
    hide_horovod(monkeypatch)
    out = tmp_path / "rows.jsonl"
    skipped, after = run_specs(cells(("horovod", "plain")), RunOptions(results=out, timeout_s=300))
    assert skipped.status is Status.SKIPPED and "needs horovod.torch, which is not installed" in skipped.message
    assert after.status is Status.OK


@pytest.mark.launch
def test_resume_skips_launches_recorded_ok_and_runs_the_rest(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    common = ["run", "--matrix", "smoke", "--workload", "gpt-tiny", "--warmup-steps", "1", "--timed-steps", "2",
              "--out", str(out)]
    assert main([*common, "--strategy", "plain"]) == 0
    assert main([*common, "--resume"]) == 0               # plain is recorded; only DDP launches
    rows = read_results([out])
    assert [r.spec.strategy for r in rows] == ["plain", "ddp"]
    assert main([*common, "--resume"]) == 0               # nothing left to launch
    assert len(read_results([out])) == 2
    assert "plain" in capsys.readouterr().out


def test_a_malformed_fault_is_refused_before_launch(monkeypatch, capsys):
    monkeypatch.setenv("PARBENCH_FAULT", "explode:rank=0")
    assert main(["run", "--matrix", "smoke"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "KIND:rank=R:step=S" in err


def test_silent_faults_multiply_only_their_ranks_losses_in_their_step():
    from harness.rank.faults import Fault

    scale = Fault.parse("grad-scale:factor=2:rank=1:step=0")
    assert (scale.kind, scale.rank, scale.step, scale.factor) == ("grad-scale", 1, 0, 2.0)
    assert scale.loss_multipliers(rank=1, step=0, micro_batches=2) == [2.0, 2.0]
    assert scale.loss_multipliers(rank=0, step=0, micro_batches=2) is None
    assert scale.loss_multipliers(rank=1, step=1, micro_batches=2) is None
    skip = Fault.parse("skip-microbatch:rank=1:step=3")
    assert skip.loss_multipliers(rank=1, step=3, micro_batches=4) == [0.0, 1.0, 1.0, 1.0]
    assert Fault.parse("kill:rank=1:step=3").loss_multipliers(rank=1, step=3, micro_batches=4) is None
    skip.fire(rank=1, step=3)          # a silent fault never ends or fails the rank


@pytest.mark.parametrize("text", ["grad-scale:rank=1:step=0", "grad-scale:factor=two:rank=1:step=0",
                                  "skip-microbatch:factor=2:rank=1:step=0", "grad-scale:factor=inf:rank=1:step=0"])
def test_a_malformed_silent_fault_is_a_one_line_error_naming_what_is_allowed(text):
    from harness.rank.faults import Fault

    with pytest.raises(ValueError) as error:
        Fault.parse(text)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and text in message and "factor" in message


def test_a_silent_fault_from_a_step_on_fires_in_that_step_and_every_later_one_alone():
    from harness.rank.faults import Fault

    onward = Fault.parse("grad-scale:factor=64:rank=all:step=2+")
    assert [onward.loss_multipliers(rank=1, step=step, micro_batches=2) for step in range(5)] == [
        None, None, [64.0, 64.0], [64.0, 64.0], [64.0, 64.0]]
    assert Fault.parse("grad-scale:factor=64:rank=all:step=2").loss_multipliers(rank=1, step=3, micro_batches=2) \
        is None
    for loud in ("kill:rank=1:step=2+", "lr-scale:factor=2:rank=0:step=1+", "slow-step:factor=2:rank=0:step=0+"):
        with pytest.raises(ValueError, match="step=S\\+ .* silent kinds alone"):
            Fault.parse(loud)
    with pytest.raises(ValueError, match="expected KIND"):
        Fault.parse("grad-scale:factor=2:rank=1:step=+")


def test_a_tensor_confined_grad_scale_parses_with_every_rank():
    from harness.rank.faults import ALL_RANKS, Fault

    fault = Fault.parse("grad-scale:factor=0.5:tensors=*.c_attn.weight:rank=all:step=0")
    assert (fault.rank, fault.factor, fault.tensors) == (ALL_RANKS, 0.5, "*.c_attn.weight")
    # It scales gradients, not losses, on every rank of its step alone.
    assert fault.loss_multipliers(rank=0, step=0, micro_batches=2) is None
    assert Fault.parse("grad-scale:factor=2:rank=all:step=0").loss_multipliers(rank=3, step=0, micro_batches=2) \
        == [2.0, 2.0]
    with pytest.raises(ValueError, match="rank must be >= 0 or all"):
        Fault.parse("grad-scale:factor=2:rank=-1:step=0")
    with pytest.raises(ValueError, match="tensors="):
        Fault.parse("skip-microbatch:tensors=*.weight:rank=1:step=0")


def test_a_tensor_confined_grad_scale_scales_those_gradients_alone_in_its_step():
    import torch

    from harness.rank.faults import Fault

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    inputs = torch.randn(4, 3)

    def gradients():
        model.zero_grad()
        model(inputs).sum().backward()        # two forwards and backwards: two micro-batches
        model(inputs).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    honest = gradients()
    disarm = Fault.parse("grad-scale:factor=0.5:tensors=0.weight:rank=all:step=2").scale_tensor_gradients(1, 2, model)
    planted = gradients()
    disarm()
    assert torch.equal(planted["0.weight"], honest["0.weight"] * 0.5)     # once, not once per micro-batch
    for name in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(planted[name], honest[name]), name
    assert torch.equal(gradients()["0.weight"], honest["0.weight"])        # disarmed after its step
    other_step = Fault.parse("grad-scale:factor=0.5:tensors=0.weight:rank=1:step=2").scale_tensor_gradients(1, 3, model)
    assert torch.equal(gradients()["0.weight"], honest["0.weight"])
    other_step()


def test_a_tensor_pattern_that_scales_nothing_fails_the_rank():
    import torch

    from harness.rank.faults import Fault

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with pytest.raises(ValueError, match="matches no parameter"):
        Fault.parse("grad-scale:factor=0.5:tensors=*.c_attn.weight:rank=0:step=0").scale_tensor_gradients(0, 0, model)
    disarm = Fault.parse("grad-scale:factor=0.5:tensors=0.weight:rank=0:step=0").scale_tensor_gradients(0, 0, model)
    with pytest.raises(RuntimeError, match="scaled no gradient"):
        disarm()                              # no backward ran


@pytest.mark.parametrize("text, fragment", [
    ("extra-all-reduce:rank=1:step=0", "needs rank=all"),          # one rank's all-reduce would never complete
    ("lr-scale:rank=0:step=0", "factor"),
    ("lr-scale:factor=nan:rank=0:step=0", "finite"),
    ("weight-copy:factor=2:rank=0:step=0", "factor"),
    ("untracked-weight-copy:factor=2:rank=0:step=0", "factor"),
    ("extra-all-reduce:tensors=*.weight:rank=all:step=0", "tensors="),
])
def test_a_malformed_change_fault_is_a_one_line_error_naming_what_is_allowed(text, fragment):
    from harness.rank.faults import Fault

    with pytest.raises(ValueError) as error:
        Fault.parse(text)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and text in message and fragment in message


def test_change_faults_never_end_the_rank_nor_touch_its_losses():
    from harness.rank.faults import Fault

    for text in ("extra-all-reduce:rank=all:step=0", "weight-copy:rank=0:step=0", "untracked-weight-copy:rank=0:step=0",
                 "lr-scale:factor=2:rank=0:step=0"):
        fault = Fault.parse(text)
        fault.fire(rank=0, step=0)
        assert fault.loss_multipliers(rank=0, step=0, micro_batches=2) is None


def _adamw_after_one_step():
    """gpt-tiny's optimizer on a 2 x 3 + 2 = 8-parameter model, after one update (AdamW makes its state then)."""
    import torch

    from harness.strategies.base import make_adamw

    model = torch.nn.Linear(3, 2)
    optimizer = make_adamw(model.parameters(), torch.device("cpu"))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_lr_scale_multiplies_its_ranks_learning_rate_once_in_its_step():
    from harness.rank.faults import Fault

    _, optimizer = _adamw_after_one_step()
    fault = Fault.parse("lr-scale:factor=1.5:rank=1:step=2")
    for rank, step in ((0, 2), (1, 1), (1, 3)):
        fault.before_step(rank, step, lambda: optimizer)
    assert optimizer.param_groups[0]["lr"] == 1e-3           # other ranks and steps: the common 1e-3
    fault.before_step(1, 2, lambda: optimizer)
    assert optimizer.param_groups[0]["lr"] == 1.5e-3         # kept for every later step


def test_weight_copy_adds_an_fp32_copy_of_the_weights_to_what_the_census_counts():
    import torch

    from harness.rank.faults import Fault
    from harness.rank.memory_model import census_bytes, torch_model_state_tensors

    model, optimizer = _adamw_after_one_step()
    # By hand: AdamW keeps two fp32 moments per parameter (2 x 8 x 4 = 64 bytes) and a 4-byte fp32 `step` per
    # tensor (2 tensors: 8 bytes); the copy adds 4 bytes for each of the 8 parameters.
    assert census_bytes(torch_model_state_tensors(model, optimizer))["optimizer"] == 72
    fault = Fault.parse("weight-copy:rank=0:step=1")
    fault.after_step(0, 0, lambda: optimizer)
    fault.after_step(1, 1, lambda: optimizer)
    assert census_bytes(torch_model_state_tensors(model, optimizer))["optimizer"] == 72
    before = [p.detach().clone() for p in model.parameters()]
    fault.after_step(0, 1, lambda: optimizer)
    assert census_bytes(torch_model_state_tensors(model, optimizer))["optimizer"] == 72 + 32
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))     # the weights are left alone
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()                                         # AdamW steps on beside the extra state


def test_untracked_weight_copy_keeps_an_fp32_copy_on_the_trainer_outside_the_census():
    import gc

    import torch

    from harness.rank.faults import UNTRACKED_WEIGHT_COPY_ATTRIBUTE, Fault
    from harness.rank.memory_model import census_bytes, torch_model_state_tensors, untracked_tensor_bytes

    model, optimizer = _adamw_after_one_step()
    trainer = type("Trainer", (), {})()
    states = torch_model_state_tensors(model, optimizer)
    census = census_bytes(states)
    gc.collect()
    outside = untracked_tensor_bytes(states, [])
    fault = Fault.parse("untracked-weight-copy:rank=0:step=1")
    fault.after_step(1, 1, lambda: optimizer, trainer)
    fault.after_step(0, 0, lambda: optimizer, trainer)
    assert not hasattr(trainer, UNTRACKED_WEIGHT_COPY_ATTRIBUTE)      # another rank, another step
    fault.after_step(0, 1, lambda: optimizer, trainer)
    copy = getattr(trainer, UNTRACKED_WEIGHT_COPY_ATTRIBUTE)
    assert [c.dtype for c in copy] == [torch.float32] * 2
    assert all(torch.equal(c, p) for c, p in zip(copy, model.parameters()))
    # The census as it was; outside it, 4 bytes for each of the 8 parameters (2 x 3 weights and 2 biases).
    assert census_bytes(torch_model_state_tensors(model, optimizer)) == census
    gc.collect()
    assert untracked_tensor_bytes(states, []) == outside + 32


def test_weight_copy_leaves_a_tensor_without_optimizer_state_alone():
    import torch

    from harness.rank.faults import Fault
    from harness.strategies.base import make_adamw

    model = torch.nn.Linear(3, 2)
    optimizer = make_adamw(model.parameters(), torch.device("cpu"))
    assert optimizer.state[model.weight] == {}      # read through the defaultdict, as any reader may, before a step
    Fault.parse("weight-copy:rank=0:step=0").after_step(0, 0, lambda: optimizer)
    assert not any(optimizer.state.values())       # AdamW makes a tensor's state only while its state is empty
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()


def test_extra_all_reduce_is_one_counted_all_reduce_of_4096_bytes_in_every_step_from_its_own(tmp_path):
    import torch
    import torch.distributed as dist

    from harness.rank.comm_counter import CollectiveCounter
    from harness.rank.faults import Fault

    fault = Fault.parse("extra-all-reduce:rank=all:step=2")
    with pytest.raises(RuntimeError, match="needs a torch.distributed process group"):
        fault.in_step(0, 2, torch.device("cpu"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    counter = CollectiveCounter()
    counter.install_torch()
    try:
        for step in range(4):
            with counter.counting(record=True):
                fault.in_step(0, step, torch.device("cpu"))
        # Steps 2 and 3 issue one all-reduce of 1024 fp32 zeros each: 2 calls and 8,192 bytes over 4 steps.
        assert counter.per_step()["all_reduce"] == {
            "bytes": 2048.0, "calls": 0.5, "dtypes": {"float32": {"bytes": 2048.0, "element_bytes": 4}},
            "bytes_by_group_size": {"1": 2048.0}, "by_group": {"world": {"bytes": 2048.0, "calls": 0.5}},
            "group_ranks": {"world": 1}}
    finally:
        counter.uninstall()
        dist.destroy_process_group()


def test_a_slow_step_fault_parses_and_slows_its_strategy_from_its_step_on():
    from harness.rank.faults import ALL_RANKS, Fault

    slow = Fault.parse("slow-step:factor=1.3:rank=all:step=2:strategy=ddp")
    assert (slow.kind, slow.rank, slow.step, slow.factor, slow.strategy) == ("slow-step", ALL_RANKS, 2, 1.3, "ddp")
    assert [slow.slows(rank=1, step=s, strategy="ddp") for s in range(5)] == [False, False, True, True, True]
    assert not slow.slows(rank=0, step=3, strategy="plain")
    assert Fault.parse("slow-step:factor=2:rank=1:step=0").slows(rank=1, step=0, strategy="zero3")
    assert not Fault.parse("slow-step:factor=2:rank=1:step=0").slows(rank=0, step=0, strategy="zero3")
    # A 100 ms train step at factor 1.3 sleeps (1.3 - 1) * 0.1 = 0.03 s more: 130 ms in all.
    assert slow.slowdown_s(0.1) == pytest.approx(0.03)
    # It never ends a rank nor touches its losses: only the step's time changes.
    slow.fire(rank=0, step=2)
    assert slow.loss_multipliers(rank=0, step=2, micro_batches=2) is None
    assert not Fault.parse("grad-scale:factor=2:rank=1:step=0").slows(rank=1, step=0, strategy="ddp")


@pytest.mark.parametrize("text, words", [
    ("slow-step:rank=all:step=0", ["factor"]),
    ("slow-step:factor=0.5:rank=all:step=0", ["factor must be >= 1"]),
    ("slow-step:factor=1.3:rank=all:step=0:strategy=dpp", ["'dpp'", "ddp", "zero3"]),
    ("grad-scale:factor=2:rank=all:step=0:strategy=ddp", ["strategy="]),
])
def test_a_malformed_slow_step_fault_is_a_one_line_error_naming_what_is_allowed(text, words):
    from harness.rank.faults import Fault

    with pytest.raises(ValueError) as error:
        Fault.parse(text)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and text in message
    for word in words:
        assert word in message, message


def test_a_slow_step_fault_sleeps_inside_each_timed_step_of_its_strategy_alone(monkeypatch):
    # The plain loop's rank program run here, in process, with a fault that triples its step. Every sleep
    # the fault asks for is recorded; time.sleep sleeps at least that long, so the recorded step times bound
    # it from above whatever the machine's load: a train step of e seconds sleeps (F - 1) * e inside the
    # timed region, which then lasts at least e + (F - 1) * e = F * e, so each sleep <= (F - 1) / F of its
    # step's recorded time (2/3 at F = 3). A sleep outside the region would leave steps shorter than that.
    import time
    import types

    import harness.rank.worker as worker
    from harness.rank.comm_counter import CollectiveCounter
    from harness.strategies import get_strategy

    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    clock = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    monkeypatch.setattr(worker, "time", types.SimpleNamespace(**{**clock, "sleep": sleep}))
    spec = next(s for s in cells(("plain",)) if s.strategy == "plain")
    strategy = get_strategy("plain")
    monkeypatch.setenv("PARBENCH_FAULT", "slow-step:factor=3:rank=all:step=0:strategy=ddp")
    worker.run_cell(spec, strategy, strategy.start(spec), CollectiveCounter())
    assert slept == []                           # another strategy's cell is left alone
    monkeypatch.setenv("PARBENCH_FAULT", "slow-step:factor=3:rank=all:step=0:strategy=plain")
    measurements = worker.run_cell(spec, strategy, strategy.start(spec), CollectiveCounter())
    steps = measurements["step_time_s"]
    assert len(slept) == spec.warmup_steps + spec.timed_steps and len(steps) == spec.timed_steps
    for sleep_s, step_s in zip(slept[spec.warmup_steps:], steps):
        assert 0 < sleep_s <= step_s * 2 / 3, (sleep_s, step_s)


@pytest.mark.launch
def test_a_failed_cell_makes_run_exit_4_after_the_rest_and_allow_failed_cells_exits_0(tmp_path, monkeypatch,
                                                                                         capsys):
    # The plain loop's one rank is killed at its first step: the cell's row says failed, and the exit status
    # must say so too, or a script running the image (scripts/docker-check.sh) cannot tell.
    monkeypatch.setenv("PARBENCH_FAULT", "kill:rank=0:step=0")
    out = tmp_path / "rows.jsonl"
    command = ["run", "--matrix", "smoke", "--workload", "gpt-tiny", "--strategy", "plain", "--warmup-steps", "1",
               "--timed-steps", "2", "--out", str(out)]
    assert main(command) == 4
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("parbench: 1 of 1 launches did not end ok (1 failed); exit 4"), last
    assert main([*command, "--allow-failed-cells"]) == 0
    assert "exit 0 as --allow-failed-cells asks" in capsys.readouterr().err
    assert [r.status for r in read_results([out])] == [Status.FAILED, Status.FAILED]


@pytest.mark.launch     # the row records the commit (git rev-parse)
def test_a_skipped_cell_is_not_a_failure_of_the_run(tmp_path, monkeypatch):
    hide_horovod(monkeypatch)                            # not installed: the cell is skipped, nothing launches
    out = tmp_path / "rows.jsonl"
    assert main(["run", "--matrix", "smoke", "--workload", "gpt-tiny", "--strategy", "horovod", "--world-sizes", "2",
                 "--out", str(out)]) == 0
    assert [r.status for r in read_results([out])] == [Status.SKIPPED]
