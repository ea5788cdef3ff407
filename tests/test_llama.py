"""The Llama-style family (workloads/llama.py): parameter counts and FLOPs worked out by hand from the published
shapes, and a block checked against attention, rotary embeddings and SwiGLU written out here another way."""

from __future__ import annotations

import math

import pytest
import torch

from harness.spec import RunSpec
from workloads import WORKLOADS, count_parameters
from workloads.llama import LlamaBlock, LlamaConfig


def meta_parameters(name):
    with torch.device("meta"):
        return count_parameters(WORKLOADS[name].build_model())


def test_llama3_2_1b_holds_its_released_weights_count_worked_by_hand():
    # config.json: hidden 2048, 16 layers, 32 heads of 64, 8 key/value heads, intermediate 8192, vocabulary 128,256
    # (64 x 2,004: no padded rows), tied embeddings.
    attention = 2048 * 2048 + 2 * 2048 * 512 + 2048 * 2048      # q, k and v (8 x 64 = 512 wide), o
    mlp = 3 * 2048 * 8192                                        # gate, up, down
    layer = attention + mlp + 2 * 2048                           # + two RMSNorm weights
    assert (attention, mlp, layer) == (10_485_760, 50_331_648, 60_821_504)
    total = 16 * layer + 128_256 * 2048 + 2048                   # one tied matrix, the final norm
    assert total == 1_235_814_400 == meta_parameters("llama3.2-1b") == WORKLOADS["llama3.2-1b"].published_params
    # The model card's "1B (1.23B)": two decimals, cut.
    assert math.floor(total / 1e7) / 100 == 1.23


def test_llama3_8b_holds_its_released_weights_count_worked_by_hand():
    # config.json: hidden 4096, 32 layers, 32 heads of 128, 8 key/value heads, intermediate 14,336, untied.
    attention = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096
    layer = attention + 3 * 4096 * 14_336 + 2 * 4096
    assert layer == 218_112_000
    total = 32 * layer + 2 * 128_256 * 4096 + 4096               # embedding and head, the final norm
    assert total == 8_030_261_248 == meta_parameters("llama3-8b") == WORKLOADS["llama3-8b"].published_params


def test_llama_tiny_pads_its_vocabulary_and_unties_its_head():
    config = WORKLOADS["llama-tiny"].config
    assert (config.vocab_size, config.padded_vocab_size) == (500, 512)
    # A layer: q 64 x 64, k and v 64 x 32 (2 heads of 16), o 64 x 64, MLP 3 x 64 x 192, 2 norms of 64.
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 192 + 2 * 64
    assert 4 * layer + 2 * 512 * 64 + 64 == 262_720 == meta_parameters("llama-tiny")
    torch.manual_seed(0)
    model = WORKLOADS["llama-tiny"].build_model()
    assert model[-1].output.weight is not model[0].tok_embeddings.weight
    assert list(model.buffers()) == []          # rotary angles are computed, not kept: nothing for DDP to broadcast
    inputs, targets = WORKLOADS["llama-tiny"].batch(0, 0, torch.arange(64), torch.device("cpu"))
    assert int(max(inputs.max(), targets.max())) < 500


def test_the_1b_head_is_its_embedding():
    with torch.device("meta"):
        model = WORKLOADS["llama3.2-1b"].build_model()
    assert model[-1].weight is model[0].tok_embeddings.weight
    [tie] = WORKLOADS["llama3.2-1b"].ties()
    assert (tie.owner, tie.user, tie.weight_attr) == (0, 18, "tok_embeddings.weight")   # 16 blocks, the norm at 17
    assert WORKLOADS["llama3-8b"].ties() == ()


@pytest.mark.parametrize("name, flops", [
    # llama-tiny, T = 64: N leaves out the untied input embedding, 262,720 - 512 x 64 = 229,952;
    # 6N = 1,379,712; 12 L H Q T = 12 x 4 x 4 x 16 x 64 = 196,608.
    ("llama-tiny", 1_379_712 + 196_608),
    # llama3.2-1b, T = 2048, tied: N = every parameter, 1,235,814,400; 6N = 7,414,886,400;
    # 12 x 16 x 32 x 64 x 2048 = 805,306,368.
    ("llama3.2-1b", 7_414_886_400 + 805_306_368),
    # llama3-8b, T = 8192: N = 8,030,261,248 - 128,256 x 4096 = 7,504,924,672; 6N = 45,029,548,032;
    # 12 x 32 x 32 x 128 x 8192 = 12,884,901,888. Grouped-query attention is in N only (k and v 4096 x 1024).
    ("llama3-8b", 45_029_548_032 + 12_884_901_888),
])
def test_flops_per_token_are_palms_with_grouped_query_attention_in_n(name, flops):
    assert WORKLOADS[name].train_flops_per_token == flops
    assert WORKLOADS[name].train_flops_per_sample == flops * WORKLOADS[name].config.seq_len


def _reference_block(block: LlamaBlock, x: torch.Tensor, config: LlamaConfig, kv_head_of=None) -> torch.Tensor:
    """The block written out: RMSNorm as x / rms, rotary embeddings as complex rotations of the pairs (i, i +
    head_dim / 2), query head j attending through key/value head j // group (`kv_head_of`) with an explicit
    causal mask."""
    def rms_norm(h, weight):
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + config.norm_eps) * weight

    batch, seq, d = x.shape
    H, K, hd = config.n_head, config.n_kv_head, config.head_dim
    qkv = rms_norm(x, block.attention_norm.weight) @ block.wqkv.weight.T
    q, k, v = qkv[..., :H * hd], qkv[..., H * hd:(H + K) * hd], qkv[..., (H + K) * hd:]
    q, k, v = (t.reshape(batch, seq, -1, hd) for t in (q, k, v))
    frequencies = config.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    turns = torch.polar(torch.ones(seq, hd // 2, dtype=torch.float64),
                        torch.arange(seq, dtype=torch.float64)[:, None] * frequencies)

    def rotate(t):
        pairs = torch.complex(t[..., :hd // 2], t[..., hd // 2:]) * turns[None, :, None, :]
        return torch.cat((pairs.real, pairs.imag), dim=-1)

    q, k = rotate(q), rotate(k)
    out = torch.empty(batch, seq, H, hd, dtype=x.dtype)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for head in range(H):
        kv = kv_head_of(head) if kv_head_of else head // (H // K)
        scores = q[:, :, head] @ k[:, :, kv].transpose(1, 2) / math.sqrt(hd)
        out[:, :, head] = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, :, kv]
    x = x + out.reshape(batch, seq, H * hd) @ block.wo.weight.T
    gate, up = (rms_norm(x, block.ffn_norm.weight) @ block.w_gate_up.weight.T).split(config.intermediate_size, -1)
    return x + (torch.nn.functional.silu(gate) * up) @ block.w_down.weight.T


def test_a_block_is_grouped_query_attention_with_rotary_embeddings_and_swiglu():
    config = WORKLOADS["llama-tiny"].config
    torch.manual_seed(0)
    block = LlamaBlock(config).double()
    with torch.no_grad():     # norm weights away from 1, so that a norm applied without its weight shows
        block.attention_norm.weight.uniform_(0.5, 1.5)
        block.ffn_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 16, config.n_embd, dtype=torch.float64)
    expected = _reference_block(block, x, config)
    assert torch.allclose(block(x), expected, atol=1e-10)
    # Planted: query head j served by key/value head j % K (the groups interleaved) is another model.
    interleaved = _reference_block(block, x, config, kv_head_of=lambda head: head % config.n_kv_head)
    assert not torch.allclose(block(x), interleaved, atol=1e-3)


def test_llama_blocks_are_blocks_and_tensor_parallelism_splits_them_at_a_degree_dividing_the_key_value_heads():
    from harness.strategies import get_strategy
    from harness.strategies.base import is_block

    torch.manual_seed(0)
    layers = WORKLOADS["llama-tiny"].build_layers()
    assert [is_block(layer) for layer in layers] == [False, True, True, True, True, False, False]
    # The layouts are worked by hand in tests/test_llama_tp.py; its 2 key/value heads allow TP 2, not 4.
    for strategy, options in (("tp", {}), ("fsdp2-tp", {"tp": 2}), ("autotp", {"tp": 2})):
        assert get_strategy(strategy).layout_refusal(RunSpec(workload="llama-tiny", strategy=strategy, world_size=2,
                                                             global_batch=8, micro_batch=4, options=options)) is None
    assert "2 key/value heads" in get_strategy("tp").layout_refusal(
        RunSpec(workload="llama-tiny", strategy="tp", world_size=4, global_batch=8, micro_batch=4))
