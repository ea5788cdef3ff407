"""Checkpoint cells on real launches (the fault-tolerance matrix, gpt-tiny, fp32, 2-core CPU): every strategy that
checkpoints resumes from its library's save in new processes and reproduces its uninterrupted steps; DCP reshards
2 -> 4 and 4 -> 2, and so does Horovod's rank-0 file; a rank killed under torchrun --max-restarts 1 recovers from the save, and under launchers that
restart nothing the cell fails naming the kill, and under Horovod Elastic the others go on from their commit; a node
that leaves an emulated cluster shrinks the job, which resumes at the smaller world size (tests/test_checkpoint_faults.py,
with the planted checkpoint bugs that make the resume check fail: a module of its own, so that CI's launch tier can
take each in its budget, tests/launch_budget.py)."""

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
# The DeepSpeed strategies and Horovod (9 cells) beside the torch ones (12): about even, launched one at a time.
DEEPSPEED_AND_HOROVOD = ("zero1", "zero2", "zero3", "pipeline", "horovod")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """{(strategy, world size, checkpoint option): the row} of one run of the fault-tolerance matrix."""
    matrix = build_matrix("fault-tolerance", MACHINE, Selection())
    others = tuple(dict.fromkeys(spec.strategy for spec in matrix if spec.strategy not in DEEPSPEED_AND_HOROVOD))
    streams = [Stream(f"fault-tolerance-{n}", ("--strategy", ",".join(group)), common=FAULT_TOLERANCE)
               for n, group in enumerate((others, DEEPSPEED_AND_HOROVOD))]
    results = [row for stream in run_streams(tmp_path_factory.mktemp("fault-tolerance"), streams).values()
               for row in stream]
    assert not leftover_ranks()
    cells = {(r.spec.strategy, r.spec.world_size, dict(r.spec.options)["checkpoint"]): r.to_dict() for r in results}
    assert len(cells) == len(matrix)     # every cell, once
    return cells


@pytest.mark.parametrize("strategy", CHECKPOINTING)
def test_each_strategy_resumes_from_its_own_save_as_if_never_stopped(rows, strategy):
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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "horovod"])
@pytest.mark.parametrize("world_size, saved_at", [(4, 2), (2, 4)])
def test_dcp_and_horovods_file_resume_at_another_world_size(rows, strategy, world_size, saved_at):
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


def test_a_rank_killed_under_a_launcher_without_restart_fails_naming_the_kill(rows):
    row = rows[("zero1", 2, "at:2:kill=4")]
    assert row["status"] == "failed"
    assert "rank 1 was killed (SIGKILL, planted) at step 4" in row["message"]
    assert "restarts nothing (deepspeed has no restart" in row["message"]


def test_a_rank_killed_under_horovod_elastic_leaves_the_others_going_on_from_their_commit(rows):
    # One machine: Horovod Elastic is told of it as two hosts, localhost and 127.0.0.1; the killed rank's leaves.
    row = rows[("horovod", 2, "at:2:kill=4")]
    assert row["status"] == "ok", row["message"]
    record = row["measurements"]["checkpoint"]
    assert record["restored_from"] == "Horovod Elastic's commit in memory" and record["restarts"] == 1
    assert record["resumed_at_world_size"] == 1 and record["steps_recomputed"] == 2 and record["recovery_s"] > 0
    check = resume_check(row)
    assert check["verdict"] == "match", check
    # Steps 0 and 1 are the save's record of both ranks' losses, not the survivor's own.
    assert row["measurements"]["loss_per_step"][:2] == row["measurements"]["resume_reference"]["loss_per_step"][:2]
