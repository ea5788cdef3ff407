"""A described decoder (harness.project.model): parameter counts against the published ones and against the
workloads' own built models, FLOPs by the PaLM convention without the input embedding, the parameters a
tensor-parallel rank holds against the strategies' own count, and --shape / --model parsing."""

from __future__ import annotations

import pytest
import torch

from harness.project.model import PUBLIC_PRESETS, Decoder, Mlp, decoder_of, described, parse_shape, preset, \
    preset_names
from harness.spec import SpecError
from one_line import assert_one_line_error   # tests/one_line.py
from workloads import WORKLOADS, count_parameters


def test_llama3_8b_counted_by_hand():
    # hidden 4096, 32 layers, 32 heads of 128, 8 key/value heads (1024 wide), MLP 14336, vocabulary 128,256, untied.
    h, kv, f, v, layers = 4096, 8 * 128, 14_336, 128_256, 32
    block = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h        # wqkv, wo, gate|up and down, two RMSNorms
    total = layers * block + 2 * v * h + h                      # embedding, untied head, final RMSNorm
    model = preset("llama3-8b")
    assert model.parameters == total == 8_030_261_248          # the released weights' count
    # PaLM: 6N + 12 L H Q T with N the matmul parameters: everything but the input embedding (a lookup).
    assert model.flops_per_token == 6 * (total - v * h) + 12 * layers * 32 * 128 * 8192


@pytest.mark.parametrize("name", list(PUBLIC_PRESETS))
def test_public_presets_hold_their_published_counts(name):
    model, published, source = PUBLIC_PRESETS[name]
    assert model.shape_parameters == published, source


@pytest.mark.parametrize("name", [n for n in preset_names() if n not in PUBLIC_PRESETS])
def test_workload_presets_count_what_the_built_model_holds_and_its_flops(name):
    workload = WORKLOADS[name]
    with torch.device("meta"):
        built = workload.build_model()
    model = preset(name)
    assert model.parameters == count_parameters(built)
    assert model.flops_per_token == workload.train_flops_per_token


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "gpt2-small", "llama3-8b"])
@pytest.mark.parametrize("vocabulary", [False, True])
def test_a_tensor_parallel_rank_holds_what_the_strategies_split_leaves_it(name, vocabulary):
    from harness.strategies.tensor_parallel import split_parameter_count

    with torch.device("meta"):
        layers = WORKLOADS[name].build_layers()
    assert preset(name).held_by_rank(2, vocabulary_split=vocabulary) == split_parameter_count(layers, 2, vocabulary)


def test_the_8b_at_tp_2_keeps_its_embedding_and_untied_head_whole():
    model = preset("llama3-8b")
    blocks_split = 32 * (4096 * (4096 + 2048) + 4096 * 4096 + 3 * 4096 * 14_336)
    whole = 32 * 2 * 4096 + 2 * 128_256 * 4096 + 4096
    assert model.held_by_rank(2) == blocks_split / 2 + whole == 4_540_600_320
    # 16 bytes a parameter (autocast AdamW, nothing sharded): 67.7 GiB, not the 59.8 of an even split.
    assert round(model.held_by_rank(2) * 16 / 2**30, 1) == 67.7


def test_a_stated_count_keeps_the_shape_outside_the_blocks():
    shape = parse_shape("4096,4096,32,32,32000")
    model = decoder_of(7_000_000_000, shape)
    outside = 32000 * 4096 + 2 * 4096               # the tied embedding and the final LayerNorm
    assert model.parameters == 7_000_000_000 and model.outside_block_parameters == outside
    # The blocks hold the rest, split two ways but for their LayerNorms and row-parallel biases (6 h each).
    per_block = (7_000_000_000 - outside) / 32
    whole = 6 * 4096 * per_block / (12 * 4096**2 + 13 * 4096)
    assert model.held_by_rank(2) == pytest.approx(32 * ((per_block - whole) / 2 + whole) + outside)


def test_parse_shape_reads_numbers_then_keys():
    assert parse_shape("8192,4096,32,32,128256,kv_heads=8,ffn=14336,mlp=swiglu,tied=false") == {
        "seq_len": 8192, "n_embd": 4096, "n_head": 32, "n_layer": 32, "vocab_size": 128_256, "kv_heads": 8,
        "ffn": 14_336, "mlp": "swiglu", "tied": False}
    model = decoder_of(None, parse_shape("8192,4096,32,32,128256,kv_heads=8,ffn=14336,mlp=swiglu,tied=false"))
    assert model.parameters == preset("llama3-8b").parameters and model.mlp is Mlp.SWIGLU
    # The preset's shape as --shape takes it describes the same model.
    assert decoder_of(None, parse_shape(preset("llama3-8b").shape_text())).parameters == 8_030_261_248


@pytest.mark.parametrize("text, words", [
    ("4096,4096,32", ["SEQ,HIDDEN,HEADS,LAYERS"]),
    ("4096,4096,30,32", ["heads dividing the hidden size"]),
    ("4096,4096,32,32,kv=8", ["'kv'", "kv_heads"]),
    ("4096,4096,32,32,mlp=relu", ["allowed gelu, swiglu"]),
    ("4096,4096,32,32,ffn=0", ["whole number"]),
    ("mlp=swiglu,4096,4096,32,32", ["numbers come first"]),
])
def test_bad_shapes_name_what_is_allowed(text, words):
    with pytest.raises(ValueError) as raised:
        parse_shape(text)
    for word in words:
        assert word in str(raised.value)


@pytest.mark.parametrize("build, words", [
    (lambda: decoder_of(None, parse_shape("4096,4096,32,32,mlp=swiglu")), ["swiglu MLP needs its width"]),
    (lambda: decoder_of(None, parse_shape("4096,4096,32,32,kv_heads=8")), ["ffn="]),
    (lambda: decoder_of(None, parse_shape("4096,4096,32,32,kv_heads=5,mlp=swiglu,ffn=11008")),
     ["5 key/value heads must divide"]),
    (lambda: decoder_of(7_000_000_000, parse_shape("4096,4096,32,16")), ["of --params", "allowed"]),
    (lambda: Decoder(seq_len=1, hidden=64, heads=4, layers=2, tied=False), ["untied head needs the vocabulary"]),
    (lambda: preset("llama9"), ["unknown model 'llama9'", "llama3-70b"]),
    (lambda: described("llama3-8b", None, parse_shape("1,64,4,2")), ["not both"]),
    (lambda: described(None, None, None), ["--model PRESET", "--shape"]),
])
def test_bad_descriptions_are_one_line(build, words):
    assert_one_line_error(build, words)


def test_gqa_is_described_for_the_swiglu_block_only():
    with pytest.raises(SpecError, match="mlp=swiglu"):
        Decoder(seq_len=64, hidden=64, heads=4, kv_heads=2, layers=2)
