"""The activations a rank holds at a projected size (harness.project.projection.activations_at): every block whole
and every block checkpointed, split as the strategy splits a replica there, each figure worked out by hand from
the block's bytes (harness/derive/activations.py's docstring), not read from the code."""

from __future__ import annotations

from harness.derive.activations import rank_activation_bytes
from harness.project.facts import REGISTRY_FACTS
from harness.project.projection import Scaling, bases_from_rows, project
from harness.project.run import project_description
from test_project_hybrid import RING, _fsdp2_tp_row, _pipeline_row, _plain_row

GPT_TINY = {"family": "gpt", "seq_len": 64, "n_embd": 64, "n_head": 4, "n_layer": 4}


def test_a_described_gpt2_xl_holds_what_its_blocks_save_whole_and_checkpointed():
    # s 1024, h 1600, a 25, 48 blocks, one sample a device in fp32: a block saves s b h x (2 x 4 + 2 x 4 + 12 x 4)
    # = 1,638,400 x 64 = 104,857,600 B, its norms' statistics 16 s b = 16,384 B and the log-sum-exp 4 a s b =
    # 102,400 B: 104,976,384 B; 48 of them 5,038,866,432 B (4.69 GiB). Checkpointed, each keeps its input,
    # 4 s b h = 6,553,600 B: 314,572,800 B.
    points, _ = project_description(["ddp", "zero3"], RING, (8, 64), (Scaling.WEAK,), parameters=1_500_000_000,
                                    compute_s=0.12, recipe="fp32",
                                    shape={"seq_len": 1024, "n_embd": 1600, "n_head": 25, "n_layer": 48})
    assert {(p.activation_bytes_per_rank, p.activation_bytes_checkpointed_per_rank) for p in points} == {
        (5_038_866_432, 314_572_800)}
    # Without a shape, or under a recipe with bf16 weights (not what the block formula was measured on): none.
    bare, _ = project_description(["ddp"], RING, (8,), (Scaling.WEAK,), parameters=10**9, compute_s=0.1)
    assert bare[0].activation_bytes_per_rank is None
    bf16_weights, _ = project_description(["zero3"], RING, (8,), (Scaling.WEAK,), parameters=10**9, compute_s=0.1,
                                          recipe="deepspeed-bf16", shape={"seq_len": 8, "n_embd": 8, "n_head": 2,
                                                                          "n_layer": 2})
    assert bf16_weights[0].activation_bytes_checkpointed_per_rank is None


def test_fsdp2_tp_holds_its_tensor_parallel_share_at_every_size():
    # gpt-tiny at tp 2, micro-batch 4: whole 16,384 x 16 B, split 16,384 x 48 / 2 B, statistics 16 x 256 B and
    # 4 x 2 heads x 256 B a block: 661,504 B; 4 blocks 2,646,016 B (the census measured it on every tp rank:
    # tests/test_checkpointing.py); checkpointed 4 x 65,536 B.
    row = _fsdp2_tp_row()
    row["measurements"]["workload_description"] = GPT_TINY
    [basis], _ = bases_from_rows([row, _plain_row()], REGISTRY_FACTS)
    points, _ = project(basis, (8, 16), RING, REGISTRY_FACTS, (Scaling.WEAK,))
    assert [(p.world_size, p.activation_bytes_per_rank, p.activation_bytes_checkpointed_per_rank) for p in points] == [
        (8, 2_646_016, 262_144), (16, 2_646_016, 262_144)]


def test_a_pipeline_stage_holds_its_blocks_once_per_micro_batch_in_flight():
    # 2 stages over 8 ranks: 4 replicas of 2 stages, no tensor parallelism.
    assert REGISTRY_FACTS.model_split(workload="gpt-tiny", strategy="pipeline", options={"stages": 2}, precision="fp32",
                                      world_size=8, global_batch=64, micro_batch=4) == (1, 2)
    assert REGISTRY_FACTS.model_split(workload="gpt-tiny", strategy="fsdp2-tp", options={"tp": 4}, precision="fp32",
                                      world_size=8, global_batch=64, micro_batch=4) == (4, 1)
    # The first stage of 2 holds 2 of gpt-tiny's 4 blocks for 2 micro-batches in flight under 1F1B: 4 x 1,056,768 B
    # = 4,227,072 B, what the census measured on stage 0 beside its embedding's 5,120 B (4,232,192 B in all,
    # tests/test_checkpointing.py's pipeline row); with one micro-batch a step, one in flight.
    tiny = dict(seq_len=64, micro_batch=4, hidden=64, heads=4, layers=4, compute_bytes=4)
    assert rank_activation_bytes(**tiny, stages=2, micro_batches=4) == 4 * 1_056_768
    assert rank_activation_bytes(**tiny, stages=2, micro_batches=1) == 2 * 1_056_768
    assert rank_activation_bytes(**tiny, stages=3, micro_batches=8) == 2 * 3 * 1_056_768    # ceil(4 / 3) blocks
    # A measured pipeline cell (2 stages, micro-batches of 4, K = 4 a replica) carried to 8 ranks weakly: still 2
    # stages and 4 micro-batches, so 2 blocks x 2 in flight; checkpointed, 2 x 2 inputs of 65,536 B.
    row = _pipeline_row()
    row["measurements"]["workload_description"] = GPT_TINY
    [basis], _ = bases_from_rows([row, _plain_row()], REGISTRY_FACTS)
    [point] = project(basis, (8,), RING, REGISTRY_FACTS, (Scaling.WEAK,))[0]
    assert (point.micro_batches, point.activation_bytes_per_rank, point.activation_bytes_checkpointed_per_rank) == (
        4, 4 * 1_056_768, 4 * 65_536)


def test_a_bad_shape_is_one_line_before_anything_runs(capsys):
    from harness.cli import main

    for bad in ("1024,1600,25", "1024,1600,24,48", "0,64,4,4", "a,b,c,d"):
        assert main(["project", "--params", "1B", "--compute-ms", "10", "--shape", bad]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and "--shape" in lines[0] and "SEQ,HIDDEN,HEADS,LAYERS" in lines[0], lines
    # With measured rows the rows give the shape.
    assert main(["project", "rows.jsonl", "--shape", "8,8,2,2"]) == 2
    err = capsys.readouterr().err
    assert "--shape describes a model (--params)" in err
