"""The fault-tolerance matrix's DeepSpeed and Horovod cells on real launches (gpt-tiny, fp32, 2-core CPU): ZeRO-1/2/3,
the pipeline and Horovod resume from their library's save in new processes and reproduce their uninterrupted steps;
Horovod's rank-0 file reshards 2 -> 4 and 4 -> 2; a rank killed under DeepSpeed's launcher, which restarts nothing,
fails the cell naming the kill, and under Horovod Elastic the others go on from their commit. The torch strategies'
cells are tests/test_checkpoint_cells.py's: a module each, so that CI's launch tier can take each in its budget."""

import pytest

from harness.derive.resume import resume_check
from harness.matrix import Selection, build_matrix
from tests.test_checkpoint_cells import (CHECKPOINTING, MACHINE, TORCH_STREAMS, check_resumes_at_another_world_size,
                                         check_resumes_from_its_own_save, fault_tolerance_rows)

pytestmark = [pytest.mark.launch, pytest.mark.matrix]
# Horovod's four cells (its elastic kill the longest) beside the DeepSpeed strategies' five.
DEEPSPEED_AND_HOROVOD_STREAMS = (("horovod",), ("zero1", "zero2", "zero3", "pipeline"))


def test_the_two_modules_take_every_strategy_of_the_fault_tolerance_matrix_once():
    here, there = sum(DEEPSPEED_AND_HOROVOD_STREAMS, ()), sum(TORCH_STREAMS, ())
    assert not set(here) & set(there)
    assert set(here) | set(there) == {spec.strategy for spec in build_matrix("fault-tolerance", MACHINE, Selection())}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return fault_tolerance_rows(tmp_path_factory.mktemp("fault-tolerance"), DEEPSPEED_AND_HOROVOD_STREAMS)


@pytest.mark.parametrize("strategy", [name for name in CHECKPOINTING if name in sum(DEEPSPEED_AND_HOROVOD_STREAMS, ())])
def test_each_strategy_resumes_from_its_own_save_as_if_never_stopped(rows, strategy):
    check_resumes_from_its_own_save(rows, strategy)


@pytest.mark.parametrize("world_size, saved_at", [(4, 2), (2, 4)])
def test_horovods_file_resumes_at_another_world_size(rows, world_size, saved_at):
    check_resumes_at_another_world_size(rows, "horovod", world_size, saved_at)


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
