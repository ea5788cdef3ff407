"""Checkpoint cells on real launches (the fault-tolerance matrix, gpt-tiny, fp32, 2-core CPU), the torch strategies':
every one that checkpoints resumes from its library's save in new processes and reproduces its uninterrupted steps;
DCP reshards 2 -> 4 and 4 -> 2; a rank killed under torchrun --max-restarts 1 recovers from the save. The DeepSpeed
strategies' and Horovod's cells are tests/test_checkpoint_cells_deepspeed.py's; a node that leaves an emulated cluster,
and the planted checkpoint bugs that make the resume check fail, tests/test_checkpoint_faults.py's: a module each, so
that CI's launch tier can take each in its budget (tests/launch_budget.py)."""

import pytest

from harness.derive.resume import checkpoint_size_check, resume_check
from harness.matrix import Machine, Selection, build_matrix
from harness.spec import DeviceKind
from harness.strategies import STRATEGIES
from launch_streams import Stream, run_streams
from tests.test_faults import leftover_ranks

pytestmark = [pytest.mark.launch, pytest.mark.matrix]
MACHINE = Machine(device=DeviceKind.CPU, devices_per_node=2)
CHECKPOINTING = [name for name, strategy in STRATEGIES.items() if strategy.checkpoint_method and name != "dataparallel"]


# The fault-tolerance matrix as `python -m harness run` streams, two side by side (tests/launch_streams.py: a launch
# leaves a core idle for much of its start-up); ZeRO-1's kill fails on purpose, so failed cells are let through.
FAULT_TOLERANCE = ("run", "--matrix", "fault-tolerance", "--device", "cpu", "--cpus-per-node", "2", "--timeout", "300",
                   "--allow-failed-cells")
# Its 21 cells in two modules, so that CI's launch tier can take each in its budget (tests/launch_budget.py): the torch
# strategies' 12 here, the DeepSpeed strategies' and Horovod's 9 in tests/test_checkpoint_cells_deepspeed.py; each
# module's two streams about even.
TORCH_STREAMS = (("plain", "dataparallel", "ddp", "tp"), ("fsdp2", "fsdp2-tp"))


def fault_tolerance_rows(tmp_path, groups: tuple[tuple[str, ...], ...]) -> dict:
    """{(strategy, world size, checkpoint option): the row} of the fault-tolerance matrix's cells of these strategies,
    each group a stream, the streams side by side; every cell of theirs, once."""
    streams = [Stream(f"fault-tolerance-{n}", ("--strategy", ",".join(group)), common=FAULT_TOLERANCE)
               for n, group in enumerate(groups)]
    results = [row for stream in run_streams(tmp_path, streams).values() for row in stream]
    assert not leftover_ranks()
    cells = {(r.spec.strategy, r.spec.world_size, dict(r.spec.options)["checkpoint"]): r.to_dict() for r in results}
    chosen = {name for group in groups for name in group}
    assert len(cells) == len([spec for spec in build_matrix("fault-tolerance", MACHINE, Selection())
                              if spec.strategy in chosen])     # every cell, once
    return cells


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return fault_tolerance_rows(tmp_path_factory.mktemp("fault-tolerance"), TORCH_STREAMS)


@pytest.mark.parametrize("strategy", [name for name in CHECKPOINTING if name in sum(TORCH_STREAMS, ())])
def test_each_strategy_resumes_from_its_own_save_as_if_never_stopped(rows, strategy):
    check_resumes_from_its_own_save(rows, strategy)


def check_resumes_from_its_own_save(rows: dict, strategy: str) -> None:
    row = rows[(strategy, 1 if strategy == "plain" else 2, "at:2")]
    assert row["status"] == "ok", row["message"]
    check = resume_check(row)
    assert check["verdict"] == "match", check
    m = row["measurements"]
    # Steps 0 and 1 come from the save's record; steps 2.. were trained by the resumed launch.
    assert m["loss_per_step"][:2] == m["resume_reference"]["loss_per_step"][:2]
    assert m["checkpoint"]["resumed_from_step"] == 2 and len(m["loss_per_step"]) == 6
    assert m["checkpoint"]["method"] == STRATEGIES[strategy].checkpoint_method
    size = checkpoint_size_check(m)
    assert size is not None and size["holds"], size


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("world_size, saved_at", [(4, 2), (2, 4)])
def test_dcp_resumes_at_another_world_size(rows, strategy, world_size, saved_at):
    check_resumes_at_another_world_size(rows, strategy, world_size, saved_at)


def check_resumes_at_another_world_size(rows: dict, strategy: str, world_size: int, saved_at: int) -> None:
    row = rows[(strategy, world_size, f"at:2:from={saved_at}")]
    assert row["status"] == "ok", row["message"]
    assert row["measurements"]["checkpoint"]["saved_at_world_size"] == saved_at
    assert len(row["measurements"]["checkpoint"]["bytes_by_rank"]) == saved_at
    assert row["measurements"]["resume_reference"]["world_size"] == world_size     # held against its own size
    assert resume_check(row)["verdict"] == "match", resume_check(row)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_rank_killed_under_torchrun_is_restarted_from_the_save(rows, strategy):
    row = rows[(strategy, 2, "at:2:kill=4")]
    assert row["status"] == "ok", row["message"]
    record = row["measurements"]["checkpoint"]
    assert record["restarts"] == 1 and record["killed_rank"] == 1 and record["killed_at_step"] == 4
    assert record["steps_recomputed"] == 2                  # steps 2 and 3 ran before the kill and again after it
    assert record["recovery_s"] > 0
    assert resume_check(row)["verdict"] == "match"
