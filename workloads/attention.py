"""What sequence (context) parallelism replaces inside the decoder blocks, and nothing else: the attention core and
the positions of the tokens a block sees.

`CausalAttention` is the core every decoder block calls: causal softmax attention over (batch, sequence, heads,
head_dim) q, k and v (k and v with fewer heads under grouped-query attention), through
`scaled_dot_product_attention`, as the blocks called it inline before (the same views, the same kernel, the same
values). Ulysses (harness.strategies.ulysses) wraps it in DeepSpeed's `DistributedAttention`, which hands it the
whole sequence for a rank's heads; torch's ring attention (harness.strategies.cp) intercepts the kernel it calls.

`position_ids`: a block sees its tokens' places in the whole sequence, which a rank holding a slice of it is told
(`set_positions`): GPT's position embedding and Llama's rotary angles read them. None (every plain run): 0..s-1.

A planted causal-mask bug (`leak_at`, harness.rank.faults.CAUSAL_LEAK) lets the last query before each shard
boundary see the first key after it: one future token a boundary, what a wrong offset in a sharded mask does. Only
a cell that shards the sequence has a boundary to leak across.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim), causal) v over (batch, seq, heads, head_dim) tensors; returns the same
    layout with q's heads."""

    def __init__(self) -> None:
        super().__init__()
        self.leak_at: tuple[int, ...] = ()      # a planted bug's shard boundaries; () in an honest run

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        grouped = q.shape[1] != k.shape[1]
        if self.leak_at:
            mask = leaking_causal_mask(q.shape[-2], self.leak_at, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return out.transpose(1, 2)


def leaking_causal_mask(seq: int, boundaries: Sequence[int], device: torch.device) -> torch.Tensor:
    """The causal mask (True: may attend) with one future key let through at each boundary b: query b - 1 sees
    key b."""
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    for boundary in boundaries:
        mask[boundary - 1, boundary] = True
    return mask


def positions_of(module: nn.Module, seq: int, device: torch.device) -> torch.Tensor:
    """The places in the whole sequence of the `seq` tokens `module` sees: its `position_ids` where a strategy set
    them, else 0..seq-1."""
    ids = getattr(module, "position_ids", None)
    return torch.arange(seq, device=device) if ids is None else ids


def set_positions(model: nn.Module, ids: torch.Tensor | None) -> None:
    """Tell every position-reading module of `model` (those with a `position_ids` attribute) the places of the tokens
    it sees; None: 0..s-1 again."""
    for module in model.modules():
        if hasattr(module, "position_ids"):
            module.position_ids = ids


def attention_cores(model: nn.Module) -> list[CausalAttention]:
    return [module for module in model.modules() if isinstance(module, CausalAttention)]
