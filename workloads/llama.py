"""Llama-style decoders (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024), built as a list of layers.

Layers: token embedding, n_layer pre-norm blocks, final RMSNorm, output head. A block is RMSNorm (Zhang and
Sennrich 2019) -> attention with rotary position embeddings (Su et al. 2021) and grouped-query attention
(Ainslie et al. 2023: n_kv_head key/value heads, each shared by n_head / n_kv_head query heads) -> residual ->
RMSNorm -> SwiGLU MLP (Shazeer 2020: down(silu(gate(x)) * up(x))) -> residual. No biases. The output head is
its own matrix (`tie_embeddings=False`, Llama 3 8B) or the token embedding's (Llama 3.2 1B ships tied embeddings,
`tie_word_embeddings: true` in its config, and its published 1.24B counts that matrix once).

The projections are fused as Megatron-LM fuses them: one `wqkv` (rows q | k | v: n_head, n_kv_head and n_kv_head
heads of head_dim) and one `w_gate_up` (rows gate | up). A block splits wqkv's output in those proportions from
its own width, not from the config, so that a tensor-parallel rank holding its share of every part computes its
heads alone, as the GPT block counts its heads from c_attn's output.

Rotary angles are computed in forward from q's sequence length, not kept as buffers: a buffer would be broadcast
by DDP, saved in checkpoints and left uninitialised by a meta-device build. The Llama 3.1+ long-context scaling of
the rotary frequencies is not applied (it changes no FLOP and no byte a step moves).

The vocabulary is padded to a multiple of 64 rows as GPT's is (workloads.gpt.VOCAB_ROWS_MULTIPLE; the data draws
only the real tokens). Llama 3's 128,256 is 64 x 2,004 already; llama-tiny's 500 is padded to 512, so CPU runs
exercise the padded rows.

Training FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): 6N + 12 L H Q T, N the parameters that take
part in matrix multiplies: all of them but the input embedding, a lookup (when tied, the matrix counts once, as the
head; padded rows included, the GPU multiplies them). Grouped-query attention enters through N alone (k and v are
d x n_kv_head x head_dim); every query head still attends over T keys, so the attention term keeps H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from workloads.attention import CausalAttention, positions_of
from workloads.base import Family, Tie
from workloads.gpt import VOCAB_ROWS_MULTIPLE, DecoderWorkload


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int             # tokens the data draws from (the tokenizer's vocabulary)
    seq_len: int                # tokens per sample
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int              # key/value heads, each shared by n_head / n_kv_head query heads
    intermediate_size: int      # the SwiGLU MLP's width
    tie_embeddings: bool = False
    rope_theta: float = 500_000.0     # Llama 3's rotary base
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        kind = type(self).__name__
        for name in ("vocab_size", "seq_len", "n_layer", "n_embd", "n_head", "n_kv_head", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{kind}.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"{kind}.n_head {self.n_head} must divide n_embd {self.n_embd} into heads of an "
                             "even size (rotary embeddings rotate pairs)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{kind}.n_kv_head {self.n_kv_head} must divide n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding matrix and head: the vocabulary rounded up to a multiple of VOCAB_ROWS_MULTIPLE."""
        return -(-self.vocab_size // VOCAB_ROWS_MULTIPLE) * VOCAB_ROWS_MULTIPLE

    @property
    def attention_parameters(self) -> int:
        """wqkv and wo."""
        d, hd = self.n_embd, self.head_dim
        return d * (self.n_head + 2 * self.n_kv_head) * hd + self.n_head * hd * d

    @property
    def block_parameters(self) -> int:
        """wqkv, wo, w_gate_up, w_down and the two RMSNorms' weights."""
        return self.attention_parameters + 3 * self.n_embd * self.intermediate_size + 2 * self.n_embd

    def parameters_with_blocks_of(self, block: int) -> int:
        """The model's parameters with blocks of `block` each: embedding (+ head unless tied), blocks, final norm."""
        matrices = 1 if self.tie_embeddings else 2
        return matrices * self.padded_vocab_size * self.n_embd + self.n_layer * block + self.n_embd

    @property
    def parameters(self) -> int:
        """Every parameter, a tied matrix once."""
        return self.parameters_with_blocks_of(self.block_parameters)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, theta: float,
           positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (batch, seq, heads, head_dim) rotated by their `positions` in the sequence (0..seq-1 where None; Su
    et al. 2021, in the half-split layout of Hugging Face's Llama: dimension i pairs with i + head_dim / 2)."""
    seq, dim = q.shape[1], q.shape[-1]
    if positions is None:
        positions = torch.arange(seq, device=q.device)
    inverse = 1.0 / theta ** (torch.arange(0, dim, 2, device=q.device, dtype=torch.float32) / dim)
    angles = torch.outer(positions.to(torch.float32), inverse)
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)       # (seq, 1, head_dim): the same for every head
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)


class LlamaEmbedding(nn.Module):
    def __init__(self, vocab_size: int, n_embd: int) -> None:
        super().__init__()
        # Kept so a pipeline stage can build its own copy of this layer where it is tied to the head.
        self.init_kwargs = {"vocab_size": vocab_size, "n_embd": n_embd}
        self.tok_embeddings = nn.Embedding(vocab_size, n_embd)
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)


class LlamaBlock(nn.Module):
    """Attention (`attend`), then the feed-forward part (`feed_forward`: here the SwiGLU MLP; workloads.moe's block
    replaces it with experts and keeps the rest). Built and initialised in one fixed order, so that a seed gives
    every strategy the same weights."""

    position_ids: torch.Tensor | None = None     # the tokens' places in the whole sequence (workloads.attention)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d, hd = config.n_embd, config.head_dim
        self.head_dim = hd
        self.group = config.n_head // config.n_kv_head      # query heads a key/value head serves
        self.rope_theta = config.rope_theta
        self.attention_norm = nn.RMSNorm(d, eps=config.norm_eps)
        self.wqkv = nn.Linear(d, (config.n_head + 2 * config.n_kv_head) * hd, bias=False)
        self.wo = nn.Linear(config.n_head * hd, d, bias=False)
        self.ffn_norm = nn.RMSNorm(d, eps=config.norm_eps)
        self.attention_core = CausalAttention()
        self.build_feed_forward(config)
        self.initialise(config)

    def build_feed_forward(self, config) -> None:
        self.w_gate_up = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def initialise(self, config) -> None:
        for linear in (self.wqkv, self.wo, self.w_gate_up, self.w_down):
            nn.init.normal_(linear.weight, std=0.02)
        for projection in (self.wo, self.w_down):      # as GPT-2 scales its residual projections
            nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """x and its attention's output, added."""
        qkv = self.wqkv(self.attention_norm(x))
        batch, seq = qkv.shape[0], qkv.shape[1]
        # This module's key/value heads, from its own width: (group + 2) heads of head_dim a key/value head.
        kv_heads = qkv.shape[-1] // (self.head_dim * (self.group + 2))
        sizes = (self.group * kv_heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim)
        q, k, v = (t.reshape(batch, seq, -1, self.head_dim) for t in qkv.split(sizes, dim=-1))
        q, k = rotary(q, k, self.rope_theta, positions_of(self, seq, q.device))
        attention = self.attention_core(q, k, v)
        return x + self.wo(attention.reshape(batch, seq, -1))

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(h).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaFinalNorm(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class LlamaHead(nn.Module):
    """The output projection, a matrix of its own."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.output = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        nn.init.normal_(self.output.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(x)


def tied_head_forward(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits from hidden states through the token embedding matrix (a tied head's weight)."""
    return F.linear(x, embedding.tok_embeddings.weight)


class LlamaTiedHead(nn.Module):
    """The output projection sharing its weight with the token embedding (same Parameter object)."""

    def __init__(self, embedding: LlamaEmbedding) -> None:
        super().__init__()
        self.weight = embedding.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LlamaWorkload(DecoderWorkload):
    family = Family.LLAMA
    block_class = LlamaBlock            # workloads.moe's family keeps the layers around MoE blocks

    def build_layers(self) -> list[nn.Module]:
        c = self.config
        embedding = LlamaEmbedding(c.padded_vocab_size, c.n_embd)
        blocks = [self.block_class(c) for _ in range(c.n_layer)]
        head = LlamaTiedHead(embedding) if c.tie_embeddings else LlamaHead(c)
        return [embedding, *blocks, LlamaFinalNorm(c), head]

    def ties(self) -> tuple[Tie, ...]:
        if not self.config.tie_embeddings:
            return ()
        return (Tie(key="token_embedding", owner=0, user=self.config.n_layer + 2,
                    weight_attr="tok_embeddings.weight", user_forward=tied_head_forward),)

    @property
    def matmul_params(self) -> int:
        """N of the PaLM formula: every parameter but the untied input embedding (a lookup); tied, the matrix once."""
        c = self.config
        return c.parameters - (0 if c.tie_embeddings else c.padded_vocab_size * c.n_embd)


LLAMA_CONFIGS = {
    # For CPU: 2 key/value heads under 4 query heads, so tensor parallelism of 2 keeps a group whole on a rank and
    # 4 does not; a vocabulary of 500 padded to 512 rows.
    "llama-tiny": (LlamaConfig(vocab_size=500, seq_len=64, n_layer=4, n_embd=64, n_head=4, n_kv_head=2,
                               intermediate_size=192), None),
    # llama-tiny at 4 times its sequence (the long-context matrix's): its 2 key/value heads take a sequence-parallel
    # degree of 2 under Ulysses, and refuse 4.
    "llama-tiny-long": (LlamaConfig(vocab_size=500, seq_len=256, n_layer=4, n_embd=64, n_head=4, n_kv_head=2,
                                    intermediate_size=192), None),
    # meta-llama/Llama-3.2-1B's config.json: hidden 2048, 16 layers, 32 heads, 8 key/value heads, intermediate
    # 8192, vocabulary 128,256, tied embeddings. Its model card: "1B (1.23B)", "Shared Embeddings: Yes"; the
    # released weights hold 1,235,814,400. A sequence of 2048 tokens.
    "llama3.2-1b": (LlamaConfig(vocab_size=128_256, seq_len=2048, n_layer=16, n_embd=2048, n_head=32, n_kv_head=8,
                                intermediate_size=8192, tie_embeddings=True), 1_235_814_400),
    # meta-llama/Meta-Llama-3-8B's config.json: hidden 4096, 32 layers, 32 heads, 8 key/value heads, intermediate
    # 14336, vocabulary 128,256, untied; the released weights hold 8,030,261,248 ("8.03B"). Its pretraining context
    # of 8192 tokens.
    "llama3-8b": (LlamaConfig(vocab_size=128_256, seq_len=8192, n_layer=32, n_embd=4096, n_head=32, n_kv_head=8,
                              intermediate_size=14_336), 8_030_261_248),
}
