"""The Mixture-of-Experts family (workloads/moe.py): its counts against Mixtral 8x7B's published ones, worked by hand
here from its config.json; the router, the dropless experts and the load-balancing loss against computations written
out token by token; and the Llama block it reuses, unchanged."""

import math

import pytest
import torch
from torch.nn import functional as F

from workloads.base import build_on_meta, count_parameters
from workloads.llama import LLAMA_CONFIGS, LlamaBlock
from workloads.moe import (MOE_CONFIGS, GroupedExperts, MoEBlock, MoEConfig, MoEFeedForward,
                           MoEWorkload, load_balancing_loss, routing)

MIXTRAL, MIXTRAL_PUBLISHED = MOE_CONFIGS["mixtral-8x7b"]


def test_mixtral_8x7b_counts_its_published_46_7b_parameters_and_12_9b_active():
    # config.json: hidden 4096, 32 layers, 32 heads of 128, 8 key/value heads, 8 experts of width 14336, top 2,
    # vocabulary 32,000 (a multiple of 64: no padding), untied. A block:
    #   attention: q 4096 x 4096 + k, v 4096 x 1024 each + o 4096 x 4096 = 16,777,216 x 2 + 4,194,304 x 2 = 41,943,040
    #   an expert: gate, up, down 3 x 4096 x 14336 = 176,160,768; eight: 1,409,286,144; two: 352,321,536
    #   router 4096 x 8 = 32,768; two RMSNorms 8,192
    # Every parameter: 32 x (41,943,040 + 1,409,286,144 + 32,768 + 8,192) = 32 x 1,451,270,144 = 46,440,644,608,
    # + embedding and head 2 x 32,000 x 4096 = 262,144,000 + final norm 4096 = 46,702,792,704: the released weights'
    # count (Hugging Face reports 46.7B; the paper "47B"). Active: 32 x (41,943,040 + 352,321,536 + 32,768 + 8,192)
    # = 32 x 394,305,536 = 12,617,777,152, + 262,144,000 + 4096 = 12,879,925,248 (the paper: "13B active").
    assert MIXTRAL.parameters == 46_702_792_704 == MIXTRAL_PUBLISHED
    assert MIXTRAL.active_parameters == 12_617_777_152 + 262_144_000 + 4096 == 12_879_925_248
    assert round(MIXTRAL.parameters / 1e9, 1) == 46.7 and round(MIXTRAL.active_parameters / 1e9, 1) == 12.9


def test_mixtral_8x7b_trains_at_6n_active_plus_attention_flops_a_token():
    # PaLM's 6 N + 12 L H Q T with N the active matmul parameters: 12,879,925,248 less the input embedding's lookup
    # (32,000 x 4096 = 131,072,000) = 12,748,853,248; 6 N = 76,493,119,488; attention 12 x 32 x 32 x 128 x 4096 =
    # 6,442,450,944; 82,935,570,432 FLOPs a token.
    workload = MoEWorkload("mixtral-8x7b", MIXTRAL, MIXTRAL_PUBLISHED)
    assert workload.matmul_params == 12_748_853_248
    assert workload.train_flops_per_token == 6 * 12_748_853_248 + 12 * 32 * 32 * 128 * 4096 == 82_935_570_432


def test_shared_experts_count_in_both_totals():
    # 2 routed experts of width 8 on d = 16 (384 parameters each), 1 shared, top 1: a block holds attention
    # 16 x (4 + 2 x 2) x 4 + 4 x 4 x 16 = 512 + 256 = 768, experts (2 + 1) x 384 = 1,152, router 32, norms 32: 1,984;
    # active (1 + 1) x 384 instead: 1,600. The model: 2 x 64 x 16 = 2,048 of embedding and head, + 16.
    config = MoEConfig(vocab_size=64, seq_len=8, n_layer=1, n_embd=16, n_head=4, n_kv_head=2, n_experts=2, top_k=1,
                       intermediate_size=8, n_shared_experts=1)
    assert (config.parameters, config.active_parameters) == (2048 + 1984 + 16, 2048 + 1600 + 16)
    model = build_on_meta(lambda: MoEWorkload("shared", config, None).build_model())
    assert count_parameters(model) == config.parameters


def test_moe_tiny_builds_the_parameters_it_counts():
    config, _ = MOE_CONFIGS["moe-tiny"]
    # attention 64 x 8 x 16 + 64 x 64 = 12,288; 4 experts of 3 x 64 x 96 = 73,728; router 256; norms 128: 86,400 a
    # block, 4 blocks 345,600; embedding and head 2 x 512 x 64 = 65,536; final norm 64.
    assert config.parameters == 345_600 + 65_536 + 64 == 411_200
    assert config.active_parameters == 4 * (86_400 - 2 * 18_432) + 65_536 + 64 == 263_744
    model = MoEWorkload("moe-tiny", config, None).build_model()
    assert count_parameters(model) == 411_200


def test_the_router_sends_each_token_to_its_k_most_probable_experts_with_weights_summing_to_one():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 3.5]])
    probabilities, chosen, weights = routing(logits, top_k=2)
    assert chosen.tolist() == [[0, 1], [3, 1]]
    p = [math.exp(v) for v in (2.0, 1.0)]
    assert weights[0].tolist() == pytest.approx([p[0] / sum(p), p[1] / sum(p)])
    assert weights.sum(dim=-1).tolist() == pytest.approx([1.0, 1.0])
    assert probabilities.sum(dim=-1).tolist() == pytest.approx([1.0, 1.0])


def test_dropless_experts_give_each_token_the_weighted_sum_of_its_experts_outputs():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 6)
    for weight in experts.parameters():
        torch.nn.init.normal_(weight, std=0.3)
    tokens = torch.randn(10, 8)
    chosen = torch.tensor([[0, 1], [1, 0], [3, 2], [3, 1], [0, 3], [2, 1], [1, 3], [0, 2], [2, 3], [1, 2]])
    weights = torch.rand(10, 2)

    def one_expert(e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = x @ experts.w_gate_up[e, :, :6], x @ experts.w_gate_up[e, :, 6:]
        return (F.silu(gate) * up) @ experts.w_down[e]

    expected = torch.stack([sum(weights[t, j] * one_expert(int(chosen[t, j]), tokens[t]) for j in range(2))
                            for t in range(10)])
    assert torch.allclose(experts(tokens, chosen, weights), expected, atol=1e-5)


def test_the_load_balancing_loss_is_k_when_routing_is_uniform_and_more_when_one_expert_takes_all():
    # 4 tokens, 4 experts, top 2. Uniform probabilities, each expert chosen twice: f_e = 2 / 4, P_e = 1 / 4,
    # 4 x 4 x (1/2 x 1/4) = 2 = k. Every token to experts 0 and 1 with probabilities (0.7, 0.3, 0, 0):
    # f = (1, 1, 0, 0), P = (0.7, 0.3, 0, 0): 4 x (0.7 + 0.3) = 4.
    uniform = torch.full((4, 4), 0.25)
    spread = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]])
    assert load_balancing_loss(uniform, spread).item() == pytest.approx(2.0)
    lopsided = torch.tensor([[0.7, 0.3, 0.0, 0.0]] * 4)
    assert load_balancing_loss(lopsided, torch.tensor([[0, 1]] * 4)).item() == pytest.approx(4.0)


def test_the_aux_loss_reaches_the_gradients_as_if_added_to_the_loss_and_leaves_the_output_alone():
    config, _ = MOE_CONFIGS["moe-tiny"]
    torch.manual_seed(1)
    layer = MoEFeedForward(config)
    for weight in layer.parameters():
        torch.nn.init.normal_(weight, std=0.1)
    h = torch.randn(2, 5, config.n_embd)
    layer.aux_scale = 0.25
    layer.train()
    out = layer(h)
    out.square().sum().backward()
    through = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    # The same by hand: the output without the aux loss, and 0.25 x the loss added to what is differentiated.
    layer.aux_scale = 0.0
    tokens = h.reshape(-1, config.n_embd)
    probabilities, chosen, _ = routing(layer.router(tokens), config.top_k)
    plain = layer(h)
    assert torch.equal(plain, out.detach())
    (plain.square().sum() + 0.25 * load_balancing_loss(probabilities, chosen)).backward()
    for got, expected in zip(through, (p.grad for p in layer.parameters())):
        assert torch.allclose(got, expected, atol=1e-6)
    # And the aux loss mattered: the router's gradient without it differs.
    layer.zero_grad()
    layer(h).square().sum().backward()
    assert not torch.allclose(through[0], layer.router.weight.grad, atol=1e-6)


def test_an_moe_block_keeps_the_llama_attention_and_its_tokens_per_expert_add_up_to_k_per_token():
    config, _ = MOE_CONFIGS["moe-tiny"]
    torch.manual_seed(2)
    block = MoEBlock(config)
    assert not hasattr(block, "w_gate_up") and {"wqkv.weight", "wo.weight"} <= dict(block.named_parameters()).keys()
    x = torch.randn(3, config.seq_len, config.n_embd)
    y = block(x)
    assert y.shape == x.shape
    assert int(block.moe.routed_tokens.sum()) == 3 * config.seq_len * config.top_k
    after_attention = block.attend(x)
    assert torch.allclose(y, after_attention + block.moe(block.ffn_norm(after_attention)), atol=1e-6)


def test_the_llama_block_still_computes_attention_then_its_swiglu_mlp():
    config, _ = LLAMA_CONFIGS["llama-tiny"]
    torch.manual_seed(3)
    block = LlamaBlock(config)
    x = torch.randn(2, config.seq_len, config.n_embd)
    h = block.attend(x)
    gate, up = F.linear(block.ffn_norm(h), block.w_gate_up.weight).chunk(2, dim=-1)
    assert torch.equal(block(x), h + F.linear(F.silu(gate) * up, block.w_down.weight))


# ---- the row's expert figures (harness.derive.experts) ---------------------------------------------------------------


def expert_row(counted: list[float], expected: list[float], group: int = 2) -> dict:
    """Measurements of an expert-parallel row: each rank's counted all-to-all bytes and those its routing expects."""
    return {"comm_per_step_by_rank": [{"all_to_all": {"bytes": c, "calls": 40.0,
                                                      "bytes_by_group_size": {str(group): c}}} for c in counted],
            "strategy_figures_by_rank": [{"expert_parallel": {"expected_all_to_all_bytes_per_timed_step": e}}
                                         for e in expected],
            "routing": {"load_imbalance": 1.25}, "comm_expected_per_step": {"collectives": [], "not_modelled_because": ""}}


def test_an_expert_rows_all_to_all_is_held_to_its_routing_and_its_wire_bytes_expected():
    from harness.derive.comm import expected_wire_bytes
    from harness.derive.experts import expert_columns

    honest = expert_columns(expert_row([4_197_683.2, 4_191_436.8], [4_197_683.2, 4_191_436.8]))
    assert honest == {"load_imbalance": 1.25, "all_to_all_bytes_per_step": 4_197_683.2,
                      "all_to_all_expected_bytes_per_step": 4_197_683.2, "all_to_all_counted_over_expected": 1.0}
    # A rank that sent 64 rows of 64 fp32 values more than its routing asked for: the rank furthest from 1 is named.
    extra = 64 * 64 * 4
    planted = expert_columns(expert_row([4_197_683.2, 4_191_436.8 + extra], [4_197_683.2, 4_191_436.8]))
    assert planted["all_to_all_counted_over_expected"] == (4_191_436.8 + extra) / 4_191_436.8
    # On a wire half of an all-to-all among 2 leaves the rank ((n - 1) / n): the largest rank's expected bytes, halved.
    assert expected_wire_bytes(expert_row([1.0, 1.0], [1000.0, 800.0])) == {"all_to_all": 500.0}
    # A row that routed nothing (a dense strategy's) has no such figures.
    assert expert_columns({"comm_per_step_by_rank": [{}]}) == {}


def test_the_reports_expert_lines_say_whether_the_all_to_all_is_what_the_routing_expects():
    import pandas as pd

    from harness.report.experts import expert_lines

    cells = pd.DataFrame([
        {"label": "moe-tiny/plain/ws1", "status": "ok", "load_imbalance": 1.123, "all_to_all_bytes_per_step": None,
         "all_to_all_expected_bytes_per_step": None, "all_to_all_counted_over_expected": None},
        {"label": "moe-tiny/ep/ws2", "status": "ok", "load_imbalance": 1.123, "all_to_all_bytes_per_step": 2 * 2**20,
         "all_to_all_expected_bytes_per_step": 2 * 2**20, "all_to_all_counted_over_expected": 1.0},
        {"label": "moe-tiny/ep/ws4", "status": "ok", "load_imbalance": 1.2, "all_to_all_bytes_per_step": 3 * 2**20,
         "all_to_all_expected_bytes_per_step": 2 * 2**20, "all_to_all_counted_over_expected": 1.5},
        {"label": "gpt-tiny/ddp/ws2", "status": "ok", "load_imbalance": None, "all_to_all_bytes_per_step": None,
         "all_to_all_expected_bytes_per_step": None, "all_to_all_counted_over_expected": None}])
    assert expert_lines(cells) == [
        "moe-tiny/plain/ws1: load imbalance 1.12 (the busiest expert's tokens over the mean); experts replicated, "
        "no all-to-all.",
        "moe-tiny/ep/ws2: load imbalance 1.12 (the busiest expert's tokens over the mean); all-to-all 2 MiB a step on "
        "its busiest rank, as its routing expects.",
        "moe-tiny/ep/ws4: load imbalance 1.2 (the busiest expert's tokens over the mean); all-to-all 3 MiB a step on "
        "its busiest rank, ROUTING EXPECTS 2 MiB (counted / expected 1.5 on its furthest rank)."]


def test_an_moe_cell_in_fp16_is_refused_before_launch_in_one_line():
    from harness.spec import RunSpec, SpecError
    from harness.strategies import checked

    spec = RunSpec(workload="moe-tiny", strategy="ddp", world_size=2, global_batch=16, micro_batch=4, precision="fp16",
                   warmup_steps=3, timed_steps=10)
    with pytest.raises(SpecError, match="moe-tiny cannot train in fp16: its load-balancing loss"):
        checked(spec)
    checked(spec.replace(precision="bf16"))
