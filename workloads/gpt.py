"""GPT-2-style decoders (Radford et al. 2019), built as a list of layers with a tied embedding.

Layers: token+position embedding, n_layer pre-norm blocks, final LayerNorm, output head. The head reuses
the token embedding matrix (a `Tie`); sizes follow the GPT-2 paper (small 124M, medium 350M, large 774M, xl
1.5B) with its 50,257-token vocabulary and 1,024-token context. Initialisation follows GPT-2: N(0, 0.02),
residual projections scaled by 1/sqrt(2 * n_layer).

The embedding matrix has a row for every token padded up to a multiple of 64 (50,304 for GPT-2's vocabulary,
as nanoGPT and Megatron-LM's --make-vocab-size-divisible-by pad it): the data draws only the 50,257 real tokens
(workloads.data.token_batch), so the 47 extra rows are never looked up and never a target; their logits only
learn to stay low. Unpadded, the 50,257-row output matmul has no tensor-core-friendly shape and cost 61% of
GPT-2 small's step on an H200 (69.0 ms against 42.9 padded; ../shared/gpu-h200 at a3663fd). So gpt2-small
has 124,475,904 parameters, 36,096 more than the published 124,439,808; a row records both
(`describe`: `published_parameters`, and `padded_vocab_size` beside `vocab_size`).

Training FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): 6N + 12 * L * H * Q * T, where N is
the number of parameters that take part in matrix multiplies (all but the position embedding; the tied
token embedding counts once, as the output head, with its padded rows: the GPU multiplies them), L layers, H
heads, Q head size and T sequence length.
"""

from __future__ import annotations

import abc
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from workloads.attention import CausalAttention, positions_of
from workloads.base import Family, Tie, Workload
from workloads.data import token_batch


# Rows of the token embedding (and tied head) are a multiple of this (nanoGPT's 50,304; Megatron-LM's default
# --make-vocab-size-divisible-by is 128 over its tensor-parallel degree).
VOCAB_ROWS_MULTIPLE = 64


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int     # tokens the data draws from (the tokenizer's vocabulary)
    seq_len: int        # tokens per sample (also the context length)
    n_layer: int
    n_embd: int
    n_head: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_embd", "n_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd {self.n_embd} must be divisible by n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding matrix: the vocabulary rounded up to a multiple of VOCAB_ROWS_MULTIPLE."""
        return -(-self.vocab_size // VOCAB_ROWS_MULTIPLE) * VOCAB_ROWS_MULTIPLE


class TokenEmbedding(nn.Module):
    position_ids: torch.Tensor | None = None     # the tokens' places in the whole sequence (workloads.attention)

    def __init__(self, vocab_size: int, seq_len: int, n_embd: int) -> None:
        super().__init__()
        # Kept so a pipeline stage can build its own copy of this (tied) layer.
        self.init_kwargs = {"vocab_size": vocab_size, "seq_len": seq_len, "n_embd": n_embd}
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = positions_of(self, tokens.shape[1], tokens.device)
        return self.wte(tokens) + self.wpe(positions)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        self.attention_core = CausalAttention()
        for linear in (self.c_attn, self.attn_proj, self.c_fc, self.mlp_proj):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        for projection in (self.attn_proj, self.mlp_proj):  # GPT-2: scale residual projections
            nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Heads are counted from c_attn's output, not taken from the config: under tensor parallelism it holds
        # only this rank's heads, their q, k and v in that order (harness.strategies.tensor_parallel). Whole,
        # it is the same computation as split(d) into n_head heads. The sequence length too: under sequence
        # parallelism x holds this rank's slice of the tokens and c_attn's output all of them.
        batch, d = x.shape[0], x.shape[-1]
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=2)
        seq = q.shape[1]
        q, k, v = (t.reshape(batch, seq, -1, d // self.n_head) for t in (q, k, v))
        attention = self.attention_core(q, k, v)
        x = x + self.attn_proj(attention.reshape(batch, seq, -1))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class FinalNorm(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


def tied_head_forward(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits from hidden states through the token embedding matrix (the output head's weight)."""
    return F.linear(x, embedding.wte.weight)


class LMHead(nn.Module):
    """Output projection sharing its weight with the token embedding (same Parameter object)."""

    def __init__(self, embedding: TokenEmbedding) -> None:
        super().__init__()
        self.weight = embedding.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class DecoderWorkload(Workload):
    """What a decoder family shares (GPT-2's, Llama's): a config with seq_len, vocab_size, n_layer, n_head,
    head_dim and padded_vocab_size; layers embedding, blocks, final norm, head; synthetic token streams; PaLM's
    FLOPs over the family's own `matmul_params`."""

    def __init__(self, name: str, config, published_params: int | None) -> None:
        self.name = name
        self.config = config
        self.published_params = published_params

    @property
    def layer_count(self) -> int:
        return self.config.n_layer + 3   # embedding, blocks, final norm, head

    def batch(self, seed, step, indices, device):
        c = self.config
        return token_batch(seed, step, indices.to(device), c.seq_len, c.vocab_size)

    def layer_output_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A sample's hidden states (seq_len x n_embd) out of the embedding, each block and the final norm; its
        logits over the padded vocabulary out of the head."""
        c = self.config
        return ((c.seq_len, c.n_embd),) * (c.n_layer + 2) + ((c.seq_len, c.padded_vocab_size),)

    @property
    @abc.abstractmethod
    def matmul_params(self) -> int:
        """N of the PaLM formula: each family says which of its parameters take part in matrix multiplies."""

    @property
    def train_flops_per_token(self) -> float:
        c = self.config
        return palm_train_flops_per_token(self.matmul_params, c.n_layer, c.n_head, c.head_dim, c.seq_len)

    @property
    def train_flops_per_sample(self) -> float:
        return self.train_flops_per_token * self.config.seq_len

    @property
    def tokens_per_sample(self) -> int:
        return self.config.seq_len

    def describe(self) -> dict[str, object]:
        return {**super().describe(), **asdict(self.config), "padded_vocab_size": self.config.padded_vocab_size}


class GPTWorkload(DecoderWorkload):
    family = Family.GPT

    def build_layers(self) -> list[nn.Module]:
        c = self.config
        embedding = TokenEmbedding(c.padded_vocab_size, c.seq_len, c.n_embd)
        blocks = [Block(c) for _ in range(c.n_layer)]
        return [embedding, *blocks, FinalNorm(c.n_embd), LMHead(embedding)]

    def ties(self) -> tuple[Tie, ...]:
        last = self.config.n_layer + 2
        return (Tie(key="token_embedding", owner=0, user=last, weight_attr="wte.weight",
                    user_forward=tied_head_forward),)

    @property
    def matmul_params(self) -> int:
        """N of the PaLM formula: every parameter but the position embedding, the tied matrix once (padded rows
        included: the head's matmul computes their logits)."""
        c = self.config
        per_block = 12 * c.n_embd**2 + 13 * c.n_embd   # qkv, proj, fc, proj weights+biases, 2 LayerNorms
        return c.padded_vocab_size * c.n_embd + c.n_layer * per_block + 2 * c.n_embd


def palm_train_flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """6N + 12 * L * H * Q * T (PaLM, Chowdhery et al. 2022, appendix B)."""
    return 6.0 * n_params + 12.0 * n_layer * n_head * head_dim * seq_len


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> GPTConfig:
    return GPTConfig(vocab_size=50257, seq_len=1024, n_layer=n_layer, n_embd=n_embd, n_head=n_head)


GPT_CONFIGS = {
    "gpt-tiny": (GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_embd=64, n_head=4), None),
    # gpt-tiny at 4 times its sequence: the long-context matrix's CPU shape, whose sequence a degree of 2 or 4
    # splits into shards of 128 or 64 tokens (and 8 chunks of 32 under the causal ring's load balancing).
    "gpt-tiny-long": (GPTConfig(vocab_size=512, seq_len=256, n_layer=4, n_embd=64, n_head=4), None),
    "gpt2-small": (_gpt2(12, 768, 12), 124_439_808),
    "gpt2-medium": (_gpt2(24, 1024, 16), 354_823_168),
    "gpt2-large": (_gpt2(36, 1280, 20), 774_030_080),
    "gpt2-xl": (_gpt2(48, 1600, 25), 1_557_611_200),
}
