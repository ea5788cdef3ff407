"""Checkpoint cells beyond the fault-tolerance matrix's own (tests/test_checkpoint_cells.py): the planted checkpoint
bugs make the resume check fail, and a node that leaves an emulated cluster shrinks the job, which resumes at the
smaller world size, as a rank that leaves Horovod Elastic does."""

import pytest

from harness.cli import main
from harness.derive.resume import resume_check
from harness.record import read_results
from harness.spec import Status
from launch_streams import Stream, run_streams
from tests.test_checkpoint_cells import FAULT_TOLERANCE
from tests.test_emulate import needs_namespaces
from tests.test_faults import leftover_ranks

pytestmark = [pytest.mark.launch, pytest.mark.matrix]

PLANTED_BUGS = [("ddp", "checkpoint-without-optimizer"), ("zero1", "checkpoint-without-optimizer"),
                ("horovod", "checkpoint-without-optimizer"), ("plain", "checkpoint-without-optimizer"),
                # The data position is the worker loop's, whatever the library.
                ("ddp", "resume-data-from-start")]


@pytest.fixture(scope="module")
def planted_bug_rows(tmp_path_factory):
    """{(strategy, bug): the `at:2` cell's row with the bug planted}, two launches side by side."""
    streams = [Stream(f"{strategy}-{bug}", ("--strategy", strategy, "--world-sizes", "2", "--option", "checkpoint=at:2"),
                      {"PARBENCH_FAULT": f"{bug}:rank=all:step=0"}, common=FAULT_TOLERANCE)
               for strategy, bug in PLANTED_BUGS]
    launched = run_streams(tmp_path_factory.mktemp("planted-bugs"), streams)
    return {(strategy, bug): launched[f"{strategy}-{bug}"] for strategy, bug in PLANTED_BUGS}


@pytest.mark.parametrize("strategy, bug", PLANTED_BUGS)
def test_a_planted_checkpoint_bug_fails_the_resume_check(planted_bug_rows, strategy, bug):
    [result] = planted_bug_rows[strategy, bug]
    assert result.status is Status.OK, result.message
    row = result.to_dict()
    assert row["environment"]["env"]["PARBENCH_FAULT"] == f"{bug}:rank=all:step=0"
    check = resume_check(row)
    assert check["verdict"] == "mismatch", check
    expected = "update_norm_first_step" if bug == "checkpoint-without-optimizer" else "loss_first_step"
    assert expected in check["failed"], check


@needs_namespaces
def test_on_an_emulated_cluster_a_node_leaves_torchrun_and_a_rank_leaves_horovod_elastic(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert main(["run", "--matrix", "fault-tolerance", "--strategy", "ddp,horovod", "--world-sizes", "2",
                 "--emulate-link", "10gbit", "--emulate-nodes", "2", "--out", str(out), "--timeout", "300"]) == 0
    rows = {(r.spec.strategy, dict(r.spec.options)["checkpoint"]): r.to_dict() for r in read_results([out])}
    for strategy, option in (("ddp", "at:2:leave=4"), ("horovod", "at:2:kill=4")):
        row = rows[(strategy, option)]
        assert row["status"] == "ok", row["message"]
        assert row["spec"]["world_size"] == 2 and row["spec"]["nnodes"] == 2
        record = row["measurements"]["checkpoint"]
        assert record["resumed_at_world_size"] == 1 and record["saved_at_world_size"] == 2   # a node's rank left
        assert record["restarts"] == 1 and record["steps_recomputed"] == 2 and record["recovery_s"] > 0
        check = resume_check(row)
        assert check["verdict"] == "match" and "resumed at 1" in check["note"], (strategy, check)
    assert not leftover_ranks()
