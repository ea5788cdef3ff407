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
    ("hang:rank=1:step=1", Status.TIMEOUT, 20, "all ranks killed"),
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
    monkeypatch.setitem(sys.modules, "horovod", None)   # find_spec answers None, as when not installed
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
