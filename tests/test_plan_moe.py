"""An MoE model in `harness plan` and `harness memory` (harness.project.model's experts, harness.project.layouts'
all-to-alls, harness.project.plan's expert layouts): each figure worked by hand from Mixtral 8x7B's published shape
(mistralai/Mixtral-8x7B-v0.1 config.json: hidden 4096, 32 layers, 32 heads, 8 key/value heads, 8 experts, 2 a
token, intermediate 14336, vocabulary 32,000, untied; 46,702,792,704 parameters released, "13B active")."""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.derive.activations import llama_block_activations
from harness.project.cluster import load_cluster, preset as cluster_preset
from harness.project.layouts import layout_at, memory_of, schedule_of
from harness.project.model import Decoder, Mlp, decoder_of, parse_shape, preset
from harness.project.mfu_model import validation
from harness.project.plan import Settings, plan
from harness.project.rank_memory import block_bytes
from harness.spec import SpecError

GIB = float(1 << 30)
H, F, L, E, K, V = 4096, 14336, 32, 8, 2, 32_000
# A block: attention h (h + 2 h_kv) + h^2 with h_kv = 8 x 128 = 1024: 4096 x 6144 + 4096^2 = 41,943,040; the
# router h x E = 32,768; two RMSNorms 8,192; each expert 3 h f = 176,160,768.
ATTENTION, ROUTER, NORMS, EXPERT = 41_943_040, 32_768, 8_192, 176_160_768
OUTSIDE = 2 * V * H + H                         # embedding and untied head, 131,072,000 each, and the final norm
TOTAL = L * (ATTENTION + ROUTER + NORMS + E * EXPERT) + OUTSIDE
ACTIVE = L * (ATTENTION + ROUTER + NORMS + K * EXPERT) + OUTSIDE
ROUTED = L * E * EXPERT                          # 45,097,156,608


def test_mixtral_as_a_planned_model_counts_its_total_active_and_routed_parameters_and_flops():
    assert 3 * H * F == EXPERT and H * (H + 2 * 1024) + H * H == ATTENTION      # the hand counts above
    assert TOTAL == 46_702_792_704 and ACTIVE == 12_879_925_248               # Mixtral's published ones
    model = preset("mixtral-8x7b")
    assert model.is_moe and (model.experts, model.top_k) == (E, K)
    assert model.parameters == TOTAL and model.active_parameters == ACTIVE and model.routed_expert_parameters == ROUTED
    # PaLM's 6N + 12 L H Q T, N the active matmul parameters: less the input embedding (the head is untied).
    assert model.flops_per_token == 6 * (ACTIVE - V * H) + 12 * L * 32 * 128 * 4096 == 82_935_570_432


def test_a_rank_holds_the_dense_part_and_its_share_of_the_experts():
    model = preset("mixtral-8x7b")
    dense = TOTAL - ROUTED                       # 1,605,636,096
    for ep in (1, 2, 4, 8):
        assert model.held_by_rank(expert_parallel=ep) == dense + ROUTED / ep
    assert model.held_by_rank(expert_parallel=8) == 7_242_780_672


def test_an_moe_shape_is_parsed_checked_and_written_back():
    shape = parse_shape("4096,4096,32,32,32000,kv_heads=8,ffn=14336,mlp=swiglu,tied=false,experts=8,top_k=2")
    model = decoder_of(None, shape)
    assert model.parameters == TOTAL
    assert decoder_of(None, parse_shape(model.shape_text())) == model
    with pytest.raises(SpecError, match="experts are described for the swiglu"):
        Decoder(seq_len=8, hidden=8, heads=2, layers=1, experts=4)
    with pytest.raises(SpecError, match="top_k must be a whole number from 1 to the 4 experts"):
        Decoder(seq_len=8, hidden=8, heads=2, layers=1, ffn=8, mlp=Mlp.SWIGLU, experts=4, top_k=5)
    with pytest.raises(ValueError, match="shared_experts"):
        parse_shape("8,8,2,1,shared_experts=x")


def test_shared_experts_count_as_parameters_active_on_every_token_and_widen_the_activations():
    # 2 blocks of hidden 8 (2 heads, 1 key/value head: h_kv = 4), 4 routed experts and 1 shared one, each 3 x 8 x 16 =
    # 384 parameters, top-2; a vocabulary of 64 rows, untied. A block: attention 8 x (8 + 8) + 64 = 192, the router
    # 32, the norms 16, 5 experts 1,920: 2,160; outside, 2 x 512 + 8 = 1,032.
    model = Decoder(seq_len=4, hidden=8, heads=2, kv_heads=1, layers=2, ffn=16, mlp=Mlp.SWIGLU, vocab=64, tied=False,
                    experts=4, top_k=2, shared_experts=1)
    assert model.parameters == 2 * 2_160 + 1_032
    assert model.active_parameters == model.parameters - 2 * 2 * 384      # 2 idle routed experts a block
    assert model.mlps_a_token == 3
    # Llama's block with its MLP 3 x 16 wide under autocast, plus the routing's copies: 4 tokens' 2 dispatched rows and
    # their outputs, 8 values each in bf16 (2 x 2 x 8 x 2 = 64 bytes a token), and 4 experts' fp32 logits and
    # probabilities (32 bytes a token).
    llama = llama_block_activations(seq_len=4, micro_batch=1, hidden=8, heads=2, kv_heads=1, intermediate=48,
                                    compute_bytes=2, fused_norm=True).total
    assert block_bytes(model, micro_batch=1, recipe="autocast", tensor_parallel=1) == llama + 4 * (64 + 32)


def test_the_all_to_alls_and_the_gradient_reduces_of_an_ep_layout_worked_by_hand():
    # ep=8 over 32 GPUs, checkpointed, under torch.autocast: micro-batch 1 of 4096 tokens, 32 micro-batches a step.
    model = preset("mixtral-8x7b")
    layout = layout_at("ep", (("activation_checkpointing", "blocks"), ("ep", 8)), 32)
    assert layout.expert_parallel == 8 and layout.label == "ep dp=32 ep=8 ckpt"
    found = {(s.collective, s.size_bytes): (s.calls, s.group, s.stride, s.label) for s in schedule_of(layout, model, 1, 32)}
    # A rank's buffer: 4096 tokens x 2 copies x 4096 values; the dispatch's fp32 (the RMSNorm's output), the combine's
    # bf16 (the experts' matmuls). Each: forward, the recomputed forward, backward = 3 calls a block and micro-batch,
    # x 32 blocks x 32 micro-batches = 3,072.
    values = 4096 * 2 * 4096
    # The dense gradients (fp32) among all 32 ranks, as DDP's buckets; a rank's 1/8 of the experts among the 4 holding
    # the same, 8 apart, one all-reduce of each of its 64 expert tensors after backward (exposed: not "dp").
    assert found == {("all_to_all", values * 4): (3072.0, 8, 1, "ep"), ("all_to_all", values * 2): (3072.0, 8, 1, "ep"),
                     ("all_reduce", (TOTAL - ROUTED) * 4): (1.0, 32, 1, "dp"),
                     ("all_reduce", ROUTED / 8 * 4 / 64): (64.0, 4, 8, "experts")}
    eager = layout_at("ep", (("activation_checkpointing", "none"), ("ep", 8)), 32)
    assert {s.calls for s in schedule_of(eager, model, 1, 32) if s.collective == "all_to_all"} == {2 * 32 * 32}


def test_an_ep_layouts_model_states_are_its_dense_part_and_its_experts_share():
    model = preset("mixtral-8x7b")
    layout = layout_at("ep", (("activation_checkpointing", "blocks"), ("ep", 8)), 32)
    terms = memory_of(layout, model, micro_batch=1, micro_batches=32)
    # torch.autocast over fp32 weights: 4 + 4 + 8 bytes a parameter, nothing sharded (DDP and whole experts).
    assert terms.states == 16 * 7_242_780_672
    replicated = memory_of(layout_at("ddp", (("activation_checkpointing", "blocks"),), 32), model, micro_batch=1,
                           micro_batches=32)
    assert replicated.states == 16 * TOTAL


def test_plan_ranks_mixtrals_expert_layouts_with_memory_and_the_all_to_alls_share():
    model = preset("mixtral-8x7b")
    planned = plan(model, cluster_preset("dgx-h100-ib"), 4, Settings(global_batch=1024, tokens=1e9))
    labels = {p.layout.label for p in planned}
    assert {"ep dp=32 ep=2", "ep dp=32 ep=4", "ep dp=32 ep=8 ckpt", "ddp dp=32", "fsdp2 dp=32 rs-every"} <= labels
    assert not any(p.layout.strategy in ("zero1", "zero3", "tp", "pipeline", "horovod") for p in planned)
    # 80 GiB: DDP's 16 bytes of 7.2e9 parameters a rank (107.9 GiB) leave no ep layout room; FSDP2 fits, and
    # DeepSpeed-MoE's ZeRO-2 at ep=8, its experts' states sharded over their 4 holders, is ranked first.
    fitting = [p.layout.label for p in planned if p.fits]
    assert fitting[0] == "deepspeed-moe dp=32 ep=8 zero2" and "fsdp2 dp=32 rs-every" in fitting
    for p in (p for p in planned if p.layout.strategy == "ep"):
        assert not p.fits and p.memory.states == 16 * model.held_by_rank(expert_parallel=p.layout.expert_parallel)
        assert 0 < p.all_to_all_s < p.unfit_step_s
    # Compute at the fitted MFU of a dense model of Mixtral's active parameters, not its total: 1,024 samples of
    # 4,096 tokens at 82.9 GFLOP a token over 32 H100s at 989.4 TFLOP/s (dense bf16), 4/3 of it recomputed. An unfit
    # row's step is at least that compute and its all-to-all, which nothing overlaps.
    fitted = validation().model
    unfit = next(p for p in planned if p.layout.label == "ep dp=32 ep=8 ckpt")
    compute = 1024 * 4096 * 82_935_570_432 / 32 / (989.4e12 * fitted.compute_mfu("NVIDIA H100 80GB HBM3", ACTIVE, True))
    assert unfit.unfit_step_s >= compute * 4 / 3 + unfit.all_to_all_s
    # That all-to-all priced by hand, pairwise inside a node (NVLink 4: 3.4 us, 450 GB/s each way): each of 7 rounds
    # sends an eighth of the buffer; 3,072 calls of the fp32 dispatch's 134,217,728 bytes and of the bf16 combine's half.
    call = lambda size: 7 * (3.4e-6 + size / 8 / 450e9)
    assert unfit.all_to_all_s == pytest.approx(3072 * (call(134_217_728) + call(67_108_864)), rel=1e-9)
    assert unfit.all_to_all_s == pytest.approx(1.3488, abs=1e-4)
    # Where it fits (an H200's 141 GiB), the ep layout's all-to-all is its share of a priced step.
    h200 = load_cluster("dgx-h100-ib", ["gpu_memory_GiB=141"])
    fitting = [p for p in plan(model, h200, 4, Settings(global_batch=1024, tokens=1e9))
               if p.fits and p.layout.strategy == "ep"]
    assert fitting and all(0 < p.all_to_all_s < p.step_s for p in fitting)


def test_deepspeed_moe_shards_the_experts_states_over_the_ranks_holding_them_worked_by_hand():
    # DeepSpeed's bf16 section: 2-byte weights and gradients, 12 bytes of fp32 master and moments. ZeRO-2 shards the
    # gradients and the optimizer: the dense 1,605,636,096 parameters over all 32 ranks, a rank's 1/8 of the experts
    # (5,637,144,576) over the 4 ranks holding them.
    model = preset("mixtral-8x7b")
    layout = layout_at("deepspeed-moe", (("activation_checkpointing", "none"), ("ep", 8),
                                         ("precision_recipe", "deepspeed-bf16"), ("zero_stage", 2)), 32,
                       recipe="deepspeed-bf16")
    dense, experts = TOTAL - ROUTED, ROUTED // 8
    terms = memory_of(layout, model, micro_batch=1, micro_batches=32)
    assert terms.states == pytest.approx(dense * (2 + 14 / 32) + experts * (2 + 14 / 4), rel=1e-12)
    assert round(terms.states / GIB, 2) == 32.52
    found = {(s.collective, s.group, s.stride): (s.size_bytes, s.calls) for s in schedule_of(layout, model, 1, 32)}
    # ZeRO-2: the gradients reduce-scattered every micro-batch (32), the updated 16-bit weights gathered once.
    assert found[("reduce_scatter", 32, 1)] == (2 * dense, 32) and found[("all_gather", 32, 1)] == (2 * dense, 1)
    assert found[("reduce_scatter", 4, 8)] == (2 * experts, 32) and found[("all_gather", 4, 8)] == (2 * experts, 1)
    # Its all-to-alls carry 16-bit rows both ways (bf16 weights): 4096 tokens x 2 copies x 4096 values x 2 bytes.
    # The dispatch's and the combine's, each forward and backward in each of 32 blocks and 32 micro-batches.
    assert found[("all_to_all", 8, 1)] == (4096 * 2 * 4096 * 2, 2 * 32 * 32)
    assert sum(s.collective == "all_to_all" for s in schedule_of(layout, model, 1, 32)) == 2


def test_the_plan_prints_each_ep_layouts_all_to_all_and_follows_no_dense_dry_run(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "dgx-h100-ib", "--nodes", "4", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "8 swiglu experts of 14336, top-2 (12,879,925,248 active)" in out
    assert out.count("all-to-all: ") == 6 + 12 and "among 8 ranks, inside a node" in out
    assert "No dry run follows" in out and "--matrix hybrid" not in out


def test_memory_shards_the_experts_over_ep_and_refuses_expert_parallelism_of_a_dense_model(capsys):
    assert main(["memory", "--model", "mixtral-8x7b", "--dp", "8", "--option", "ep=8"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isalpha()}
    # weights, gradients and optimizer GiB: 4, 4 and 8 bytes of 7,242,780,672 parameters.
    assert rows["ep"][3:7] == [f"{4 * 7_242_780_672 / GIB:.3f}", f"{4 * 7_242_780_672 / GIB:.3f}",
                               f"{8 * 7_242_780_672 / GIB:.3f}", f"{16 * 7_242_780_672 / GIB:.3f}"]
    assert rows["ddp"][6] == f"{16 * TOTAL / GIB:.3f}"
    assert main(["memory", "--model", "llama3-8b", "--dp", "8"]) == 0
    assert "ep: expert parallelism shards an MoE model's experts" in capsys.readouterr().out
    assert main(["memory", "--model", "mixtral-8x7b", "--dp", "4", "--option", "ep=8"]) == 0
    out = capsys.readouterr().out
    assert "ep: ep=8 must divide the world size 4" in out and "horovod-ep: recipe autocast" in out
    assert main(["memory", "--model", "mixtral-8x7b", "--dp", "6", "--option", "ep=3"]) == 0
    assert "ep: the 8 experts do not divide over 3 expert-parallel ranks" in capsys.readouterr().out
