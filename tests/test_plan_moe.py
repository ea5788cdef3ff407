"""An MoE model in `harness plan` and `harness memory` (harness.project.model's experts, harness.project.layouts'
all-to-alls, harness.project.plan's expert layouts): each figure worked by hand from Mixtral 8x7B's published shape
(mistralai/Mixtral-8x7B-v0.1 config.json: hidden 4096, 32 layers, 32 heads, 8 key/value heads, 8 experts, 2 a
token, intermediate 14336, vocabulary 32,000, untied; 46,702,792,704 parameters released, "13B active")."""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.project.cluster import load_cluster, preset as cluster_preset
from harness.project.layouts import layout_at, memory_of, schedule_of
from harness.project.model import Decoder, Mlp, decoder_of, parse_shape, preset
from harness.project.plan import Settings, plan
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


def test_the_hand_counts_are_mixtrals_published_ones():
    assert 3 * H * F == EXPERT and H * (H + 2 * 1024) + H * H == ATTENTION
    assert TOTAL == 46_702_792_704 and ACTIVE == 12_879_925_248


def test_mixtral_as_a_planned_model_counts_its_total_active_and_routed_parameters_and_flops():
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


def test_the_all_to_alls_and_the_gradient_reduces_of_an_ep_layout_worked_by_hand():
    # ep=8 over 32 GPUs, checkpointed, under torch.autocast: micro-batch 1 of 4096 tokens, 32 micro-batches a step.
    model = preset("mixtral-8x7b")
    layout = layout_at("ep", (("activation_checkpointing", "blocks"), ("ep", 8)), 32)
    assert layout.expert_parallel == 8 and layout.label == "ep ep=8 x dp=32 ckpt"
    found = {(s.collective, s.size_bytes): (s.calls, s.group, s.stride, s.label) for s in schedule_of(layout, model, 1, 32)}
    # A rank's buffer: 4096 tokens x 2 copies x 4096 values; the dispatch's fp32 (the RMSNorm's output), the combine's
    # bf16 (the experts' matmuls). Each: forward, the recomputed forward, backward = 3 calls a block and micro-batch,
    # x 32 blocks x 32 micro-batches = 3,072.
    values = 4096 * 2 * 4096
    # The dense gradients (fp32) among all 32 ranks; a rank's 1/8 of the experts among the 4 holding the same, 8 apart.
    assert found == {("all_to_all", values * 4): (3072.0, 8, 1, "ep"), ("all_to_all", values * 2): (3072.0, 8, 1, "ep"),
                     ("all_reduce", (TOTAL - ROUTED) * 4): (1.0, 32, 1, "dp"),
                     ("all_reduce", ROUTED / 8 * 4): (1.0, 4, 8, "dp")}
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
    assert {"ep ep=2 x dp=32", "ep ep=4 x dp=32", "ep ep=8 x dp=32 ckpt", "ddp dp=32", "fsdp2 dp=32 rs-every"} <= labels
    assert not any(p.layout.strategy in ("zero1", "zero3", "tp", "pipeline", "horovod") for p in planned)
    # 80 GiB: DDP's 16 bytes of 7.2e9 parameters a rank (107.9 GiB) leave no ep layout room; FSDP2 fits.
    assert [p.layout.label for p in planned if p.fits][0].startswith("fsdp2 dp=32")
    for p in (p for p in planned if p.layout.strategy == "ep"):
        assert not p.fits and p.memory.states == 16 * model.held_by_rank(expert_parallel=p.layout.expert_parallel)
        assert 0 < p.all_to_all_s < p.unfit_step_s
    # Where it fits (an H200's 141 GiB), the ep layout's all-to-all is its share of a priced step.
    h200 = load_cluster("dgx-h100-ib", ["gpu_memory_GiB=141"])
    fitting = [p for p in plan(model, h200, 4, Settings(global_batch=1024, tokens=1e9))
               if p.fits and p.layout.strategy == "ep"]
    assert fitting and all(0 < p.all_to_all_s < p.step_s for p in fitting)


def test_the_plan_prints_each_ep_layouts_all_to_all_and_follows_no_dense_dry_run(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "dgx-h100-ib", "--nodes", "4", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "8 swiglu experts of 14336, top-2 (12,879,925,248 active)" in out
    assert out.count("all-to-all: ") == 6 and "among 8 ranks, inside a node" in out
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
