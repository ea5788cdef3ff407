"""Mixture-of-Experts decoders: the Llama block (workloads.llama) with its MLP replaced by E SwiGLU experts and a top-k
router, as Mixtral builds it (Jiang et al. 2024, "Mixtral of Experts"), with DeepSeek-MoE's shared experts as an
option (Dai et al. 2024: experts every token passes through, beside the routed ones).

The router (Shazeer et al. 2017; Fedus et al. 2022, Switch Transformer): logits = x W_r (no bias), probabilities their
softmax over the E experts (in fp32), each token sent to its k most probable experts with those k probabilities
renormalised to sum to 1 as its gate weights (Mixtral's `softmax -> topk -> divide by their sum`; DeepSpeed-MoE's
top-2 gate does the same). A token's output is the gate-weighted sum of its k experts' outputs, plus the shared
experts' where the shape has them.

Dropless: every expert takes every token routed to it (no capacity, no token dropped), the tokens grouped by expert
and each expert's matrix multiply done on its group, as MegaBlocks (Gale et al. 2022) and torchtitan do. A strategy
that caps an expert's tokens must set its capacity where it drops none to be compared with this (its rows record it).

The load-balancing loss (Fedus et al. 2022, eq. 4, with GShard's top-k counting, Lepikhin et al. 2020): E x sum_e f_e
P_e, f_e the share of the k T routing choices that went to expert e times k (so each f_e is the fraction of tokens e
received) and P_e the mean router probability of e over the T tokens; k where routing is uniform. It reaches the
gradients as Megatron-Core's `MoEAuxLossAutoScaler` takes it there: the block's output is returned unchanged and its
backward adds `aux_scale` x d(loss)/d(router), so the model stays a list of layers whose loss is cross-entropy (a
pipeline stage, a checkpointed block and every strategy's step need no other term). `aux_scale` is the coefficient
times the factor a trainer multiplies its cross-entropy by (1 / its micro-batches): then gradient accumulation and
the ranks' gradient average treat both terms alike.

Experts are stored stacked, one (E, d, 2F) gate-and-up tensor and one (E, F, d) down tensor a block, as torchtitan's
GroupedExperts holds them: an expert-parallel rank's share is a slice of dimension 0.

Counts (`MoEConfig`): total parameters count every expert; active ones a token's k routed experts, the shared experts,
the router and everything outside the experts. Training FLOPs per token are PaLM's (Chowdhery et al. 2022, appendix
B), 6 N + 12 L H Q T, with N the active parameters that take part in matrix multiplies (the router's included, the
input embedding's lookup not): a token's matmuls touch only its experts (Switch Transformer, section 2: "the same
FLOPs per token" as the dense model of the active size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from workloads.base import Family
from workloads.llama import LlamaBlock, LlamaConfig, LlamaWorkload


@dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """The Llama config (its attention and vocabulary), with `intermediate_size` each expert's SwiGLU width."""

    n_experts: int              # routed experts a block
    top_k: int                  # experts a token is routed to
    n_shared_experts: int = 0           # experts every token passes through (DeepSeek-MoE), of the same width
    aux_loss_coef: float = 0.01         # the load-balancing loss's coefficient (Switch Transformer's alpha)
    rope_theta: float = 1_000_000.0     # Mixtral's rotary base

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig needs n_experts >= 1 and 1 <= top_k <= n_experts, got {self.n_experts} and "
                             f"{self.top_k}")
        if self.n_shared_experts < 0 or self.aux_loss_coef < 0:
            raise ValueError("MoEConfig.n_shared_experts and aux_loss_coef must be >= 0")

    @property
    def expert_parameters(self) -> int:
        """One expert: its gate, up and down matrices."""
        return 3 * self.n_embd * self.intermediate_size

    def _block(self, experts: int) -> int:
        """A block with `experts` routed experts counted: attention, the experts, the shared ones, router, 2 norms."""
        return (self.attention_parameters + (experts + self.n_shared_experts) * self.expert_parameters
                + self.n_embd * self.n_experts + 2 * self.n_embd)

    @property
    def block_parameters(self) -> int:
        return self._block(self.n_experts)

    @property
    def active_parameters(self) -> int:
        """The parameters one token's forward pass uses: its k routed experts a block, and everything else."""
        return self.parameters_with_blocks_of(self._block(self.top_k))

    @property
    def active_matmul_parameters(self) -> int:
        """N of the PaLM formula: the active parameters but the untied input embedding (a lookup)."""
        return self.active_parameters - (0 if self.tie_embeddings else self.padded_vocab_size * self.n_embd)


def routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities over the experts in fp32, each token's k chosen experts, their gate weights renormalised to
    sum to 1) from router logits (tokens, E)."""
    probabilities = logits.float().softmax(dim=-1)
    weights, chosen = probabilities.topk(top_k, dim=-1)
    return probabilities, chosen, weights / weights.sum(dim=-1, keepdim=True)


def load_balancing_loss(probabilities: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """E x sum_e f_e P_e (Switch Transformer eq. 4, top-k counted as GShard does): f_e the fraction of the T tokens
    routed to e among their k choices, P_e e's mean probability."""
    tokens, experts = probabilities.shape
    received = torch.bincount(chosen.reshape(-1), minlength=experts).to(probabilities.dtype) / tokens
    return experts * (received * probabilities.mean(dim=0)).sum()


# Gaps between a token's k-th and (k+1)-th router probability counted as near-ties (`MoEFeedForward.near_ties`): a
# choice two layouts' rounding may make differently (harness.derive.parity takes the one for its arithmetic).
NEAR_TIE_MARGINS = (1e-6, 1e-4, 1e-2)


class AuxLossToGradients(torch.autograd.Function):
    """Returns `output` unchanged; its backward passes `output`'s gradient through and gives `aux` the gradient
    `scale`, so that `aux` x scale is in the gradients as if added to the loss (Megatron-Core's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad_output.device), None


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked: w_gate_up (E, d, 2F), w_down (E, F, d)."""

    def __init__(self, n_experts: int, n_embd: int, width: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, n_embd, 2 * width))
        self.w_down = nn.Parameter(torch.empty(n_experts, width, n_embd))

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w_gate_up[index]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down[index]

    def forward(self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's gate-weighted sum over its chosen experts' outputs, every token kept (dropless)."""
        top_k = chosen.shape[-1]
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)          # the (token, choice) pairs grouped by expert
        token_of = order // top_k
        counts = torch.bincount(flat, minlength=self.w_gate_up.shape[0]).tolist()
        grouped = tokens[token_of]
        outputs, start = [], 0
        for index, count in enumerate(counts):
            outputs.append(self.expert(index, grouped[start:start + count]))
            start += count
        weighted = torch.cat(outputs) * weights.reshape(-1)[order].unsqueeze(-1).to(tokens.dtype)
        return torch.zeros_like(tokens).index_add_(0, token_of, weighted)


class MoEFeedForward(nn.Module):
    """The router, the routed experts and the shared ones, with the load-balancing loss sent to the gradients.

    What the router chose is kept for the harness (harness.rank.routing): `routed_tokens`, each expert's tokens summed
    over the forward passes since `forget_routing`; `smallest_margin`, the smallest gap over those tokens between
    the probability of a token's k-th choice and of its best expert not chosen, in fp32; and `near_ties`, how many
    tokens' gaps were under each of NEAR_TIE_MARGINS: a rounding could have flipped those tokens' choices. A forward
    run again inside backward (activation checkpointing's recomputation) is not counted twice."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        d, width = config.n_embd, config.intermediate_size
        self.top_k = config.top_k
        self.aux_scale = config.aux_loss_coef      # a trainer with n micro-batches sets coef / n (module docstring)
        self.router = nn.Linear(d, config.n_experts, bias=False)
        self.experts = GroupedExperts(config.n_experts, d, width)
        self.shared = (GroupedExperts(1, d, config.n_shared_experts * width) if config.n_shared_experts else None)
        self.routed_tokens = torch.zeros(config.n_experts, dtype=torch.long)
        self.smallest_margin = torch.tensor(math.inf)
        self.near_ties = torch.zeros(len(NEAR_TIE_MARGINS), dtype=torch.long)

    def forget_routing(self) -> None:
        self.routed_tokens = torch.zeros_like(self.routed_tokens)
        self.smallest_margin = torch.tensor(math.inf, device=self.routed_tokens.device)
        self.near_ties = torch.zeros_like(self.near_ties)

    def _record(self, probabilities: torch.Tensor, chosen: torch.Tensor) -> None:
        if torch._C._current_graph_task_id() != -1:      # a recomputation inside backward
            return
        experts = probabilities.shape[-1]
        counts = torch.bincount(chosen.reshape(-1), minlength=experts).detach()
        self.routed_tokens = self.routed_tokens.to(counts.device) + counts
        if self.top_k < experts:
            top = probabilities.detach().topk(self.top_k + 1, dim=-1).values
            gaps = top[:, -2] - top[:, -1]
            self.smallest_margin = torch.minimum(self.smallest_margin.to(gaps.device), gaps.min())
            below = (gaps.unsqueeze(-1) < torch.tensor(NEAR_TIE_MARGINS, device=gaps.device)).sum(dim=0)
            self.near_ties = self.near_ties.to(gaps.device) + below

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.reshape(-1, h.shape[-1])
        probabilities, chosen, weights = routing(self.router(tokens), self.top_k)
        out = self.experts(tokens, chosen, weights)
        if self.shared is not None:
            out = out + self.shared.expert(0, tokens)
        self._record(probabilities, chosen)
        if self.training and torch.is_grad_enabled() and self.aux_scale:
            out = AuxLossToGradients.apply(out, load_balancing_loss(probabilities, chosen), self.aux_scale)
        return out.reshape(h.shape)


class MoEBlock(LlamaBlock):
    """workloads.llama's block, its MLP replaced by `moe` (MoEFeedForward)."""

    def build_feed_forward(self, config: MoEConfig) -> None:
        self.moe = MoEFeedForward(config)

    def initialise(self, config: MoEConfig) -> None:
        scaled = 0.02 / math.sqrt(2 * config.n_layer)        # the residual projections, as the Llama block's
        for weight in (self.wqkv.weight, self.moe.router.weight, self.moe.experts.w_gate_up):
            nn.init.normal_(weight, std=0.02)
        nn.init.normal_(self.wo.weight, std=scaled)
        nn.init.normal_(self.moe.experts.w_down, std=scaled)
        if self.moe.shared is not None:
            nn.init.normal_(self.moe.shared.w_gate_up, std=0.02)
            nn.init.normal_(self.moe.shared.w_down, std=scaled)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(h)


class MoEWorkload(LlamaWorkload):
    """Embedding, n_layer MoE blocks, final RMSNorm, head: the Llama family's layers with MoE blocks. Its FLOPs per
    token count the active parameters (module docstring)."""

    family = Family.MOE
    block_class = MoEBlock

    @property
    def matmul_params(self) -> int:
        return self.config.active_matmul_parameters

    def precision_refusal(self, precision: str) -> str | None:
        """fp16's loss scaling multiplies the loss before backward, which the load-balancing loss's gradient, sent by
        AuxLossToGradients at a fixed scale, would not get: unscaled, it would reach the weights divided by the loss
        scale. Megatron passes the scale to its MoEAuxLossAutoScaler; nothing here does yet."""
        if precision == "fp16":
            return (f"{self.name} cannot train in fp16: its load-balancing loss reaches the gradients outside fp16's "
                    "loss scaling, so it would be divided by the loss scale (fp32 or bf16 train it)")
        return None

    def scale_auxiliary_losses(self, layers: list[nn.Module], factor: float) -> None:
        """Each block's load-balancing loss reaches the gradients at the coefficient times `factor`, the factor
        the trainer multiplies each micro-batch's cross-entropy by (module docstring)."""
        for layer in layers:
            for module in layer.modules():
                if isinstance(module, MoEFeedForward):
                    module.aux_scale = self.config.aux_loss_coef * factor

    def describe(self) -> dict[str, object]:
        c = self.config
        return {**super().describe(), "active_parameters": c.active_parameters}


MOE_CONFIGS = {
    # For CPU: 4 experts, 2 a token, each of width 96, under llama-tiny's attention (4 query heads over 2 key/value
    # heads) at 4 blocks; 411,200 parameters, 263,744 active.
    "moe-tiny": (MoEConfig(vocab_size=500, seq_len=64, n_layer=4, n_embd=64, n_head=4, n_kv_head=2, n_experts=4,
                           top_k=2, intermediate_size=96), None),
    # mistralai/Mixtral-8x7B-v0.1's config.json: hidden 4096, 32 layers, 32 heads, 8 key/value heads, 8 local
    # experts, 2 a token, intermediate 14336, vocabulary 32,000, untied, rope_theta 1e6; the released weights hold
    # 46,702,792,704 ("46.7B"; the paper: 47B parameters, 13B active). A sequence of 4096 tokens.
    "mixtral-8x7b": (MoEConfig(vocab_size=32_000, seq_len=4096, n_layer=32, n_embd=4096, n_head=32, n_kv_head=8,
                               n_experts=8, top_k=2, intermediate_size=14_336), 46_702_792_704),
}
