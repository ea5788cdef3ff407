"""The `checkpoint` option's rules, the resume check and the checkpoint's expected size, on rows written out by hand.

The expected sizes are worked out here from gpt-tiny's counts (236,928 parameters, 53 state-dict tensors, a 32,768-
element tied embedding) and the bytes per parameter each library keeps, never by calling the code under test.
"""

import copy

import pytest

from harness.derive.resume import checkpoint_size_check, expected_checkpoint_bytes, resume_check
from harness.launch.launcher.base import Nodes
from harness.launch.launcher.torchrun import Torchrun
from harness.launch.launcher.base import Node
from harness.rank.checkpoint import DistributedCheckpoint, files_by_rank
from harness.rank.faults import Fault
from harness.spec import RunSpec, SpecError
from harness.strategies import STRATEGIES, checked, resolved_options

P = 236_928          # gpt-tiny's parameters
TIED = 32_768        # its token embedding, also the output head's weight


def spec(strategy="ddp", option="at:2", **fields):
    values = dict(workload="gpt-tiny", strategy=strategy, world_size=2, global_batch=16, micro_batch=4,
                  warmup_steps=3, timed_steps=3, options={"checkpoint": option})
    values.update(fields)
    return RunSpec(**values)


@pytest.mark.parametrize("option, fields, words", [
    ("at:3", {}, "1 <= K < warmup_steps = 3"),
    ("at:0", {}, "1 <= K < warmup_steps = 3"),
    ("every:2", {}, "not one of: none, at:K"),
    ("at:2:kill=2", {}, "2 < S < 6"),
    ("at:2:kill=6", {}, "2 < S < 6"),
    ("at:2:from=2", {}, "another world size"),
    ("at:2", {"precision": "fp16"}, "fp16 cells are not checkpointed"),
])
def test_a_checkpoint_cell_that_cannot_run_is_refused_in_one_line(option, fields, words):
    with pytest.raises(SpecError) as refused:
        checked(spec(option=option, **fields))
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_resharded_resume_is_refused_where_the_library_loads_only_at_its_own_world_size():
    with pytest.raises(SpecError, match="zero1 saves with deepspeed.*resharded resume is DCP's"):
        checked(spec("zero1", option="at:2:from=4", global_batch=32))
    checked(spec("ddp", option="at:2:from=4", global_batch=32))       # DCP reshards
    checked(spec("horovod", option="at:2:from=4", global_batch=32))   # one whole-state file, broadcast on load
    with pytest.raises(SpecError, match="no option 'checkpoint'"):
        checked(spec("ps", option="at:2"))                           # its servers hold the optimizer


def test_only_a_cell_with_a_planted_kill_asks_torchrun_to_restart():
    def argv(option):
        s = checked(spec(option=option))
        nodes = Nodes(spec=s, program=("-m", "x"), first_host="127.0.0.1", port="1234", host_slots="", hostfile="",
                      timeout_s=60, options=resolved_options(s))
        return Torchrun().argv(nodes, Node(rank="0"))
    assert "--max-restarts=1" in argv("at:2:kill=4")
    assert "--max-restarts=0" in argv("at:2")


def test_the_planted_checkpoint_bugs_take_every_rank_from_the_start():
    assert Fault.parse("checkpoint-without-optimizer:rank=all:step=0").kind == "checkpoint-without-optimizer"
    assert Fault.parse("resume-data-from-start:rank=all:step=0").kind == "resume-data-from-start"
    with pytest.raises(ValueError, match="rank=all:step=0 alone"):
        Fault.parse("resume-data-from-start:rank=1:step=0")
    kill = Fault.parse("kill:rank=1:step=4")
    assert kill.kills(1, 4) and not kill.kills(0, 4) and not kill.kills(1, 3)


# ---- the resume check ------------------------------------------------------------------------------------------------

PROBE = {"gradient_norm_first_step": 0.6, "parameter_norm_after_first_step": 40.0, "update_norm_first_step": 0.29,
         "gradient_norm_by_tensor_first_step": {"a": 0.3, "b": 0.5}, "update_norm_by_tensor_first_step": {"a": 0.2,
                                                                                                           "b": 0.21}}
LOSSES = [6.2514, 6.2437, 6.2329, 6.2138, 6.1923, 6.2083]


def resumed_row(losses=LOSSES, probe=PROBE):
    return {"spec": checked(spec()).to_dict(),
            "measurements": {"loss_per_step": list(losses), "precision_recipe": "fp32",
                             "gradient_reduce_dtypes": ["float32"], "checkpoint_probe": {"step": 2, **probe},
                             "checkpoint": {"resumed_from_step": 2, "saved_at_world_size": 2},
                             "resume_reference": {"world_size": 2, "loss_per_step": list(LOSSES),
                                                  "probe": {"step": 2, **PROBE}}}}


def test_a_resume_that_reproduces_the_uninterrupted_steps_matches():
    assert resume_check(resumed_row())["verdict"] == "match"


def test_a_resume_without_the_optimizer_state_fails_on_its_update():
    # AdamW restarted: step K's update is lr x sign-like, larger than the uninterrupted 0.29; the losses of step K and
    # the gradient are the restored weights', unchanged.
    probe = {**PROBE, "update_norm_first_step": 0.48, "update_norm_by_tensor_first_step": {"a": 0.34, "b": 0.34}}
    check = resume_check(resumed_row(probe=probe))
    assert check["verdict"] == "mismatch"
    assert "update_norm_first_step" in check["failed"]


def test_a_resume_that_reads_the_first_batches_again_fails_on_its_loss():
    losses = LOSSES[:2] + [6.2437 - 0.0001, 6.2329, 6.2138, 6.1923]     # step 2 sees step 0's data again
    check = resume_check(resumed_row(losses=losses, probe={**PROBE, "gradient_norm_first_step": 0.61}))
    assert check["verdict"] == "mismatch"
    assert {"loss_first_step", "gradient_norm_first_step"} <= set(check["failed"])


def test_a_difference_parity_allows_still_matches_and_one_beyond_it_does_not():
    # fp32: a tensor's norm within 1e-5 of the uninterrupted one's matches; Horovod's documented broadcast order left
    # the non-root ranks one AdamW weight decay (lr x wd = 1e-5) off, and per-tensor norms 1.8e-5 off.
    close = copy.deepcopy(PROBE)
    close["gradient_norm_by_tensor_first_step"]["a"] = 0.3 * (1 + 5e-6)
    assert resume_check(resumed_row(probe=close))["verdict"] == "match"
    far = copy.deepcopy(PROBE)
    far["gradient_norm_by_tensor_first_step"]["a"] = 0.3 * (1 + 1.8e-5)
    assert resume_check(resumed_row(probe=far))["failed"] == ["gradient_norm_by_tensor_first_step"]


def test_a_resumed_launch_that_read_no_norms_where_the_uninterrupted_one_did_fails():
    check = resume_check(resumed_row(probe={}))
    assert check["verdict"] == "mismatch" and "norms missing" in check["failed"]


def test_a_restart_whose_planted_kill_never_fired_is_not_judged():
    row = resumed_row()
    row["measurements"]["checkpoint"].update(role="restart", restarts=0)
    assert resume_check(row)["verdict"] == "not judged"
    row["measurements"]["checkpoint"].update(killed_at_step=4, restarts=1)
    assert resume_check(row)["verdict"] == "match"


def test_every_resumed_step_is_compared_not_only_parity_s_first_four():
    # Ten steps resumed from step 2; the last drifts by 0.01, ten times the uninterrupted run's largest move of 0.001
    # (parity's first four steps, 2 to 5, are equal).
    losses = [6.0 - 0.001 * step for step in range(12)]
    row = resumed_row(losses=losses[:11] + [losses[11] + 0.01])
    row["measurements"]["resume_reference"]["loss_per_step"] = losses
    check = resume_check(row)
    assert check["verdict"] == "mismatch" and check["failed"] == ["loss_later_steps"]
    assert check["deviations"]["loss_later_steps"] == pytest.approx(10.0)


def test_a_resume_at_another_world_size_says_so():
    row = resumed_row()
    row["measurements"]["checkpoint"].update(saved_at_world_size=2, resumed_at_world_size=1)
    assert "resumed at 1" in resume_check(row)["note"]


# ---- the checkpoint's size ---------------------------------------------------------------------------------------------

def size_row(method, plan, holds, held=(P, P), data_parallel=2, tensor_bytes=(0, 0), written=(0, 0)):
    return {"model_state_plan": {name: {"bytes_per_parameter": b, "sharded_over": s, "on_host": False}
                                 for name, (b, s) in plan.items()},
            "parameters": P, "parameters_held_by_rank": list(held), "data_parallel": data_parallel,
            "checkpoint": {"method": method, "holds": list(holds), "tied_parameters": TIED,
                           "saved_at_world_size": len(held), "tensor_bytes_by_rank": list(tensor_bytes),
                           "bytes_by_rank": list(written)}}


WHOLE_FP32 = {"weights": (4, 1), "gradients": (4, 1), "optimizer": (8, 1)}
BOTH = ("weights", "optimizer")


def test_a_replicated_checkpoint_holds_the_model_once_and_dcp_writes_the_tied_weight_twice():
    # DDP over DCP: weights 4 + AdamW's moments 8 = 12 bytes per parameter, once over the job (not per rank), and the
    # tied embedding under both its names: 12 x 236,928 + 4 x 32,768 = 2,843,136 + 131,072 = 2,974,208.
    assert expected_checkpoint_bytes(size_row("dcp", WHOLE_FP32, BOTH)) == 2_974_208
    # Horovod's rank 0 torch.save keeps a shared storage once: 2,843,136.
    assert expected_checkpoint_bytes(size_row("horovod rank 0", WHOLE_FP32, BOTH)) == 2_843_136


def test_tensor_parallel_ranks_replicating_a_parameter_do_not_count_it_twice():
    # tp at 2 ranks: each holds 137,728 parameters (its slices and the replicated LayerNorms and embeddings), 275,456
    # in all against the model's 236,928; DCP writes a replicated tensor once, so still 12 x 236,928 + 4 x 32,768.
    row = size_row("dcp", WHOLE_FP32, BOTH, held=(137_728, 137_728), data_parallel=1)
    assert expected_checkpoint_bytes(row) == 2_974_208


def test_a_zero_checkpoint_holds_its_partitions_once_and_zero3_no_separate_weights():
    # DeepSpeed's files: ZeRO-1/2 the module's weights (rank 0) and each rank's optimizer partition; ZeRO-3 only the
    # partitions, whose fp32 master copy is the weights (zero_to_fp32.py rebuilds the model from them alone).
    assert STRATEGIES["zero1"].checkpoint_holds({}) == BOTH
    assert STRATEGIES["zero3"].checkpoint_holds({}) == ("optimizer",)
    zero1 = {"weights": (4, 1), "gradients": (4, 1), "optimizer": (12, 2)}
    # ZeRO-1: 4 x 236,928 + 2 ranks x 236,928 x 12 / 2 = 947,712 + 2,843,136 = 3,790,848 (16 bytes per parameter).
    assert expected_checkpoint_bytes(size_row("deepspeed", zero1, BOTH)) == 3_790_848
    zero3 = {"weights": (4, 2), "gradients": (4, 2), "optimizer": (12, 2)}
    # ZeRO-3: 2 ranks x 236,928 x 12 / 2 = 2,843,136.
    assert expected_checkpoint_bytes(size_row("deepspeed", zero3, ("optimizer",))) == 2_843_136


def test_a_pipeline_checkpoint_adds_each_stages_optimizer_and_the_weights_once():
    # Two stages as the fault-tolerance row holds them: 136,832 and 136,960 parameters (273,792: the tied embedding on
    # both). Weights once, 4 x 236,928 = 947,712 (DeepSpeed skips the second stage's tied copy); each stage's AdamW
    # state for what it holds, 8 x 273,792 = 2,190,336: 3,138,048.
    row = size_row("deepspeed", WHOLE_FP32, BOTH, held=(136_832, 136_960), data_parallel=1)
    assert expected_checkpoint_bytes(row) == 3_138_048


def test_the_size_check_holds_the_tensor_bytes_within_five_percent_and_reports_the_formats_overhead():
    row = size_row("dcp", WHOLE_FP32, BOTH, tensor_bytes=(1_487_200, 1_487_216), written=(1_690_464, 1_690_537))
    check = checkpoint_size_check(row)
    assert check["holds"] and check["measured"] == 2_974_416
    assert check["overhead"] == 3_381_001 - 2_974_416                 # 406,585 B of headers and .metadata
    # 5% of 2,974,208 is 148,710.4: 3,122,918 holds, 3,122,919 does not.
    row["checkpoint"]["tensor_bytes_by_rank"] = [1_487_200, 3_122_918 - 1_487_200]
    assert checkpoint_size_check(row)["holds"]
    row["checkpoint"]["tensor_bytes_by_rank"] = [1_487_200, 3_122_919 - 1_487_200]
    assert not checkpoint_size_check(row)["holds"]
    # A save that also wrote the gradients (4 x 236,928 = 947,712 more), one without the weights, or one without
    # AdamW's moments (8 x 236,928 = 1,895,424 fewer) is beyond it.
    for wrong in (2_974_416 + 947_712, 2_974_416 - 947_712, 2_974_416 - 1_895_424):
        row["checkpoint"]["tensor_bytes_by_rank"] = [wrong, 0]
        assert not checkpoint_size_check(row)["holds"], wrong


def test_each_file_is_counted_on_the_rank_that_wrote_it_with_the_tensor_bytes_it_holds(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    # One process's DCP save: rank 0's __0_0.distcp and .metadata; its tensors 10 fp32 + 3 fp64 = 40 + 24 = 64 bytes.
    dcp.save({"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.float64)}, checkpoint_id=str(tmp_path), no_dist=True)
    by_rank = files_by_rank(DistributedCheckpoint(), tmp_path, [[], []])
    assert by_rank["files_by_rank"] == [2, 0] and by_rank["tensor_bytes_by_rank"] == [64, 0]
    assert by_rank["bytes_by_rank"][0] == sum(p.stat().st_size for p in tmp_path.iterdir())
    # A file a rank's torch.save wrote is that rank's, whatever its name: 5 fp32 elements shared by two names, 20 bytes.
    shared = torch.ones(5)
    saved = tmp_path / "optim.pt"
    torch.save({"x": shared, "y": shared}, saved)
    by_rank = files_by_rank(DistributedCheckpoint(), tmp_path, [[], [str(saved.resolve())]])
    assert by_rank["tensor_bytes_by_rank"] == [64, 20] and by_rank["files_by_rank"] == [2, 1]


def test_a_cell_that_loses_a_node_keeps_its_nodes_where_placement_would_pack_it_onto_one():
    from harness.launch.placement import HostfilePlacement
    from harness.launch.placement.base import Host

    leaving = checked(spec(option="at:2:leave=4", nnodes=2))
    two_hosts = HostfilePlacement(hosts=(Host("a", 8), Host("b", 8)), nnodes=2)
    assert two_hosts.place(leaving, 8).nnodes == 2
    assert two_hosts.place(checked(spec(option="at:2")), 8).nnodes == 1      # any other cell fits one host of 8
    with pytest.raises(SpecError, match="loses one of its 2 nodes on purpose, and this placement has 1"):
        HostfilePlacement(hosts=(Host("a", 8),), nnodes=1).place(leaving, 8)
    with pytest.raises(SpecError, match="a node can leave only a cell of 2 or more nodes"):
        checked(spec(option="at:2:leave=4"))


def test_a_horovod_cell_that_loses_a_rank_runs_under_horovod_elastic_without_both_tuning_flags():
    from harness.launch.launcher.horovodrun import Horovodrun

    def argv(**options):
        s = checked(spec("horovod", **options))
        nodes = Nodes(spec=s, program=("-m", "x"), first_host="127.0.0.1", port="", host_slots="localhost:2",
                      hostfile="", timeout_s=60, options=resolved_options(s))
        return Horovodrun().argv(nodes, Node(rank="0"))
    elastic = argv(option="at:2:kill=4")
    assert elastic[elastic.index("--host-discovery-script") + 1] == "echo localhost:1; echo 127.0.0.1:1"
    assert elastic[elastic.index("--min-np") + 1] == "1" and "-H" not in elastic
    # At Horovod's own values neither flag is passed: both together crash hvd.init() after a lost rank.
    assert "--fusion-threshold-mb" not in elastic and "--cycle-time-ms" not in elastic
    plain = argv(option="at:2")
    assert plain[plain.index("-H") + 1] == "localhost:2" and "--fusion-threshold-mb" in plain
    with pytest.raises(SpecError, match="keep one at Horovod's own value"):
        checked(spec("horovod", option="at:2:kill=4").replace(options={"checkpoint": "at:2:kill=4",
                                                                        "fusion_threshold_mb": 64,
                                                                        "cycle_time_ms": 5.0}))


def test_the_report_line_gives_the_save_the_tensor_bytes_against_the_plan_and_the_recovery():
    import pandas as pd

    from harness.report.checkpoint import checkpoint_lines

    cells = pd.DataFrame([{"label": "gpt-tiny/ddp[checkpoint=at:2:kill=4]/ws2", "status": "ok", "options": "",
                           "checkpoint_method": "dcp", "checkpoint_save_s": 0.2, "checkpoint_save_GBps": 3_381_001 / 0.2
                           / 1e9, "checkpoint_bytes": 3_381_001, "checkpoint_files": 3,
                           "checkpoint_tensor_bytes": 2_974_416, "checkpoint_bytes_expected": 2_974_208,
                           "checkpoint_size_holds": True, "checkpoint_load_s": 0.25, "resume": "match",
                           "resume_failed": "", "recovery_s": 3.14, "restarts": 1, "steps_recomputed": 2},
                          {"label": "gpt-tiny/zero1[checkpoint=at:2:kill=4]/ws2", "status": "failed",
                           "options": "checkpoint=at:2:kill=4", "message": "rank 1 was killed (SIGKILL, planted)",
                           "checkpoint_method": None}])
    ddp, zero1 = checkpoint_lines(cells)
    # 3,381,001 B / 0.2 s = 0.017 GB/s; 2,974,416 / 2,974,208 - 1 = +0.0070%; 3,381,001 - 2,974,416 = 406,585 B.
    assert "dcp saved in 0.200 s, 0.017 GB/s, 3.38 MB in 3 files" in ddp
    assert "tensors 2.97 MB, +0.01% against the plan's 2.97 MB (within 5%), the formats' overhead 407 KB" in ddp
    assert "loaded in 0.250 s; resumed steps: match" in ddp
    assert "recovered in 3.1 s with 2 steps recomputed" in ddp
    assert zero1.endswith("failed: rank 1 was killed (SIGKILL, planted)")


def test_a_cells_resume_verdict_is_its_worst_launchs_in_either_file_order():
    # Two launches of one checkpoint cell: one resumed exactly, one without AdamW's state (the planted
    # `checkpoint-without-optimizer`). The cell resumes wrong whichever launch is read first.
    from harness.derive.cells import cell_table
    from harness.report.checkpoint import checkpoint_lines

    def launch(run_id, probe):
        row = resumed_row(probe=probe)
        row.update(status="ok", run_id=run_id, repeat=int(run_id[-1]), message="")
        row["measurements"]["checkpoint"].update(method="dcp", save_s_by_rank=[0.1, 0.1], bytes_by_rank=[10, 10],
                                                 files_by_rank=[1, 1])
        return row

    good = launch("good-0", PROBE)
    planted = launch("planted-1", {**PROBE, "update_norm_first_step": 0.48,
                                   "update_norm_by_tensor_first_step": {"a": 0.34, "b": 0.34}})
    for rows in ([good, planted], [planted, good]):
        cell = cell_table(rows).iloc[0]
        assert cell["resume"] == "mismatch" and "update_norm_first_step" in cell["resume_failed"]
        assert "resumed steps: mismatch (" in checkpoint_lines(cell_table(rows))[0]


def test_a_cells_size_check_is_its_launch_furthest_off_the_plan_with_that_launchs_own_verdict():
    # The figures and the verdict beside them come from one launch: a size 31.86% short is never "within 5%".
    from harness.derive.cells import _worst_checkpoint

    near = {"checkpoint_tensor_bytes": 1_000_100, "checkpoint_bytes_expected": 1_000_000, "checkpoint_size_holds": True}
    short = {"checkpoint_tensor_bytes": 681_400, "checkpoint_bytes_expected": 1_000_000, "checkpoint_size_holds": False}
    for launches in ([near, short], [short, near]):
        worst = _worst_checkpoint(launches)
        assert (worst["checkpoint_tensor_bytes"], worst["checkpoint_size_holds"]) == (681_400, False)


def test_a_resume_or_parity_mismatch_makes_run_exit_with_the_check_failed_status(capsys):
    from harness.cli.run import EXIT_CHECK_FAILED, failed_checks, run_exit_status
    from harness.spec import RunResult, Status

    planted = {**resumed_row(probe={**PROBE, "update_norm_first_step": 0.48}), "status": "ok", "run_id": "p"}
    found = failed_checks([planted])
    assert len(found) == 1 and found[0].endswith("resume mismatch (update_norm_first_step)")
    ran = [RunResult(spec=checked(spec()), status=Status.OK, run_id="p")]
    assert run_exit_status(ran, allow_failed=False, checks_failed=found) == EXIT_CHECK_FAILED == 5
    assert "1 launches failed a check: " in capsys.readouterr().err
    assert run_exit_status(ran, allow_failed=True, checks_failed=found) == 0
    assert failed_checks([{**resumed_row(), "status": "ok", "run_id": "g"}]) == []      # an exact resume passes
