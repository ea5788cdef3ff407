"""A 32k-token sequence in `harness plan` and `harness memory`: Ulysses (DeepSpeed's, under ZeRO) and torch's ring
(`cp`, under FSDP2) laid out at each degree, each rank's activations and logits at its share of the tokens, and the
exchanges around attention priced; each figure worked by hand from Llama 3 8B's published shape
(meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32 heads, 8 key/value heads of 128, intermediate
14336, vocabulary 128,256, untied; 8,030,261,248 parameters) at 32,768 tokens on one node of 8 H100s (80 GiB)."""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.project.cluster import preset as cluster_preset
from harness.project.layouts import attention_schedule, layout_at, memory_of
from harness.project.model import described
from harness.project.plan import Settings, plan

GIB = float(1 << 30)
S, H, A, KV, D, I, L, V, N = 32_768, 4096, 32, 8, 128, 14_336, 32, 128_256, 8_030_261_248


@pytest.fixture(scope="module")
def planned():
    model = described("llama3-8b", None, None, S)
    return plan(model, cluster_preset("dgx-h100-ib"), 1, Settings(global_batch=128, tokens=1e9))


def test_only_a_sequence_split_or_the_deepest_pipeline_fits_32k_tokens_on_8_gpus(planned):
    fitting = {p.layout.label for p in planned if p.fits}
    unsplit = {label for label in fitting if not label.startswith(("ulysses", "cp"))}
    # Without a split every layout holds a whole sample's logits: 32,768 x 128,256 x (4 saved + 2 held + 8 in the
    # loss's backward) bytes = 54.8 GiB, beside its activations; only 8 stages checkpointed leave room for them.
    assert round(S * V * 14 / GIB, 1) == 54.8
    assert unsplit == {"pipeline pp=8 x dp=1 ckpt"}
    # Of the 39 that do not fit, all but DDP's and Horovod's (whose replicated states, 16 B a parameter, are 120 GiB)
    # would fit were it not for their activations and logits, which a split divides.
    unfit = [p for p in planned if not p.fits and not p.refusal and not p.layout.label.startswith(("ulysses", "cp"))]
    assert len(unfit) == 39
    for p in unfit:
        rest = p.memory.states + p.memory.working_total + p.memory.allowance
        states_bound = p.layout.strategy in ("ddp", "horovod")
        assert (rest > 80 * GIB) == states_bound and p.need_bytes > 80 * GIB, p.layout.label
        if not states_bound:
            assert p.memory.activations + p.memory.logits > 80 * GIB - rest, p.layout.label
    # Ulysses and the ring at every degree the heads, key/value heads and GPUs allow: 2, 4 and 8.
    for degree in (2, 4, 8):
        assert f"cp dp={8 // degree} x cp={degree} rs-every ckpt" in fitting
        assert f"ulysses dp={8 // degree} x cp={degree} zero2 ckpt" in fitting
    # The fastest within the error are splits without recomputation: over all 8 GPUs, and Ulysses' ZeRO-3 over 4.
    assert {p.layout.label for p in planned if p.tied} == {
        "ulysses dp=2 x cp=4 zero3", "ulysses dp=1 x cp=8 zero3", "ulysses dp=1 x cp=8 zero1",
        "ulysses dp=1 x cp=8 zero2", "cp dp=1 x cp=8", "cp dp=1 x cp=8 rs-every"}


def test_a_ring_rank_holds_its_tokens_activations_and_logits_worked_by_hand(planned):
    [ring] = [p for p in planned if p.layout.label == "cp dp=1 x cp=8 rs-every"]
    tokens = S // 8                                                   # 4,096 a rank, one sample a micro-batch
    # Llama's block under FSDP2's bf16 weights on CUDA (fused RMSNorm): the norms' and the two input projections'
    # bf16 inputs (4 x 2 T h), wqkv's output, the rotated q and k and the attention's output (3 h + 3 h_kv) and the
    # MLP's 4 i, in bf16; 8 B a token of norm statistics, 4 B a head and token of log-sum-exp; the rotary tables of
    # the rank's 4,096 positions (2 x T x 128 x 2).
    block = 8 * tokens * H + 2 * tokens * (3 * H + 3 * KV * D + 4 * I) + 8 * tokens + 4 * A * tokens + 2 * tokens * D * 2
    assert block == 732_463_104
    assert ring.memory.activations == L * block                          # 21.8 GiB
    assert ring.memory.logits == tokens * V * 14                        # 6.85 GiB
    assert ring.memory.states == N * 16 / 8                             # fp32 states, sharded over all 8
    assert ring.fits and ring.micro_batch == 1 and ring.micro_batches == 128


def test_the_exchanges_around_attention_are_priced_worked_by_hand():
    model = described("llama3-8b", None, None, S)
    options = (("activation_checkpointing", "none"), ("sp", 8), ("zero_stage", 2))
    ulysses = layout_at("ulysses", options, 8, "deepspeed-bf16")
    assert (ulysses.context_parallel, ulysses.batch_replicas, ulysses.split.data_parallel) == (8, 1, 8)
    found = sorted((s.collective, s.size_bytes, s.calls, s.group) for s in attention_schedule(ulysses, model, 1, 128))
    # q and the output: 4,096 tokens x 32 heads x 128 x 2 bytes; k and v: 8 heads. Each twice a block (two tensors),
    # forward and backward: 4 calls x 32 blocks x 128 micro-batches.
    assert found == [("all_to_all", 4096 * 8 * 128 * 2, 4 * 32 * 128, 8),
                     ("all_to_all", 4096 * 32 * 128 * 2, 4 * 32 * 128, 8)]
    ring = layout_at("cp", (("activation_checkpointing", "blocks"), ("cp", 8)), 8, "fsdp-mp-policy")
    found = sorted((s.collective, s.size_bytes, s.calls) for s in attention_schedule(ring, model, 1, 128))
    # A rank's keys and values: 2 x 4,096 x 8 x 128 values; gathered from all 8 in the forward, the recomputed
    # forward and backward (3 a block), and their gradients passed 8 times a block in fp32.
    kv = 2 * 4096 * 8 * 128
    assert found == [("all_gather", 8 * kv * 2, 3 * 32 * 128), ("all_to_all", kv * 4, 8 * 32 * 128)]


def test_checkpointing_a_split_keeps_each_block_s_input_at_the_rank_s_tokens():
    model = described("llama3-8b", None, None, S)
    layout = layout_at("cp", (("activation_checkpointing", "blocks"), ("cp", 4)), 8, "fsdp-mp-policy")
    terms = memory_of(layout, model, micro_batch=1, micro_batches=64)
    # 32 blocks' bf16 inputs at 8,192 tokens, and one block whole, the one recomputed.
    tokens = S // 4
    whole = 8 * tokens * H + 2 * tokens * (3 * H + 3 * KV * D + 4 * I) + 8 * tokens + 4 * A * tokens + 2 * tokens * D * 2
    assert terms.activations == 32 * 2 * tokens * H + whole


def test_memory_takes_a_degree_and_refuses_one_a_model_cannot_split_over(capsys):
    assert main(["memory", "--model", "llama3-8b", "--seq-len", "32768", "--dp", "8", "--recipe", "fsdp-mp-policy",
                 "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.startswith("cp ")]
    # states 14.958, activations 21.829, logits 6.850 GiB, as the plan's ring at cp = 8.
    assert row.split()[6:7] == ["14.958"] and row.split()[9:11] == ["21.829", "6.850"]
    assert main(["memory", "--model", "llama3-8b", "--seq-len", "32768", "--dp", "16", "--option", "sp=16",
                 "--recipe", "deepspeed-bf16", "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    assert "ulysses: Ulysses gives each of sp=16 ranks whole heads: the 32 heads and 8 key/value heads" in out
