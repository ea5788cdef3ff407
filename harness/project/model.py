"""A decoder-only transformer described by its shape alone, as `harness plan`, `harness memory` and `harness project`
take it: from `--model PRESET` (every registered transformer workload and the public shapes users plan for) or
from `--shape SEQ,HIDDEN,HEADS,LAYERS[,VOCAB][,key=value...]`.

    python -c "from harness.project.model import preset; print(preset('llama3-8b').describe())"

Two block families, the two the workloads build and whose activations harness.derive.activations measured:

- **gelu** (GPT's, workloads/gpt.py): LayerNorm (weight and bias) before attention and before an MLP of `ffn`
  features (4 h by default) with GeLU, every linear layer with a bias;
- **swiglu** (Llama's, workloads/llama.py): RMSNorm, grouped-query attention (`kv_heads` key/value heads), a SwiGLU
  MLP `ffn` wide, no biases.

Parameters (each family's own layers, as `count_parameters` counts a built model; tests/test_model.py holds them
to the workloads and to the published counts): a gelu block holds 4 h^2 + 4 h of attention (q|k|v and the
projection, with biases), 2 h f + f + h of MLP and 4 h of its two LayerNorms; a swiglu block h (h + 2 h_kv) + h^2 of
attention (h_kv = kv_heads x h / heads), 3 h f of MLP and 2 h of RMSNorms. Outside the blocks: the token
embedding V h (V the rows the model holds: a padded vocabulary), a learned position table (GPT-2's, `positions`
rows) of positions x h, the final norm (2 h or h) and, untied, the output head V h.

FLOPs a token (PaLM, Chowdhery et al. 2022, appendix B): 6N + 12 L H Q T, N the parameters that take part in a
matrix multiply: all of them but the lookups, i.e. less the input embedding when the head is untied (tied, the
matrix counts once, as the head) and less a learned position table. The convention of the workloads' own
`train_flops_per_token`, and of Megatron-LM's `num_floating_point_operations` (12 L h^2 (... + V / (2 L h)): the head
counted, the embedding not).

Under tensor parallelism (harness.strategies.tensor_parallel: column-parallel weights and biases and row-parallel
weights split t ways; norms, row-parallel biases, the embeddings and the head whole unless loss parallelism splits
the vocabulary), a rank holds `held_by_rank`. With `--params` the user's count is kept and the shape says how it
divides: the blocks hold what the count leaves outside them.

Torch-free, but the workloads' own presets, which it reads from workloads.WORKLOADS when asked for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, Mapping

from harness.spec import SpecError

# The rows a workload pads its vocabulary to (workloads.gpt.VOCAB_ROWS_MULTIPLE): the public presets follow it.
VOCAB_ROWS_MULTIPLE = 64
# A --params whose shape holds less than half of it or more than 10% over it describes another model.
SHAPE_TOLERANCE = (0.5, 1.1)


class Mlp(enum.StrEnum):
    GELU = "gelu"           # GPT's block: LayerNorm, biases, GeLU MLP
    SWIGLU = "swiglu"       # Llama's block: RMSNorm, no biases, SwiGLU MLP, grouped-query attention


@dataclass(frozen=True, kw_only=True, slots=True)
class Decoder:
    """A decoder described by its shape (module docstring); `stated_parameters` where the user gave the count."""

    seq_len: int
    hidden: int
    heads: int
    layers: int
    vocab: int | None = None            # rows of the embedding (and of an untied head): a padded vocabulary
    kv_heads: int | None = None         # None: every head its own key and value (multi-head attention)
    ffn: int | None = None              # the MLP's width; None: 4 h (gelu only)
    mlp: Mlp = Mlp.GELU
    tied: bool = True                   # the head reuses the token embedding
    positions: int = 0                  # rows of a learned position table (GPT-2's, GPT-3's), 0 for rotary/none
    stated_parameters: int | None = None
    name: str = ""                      # the preset's, where it came from one
    # Mixture-of-Experts (workloads/moe.py): the swiglu MLP replaced by `experts` routed experts, each `ffn` wide, a
    # token running `top_k` of them chosen by a router (a linear layer of h x experts), and `shared_experts` every
    # token runs (DeepSeek-MoE's); experts 0: a dense MLP.
    experts: int = 0
    top_k: int = 2
    shared_experts: int = 0

    def __post_init__(self) -> None:
        for field_name in ("seq_len", "hidden", "heads", "layers"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{field_name} must be a whole number >= 1, got {value!r}")
        for field_name in ("vocab", "kv_heads", "ffn", "stated_parameters"):
            value = getattr(self, field_name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SpecError(f"{field_name} must be a whole number >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise SpecError(f"the {self.heads} heads must divide the hidden size {self.hidden}")
        if self.heads % self.kv_heads_count:
            raise SpecError(f"the {self.kv_heads_count} key/value heads must divide the {self.heads} heads")
        for field_name in ("experts", "shared_experts"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{field_name} must be a whole number >= 0, got {value!r}")
        if self.experts and self.mlp is not Mlp.SWIGLU:
            raise SpecError("experts are described for the swiglu (Llama) block only, as workloads/moe.py builds them: "
                            "add mlp=swiglu")
        if self.experts and not (isinstance(self.top_k, int) and 1 <= self.top_k <= self.experts):
            raise SpecError(f"top_k must be a whole number from 1 to the {self.experts} experts, got {self.top_k!r}")
        if self.shared_experts and not self.experts:
            raise SpecError("shared_experts go beside routed experts: give experts=N too")
        if self.mlp is Mlp.SWIGLU and self.ffn is None:
            raise SpecError("a swiglu MLP needs its width: ffn=N (Llama 3 8B: 14336)")
        if self.mlp is Mlp.GELU and self.kv_heads_count != self.heads:
            raise SpecError("grouped-query attention (kv_heads) is described for the swiglu (Llama) block only: "
                            "add mlp=swiglu")
        if not self.tied and self.vocab is None:
            raise SpecError("an untied head needs the vocabulary: give VOCAB")
        if self.stated_parameters is not None:
            low, high = SHAPE_TOLERANCE
            ratio = self.shape_parameters / self.stated_parameters
            if not low <= ratio <= high:
                raise SpecError(f"the shape holds {self.shape_parameters:,} parameters, {ratio:.0%} of --params "
                                f"{self.stated_parameters:,}; allowed: {low:.0%} to {high:.0%}")
            if self.stated_parameters <= self.outside_block_parameters:
                raise SpecError(f"--params {self.stated_parameters:,} leaves nothing for the blocks once the "
                                f"embeddings and head take {self.outside_block_parameters:,}")

    # ---- the shape ----

    @property
    def kv_heads_count(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_width(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def vocab_rows(self) -> int:
        return self.vocab or 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def mlps_a_token(self) -> int:
        """The SwiGLU MLPs a token runs in a block: 1 dense, or its top_k routed experts and the shared ones."""
        return self.top_k + self.shared_experts if self.is_moe else 1

    # ---- parameters ----

    @property
    def block_split_parameters(self) -> int:
        """A block's parameters tensor parallelism divides: column-parallel weights and biases, row-parallel
        weights (harness.strategies.tensor_parallel.split_parameter_count)."""
        h, f = self.hidden, self.ffn_width
        if self.mlp is Mlp.GELU:       # c_attn 3h^2 + 3h, c_proj h^2, c_fc h f + f, mlp proj f h
            return 4 * h * h + 3 * h + 2 * h * f + f
        kv = self.kv_heads_count * self.head_dim
        mlps = self.experts + self.shared_experts if self.is_moe else 1
        return h * (h + 2 * kv) + h * h + mlps * 3 * h * f

    @property
    def block_whole_parameters(self) -> int:
        """A block's parameters every tensor-parallel rank keeps whole: norms and row-parallel biases, and an MoE
        block's router (h x experts, no bias)."""
        h = self.hidden
        return 4 * h + 2 * h if self.mlp is Mlp.GELU else 2 * h + h * self.experts

    @property
    def routed_expert_parameters(self) -> float:
        """Every block's routed experts (3 h f each: gate, up and down), the stated count's share of them: what
        expert parallelism shards over its ranks."""
        return self.layers * self.experts * 3 * self.hidden * self.ffn_width * self._block_scale

    @property
    def active_parameters(self) -> float:
        """The parameters a token runs through: all but the routed experts it is not sent to ((experts - top_k) of
        each block's), as Mixtral counts its 12.9B 'active' of 46.7B; every parameter of a dense model."""
        idle = self.layers * (self.experts - self.top_k) * 3 * self.hidden * self.ffn_width * self._block_scale
        return self.parameters - (idle if self.is_moe else 0.0)

    @property
    def block_parameters(self) -> int:
        return self.block_split_parameters + self.block_whole_parameters

    @property
    def final_norm_parameters(self) -> int:
        return (2 if self.mlp is Mlp.GELU else 1) * self.hidden

    @property
    def embedding_parameters(self) -> int:
        """The token embedding's matrix."""
        return self.vocab_rows * self.hidden

    @property
    def outside_block_parameters(self) -> int:
        """The token embedding, a learned position table, the final norm and an untied head."""
        head = 0 if self.tied else self.embedding_parameters
        return self.embedding_parameters + self.positions * self.hidden + self.final_norm_parameters + head

    @property
    def shape_parameters(self) -> int:
        """Every parameter of the shape (a tied matrix once), as `count_parameters` counts a built model."""
        return self.layers * self.block_parameters + self.outside_block_parameters

    @property
    def parameters(self) -> int:
        return self.shape_parameters if self.stated_parameters is None else self.stated_parameters

    @property
    def _block_scale(self) -> float:
        """The stated count's blocks over the shape's: 1 without --params."""
        shape_blocks = self.layers * self.block_parameters
        return (self.parameters - self.outside_block_parameters) / shape_blocks

    @property
    def matmul_parameters(self) -> float:
        """N of PaLM's formula: every parameter a token's matmuls run but the lookups (module docstring); of an MoE
        model, its active parameters (the router's h x experts among them)."""
        lookups = self.positions * self.hidden + (0 if self.tied else self.embedding_parameters)
        return self.active_parameters - lookups

    @property
    def flops_per_token(self) -> float:
        """PaLM's 6N + 12 L H Q T, N the matmul parameters (the input embedding and position table left out)."""
        return 6.0 * self.matmul_parameters + 12.0 * self.layers * self.heads * self.head_dim * self.seq_len

    def held_by_rank(self, tensor_parallel: int = 1, stages: int = 1, vocabulary_split: bool = False,
                     expert_parallel: int = 1) -> float:
        """Parameters one rank of a layout holds before any data-parallel sharding: each block's split parameters
        over `tensor_parallel` and its norms and row-parallel biases whole; the embeddings, final norm and head
        whole on every tensor-parallel rank, the vocabulary matrices split where loss parallelism splits them
        (`vocabulary_split`); the whole cut evenly over `stages` pipeline stages (DeepSpeed's PipelineModule
        balances stages by parameters; a stage holding a tied weight's copy holds more, not counted); the routed
        experts over `expert_parallel` ranks (harness.strategies.ep: experts / ep each)."""
        t = tensor_parallel
        blocks = self.layers * (self.block_split_parameters / t + self.block_whole_parameters) * self._block_scale
        blocks -= self.routed_expert_parameters / t * (1 - 1 / expert_parallel)
        vocabulary = self.embedding_parameters * (1 if self.tied else 2)
        outside = self.outside_block_parameters - (vocabulary - vocabulary / t if vocabulary_split else 0)
        return (blocks + outside) / stages

    def block_parameters_held(self, tensor_parallel: int = 1) -> float:
        """One block's parameters on a tensor-parallel rank (a sharded unit's gathered size)."""
        return (self.block_split_parameters / tensor_parallel + self.block_whole_parameters) * self._block_scale

    # ---- words ----

    def describe(self) -> str:
        kv = f" ({self.kv_heads_count} key/value)" if self.kv_heads_count != self.heads else ""
        vocab = (f", vocabulary {self.vocab:,} ({'tied' if self.tied else 'untied'} head)" if self.vocab else
                 ", no vocabulary given")
        named = f"{self.name}: " if self.name else ""
        mlp = f"{self.mlp.value} MLP of {self.ffn_width}"
        if self.is_moe:
            shared = f" and {self.shared_experts} shared" if self.shared_experts else ""
            mlp = (f"{self.experts} {self.mlp.value} experts of {self.ffn_width}{shared}, top-{self.top_k} "
                   f"({self.active_parameters:,.0f} active)")
        return (f"{named}{self.parameters:,} parameters, sequence {self.seq_len}, hidden {self.hidden}, {self.heads} "
                f"heads{kv}, {self.layers} layers, {mlp}{vocab}")

    def shape_text(self) -> str:
        """This description as `--shape` takes it (the positions, a preset's own, are not a --shape key)."""
        base = [self.seq_len, self.hidden, self.heads, self.layers] + ([self.vocab] if self.vocab else [])
        extra = [f"mlp={self.mlp.value}"] + ([f"ffn={self.ffn}"] if self.ffn is not None else [])
        if self.kv_heads is not None and self.kv_heads != self.heads:
            extra.append(f"kv_heads={self.kv_heads}")
        if not self.tied:
            extra.append("tied=false")
        if self.is_moe:
            extra += [f"experts={self.experts}", f"top_k={self.top_k}"] + (
                [f"shared_experts={self.shared_experts}"] if self.shared_experts else [])
        return ",".join(str(part) for part in [*base, *extra])

    def shape_fields(self) -> dict[str, Any]:
        """This description as a --shape's fields (`parse_shape`), with the keys of a workload's description that
        harness.derive.activations.block_sizes reads (family, n_kv_head, intermediate_size)."""
        fields: dict[str, Any] = {"seq_len": self.seq_len, "n_embd": self.hidden, "n_head": self.heads,
                                  "n_layer": self.layers, "mlp": self.mlp.value, "tied": self.tied}
        if self.vocab:
            fields["vocab_size"] = self.vocab
        if self.ffn is not None:
            fields["ffn"] = self.ffn
        if self.kv_heads is not None:
            fields["kv_heads"] = self.kv_heads
        if self.mlp is Mlp.SWIGLU:
            fields.update(family="llama", n_kv_head=self.kv_heads_count, intermediate_size=self.ffn_width)
        if self.is_moe:
            fields.update(experts=self.experts, top_k=self.top_k, shared_experts=self.shared_experts)
        return fields

    def with_stated_parameters(self, parameters: int | None) -> "Decoder":
        return self if parameters is None else replace(self, stated_parameters=int(parameters))


# ---- --shape ---------------------------------------------------------------------------------------------------

SHAPE_KEYS = {"kv_heads": "key/value heads", "ffn": "the MLP's width (each expert's)", "mlp": "gelu or swiglu",
              "tied": "true or false", "experts": "routed experts a block", "top_k": "experts a token runs",
              "shared_experts": "experts every token runs"}
SHAPE_SYNTAX = ("SEQ,HIDDEN,HEADS,LAYERS[,VOCAB][,kv_heads=N][,ffn=N][,mlp=gelu|swiglu][,tied=true|false]"
                "[,experts=N,top_k=K[,shared_experts=S]], e.g. 8192,4096,32,32,128256,kv_heads=8,ffn=14336,mlp=swiglu,"
                "tied=false")


def parse_shape(text: str) -> dict[str, Any]:
    """--shape's fields: seq_len, n_embd, n_head, n_layer[, vocab_size] and any of SHAPE_KEYS; a ValueError naming
    what is wrong and what is allowed."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    numbers = [part for part in parts if "=" not in part]
    keyed = [part for part in parts if "=" in part]
    if parts[:len(numbers)] != numbers:
        raise ValueError(f"the numbers come first, then key=value: expected {SHAPE_SYNTAX}, got {text!r}")
    try:
        values = [int(part) for part in numbers]
    except ValueError:
        values = []
    if len(values) not in (4, 5) or min(values) < 1 or values[1] % values[2]:
        raise ValueError(f"expected {SHAPE_SYNTAX}: whole numbers >= 1 with the heads dividing the hidden size, "
                         f"got {text!r}")
    shape: dict[str, Any] = dict(zip(("seq_len", "n_embd", "n_head", "n_layer", "vocab_size"), values))
    for part in keyed:
        key, _, raw = part.partition("=")
        key, raw = key.strip(), raw.strip().lower()
        if key not in SHAPE_KEYS:
            raise ValueError(f"--shape key {key!r} is not one of: {', '.join(SHAPE_KEYS)} ({SHAPE_SYNTAX})")
        if key == "mlp":
            if raw not in [m.value for m in Mlp]:
                raise ValueError(f"--shape mlp={raw!r}: allowed {', '.join(m.value for m in Mlp)}")
            shape["mlp"] = raw
        elif key == "tied":
            if raw not in ("true", "false"):
                raise ValueError(f"--shape tied={raw!r}: allowed true, false")
            shape["tied"] = raw == "true"
        else:
            least = 0 if key == "shared_experts" else 1
            if not raw.isdigit() or int(raw) < least:
                raise ValueError(f"--shape {key}={raw!r}: expected a whole number >= {least}")
            shape[key] = int(raw)
    return shape


def decoder_of(parameters: int | None, shape: Mapping[str, Any], name: str = "") -> Decoder:
    """The Decoder of a --shape's fields (`parse_shape`) and `parameters` (--params, or None: the shape's own)."""
    mlp = Mlp(shape.get("mlp", Mlp.SWIGLU.value if "kv_heads" in shape else Mlp.GELU.value))
    return Decoder(seq_len=int(shape["seq_len"]), hidden=int(shape["n_embd"]), heads=int(shape["n_head"]),
                   layers=int(shape["n_layer"]), vocab=shape.get("vocab_size"), kv_heads=shape.get("kv_heads"),
                   ffn=shape.get("ffn"), mlp=mlp, tied=bool(shape.get("tied", True)),
                   stated_parameters=None if parameters is None else int(parameters), name=name,
                   experts=int(shape.get("experts", 0)), top_k=int(shape.get("top_k", 2)),
                   shared_experts=int(shape.get("shared_experts", 0)))


# ---- presets -----------------------------------------------------------------------------------------------------


def _padded(vocab: int) -> int:
    return -(-vocab // VOCAB_ROWS_MULTIPLE) * VOCAB_ROWS_MULTIPLE


# Public shapes users plan for that are not registered workloads, each with where its figures come from and the
# parameter count it publishes (tests/test_model.py holds the shape's count to it).
PUBLIC_PRESETS: dict[str, tuple[Decoder, int, str]] = {
    "llama3.2-3b": (Decoder(name="llama3.2-3b", seq_len=8192, hidden=3072, heads=24, kv_heads=8, layers=28,
                            ffn=8192, mlp=Mlp.SWIGLU, vocab=128_256, tied=True), 3_212_749_824,
                    "meta-llama/Llama-3.2-3B config.json: hidden 3072, 28 layers, 24 heads, 8 key/value heads, "
                    "intermediate 8192, vocabulary 128,256, tied; 3.21B parameters. Sequence: Llama 3's 8192"),
    "llama3-70b": (Decoder(name="llama3-70b", seq_len=8192, hidden=8192, heads=64, kv_heads=8, layers=80,
                           ffn=28_672, mlp=Mlp.SWIGLU, vocab=128_256, tied=False), 70_553_706_496,
                   "meta-llama/Meta-Llama-3-70B config.json: hidden 8192, 80 layers, 64 heads, 8 key/value heads, "
                   "intermediate 28672, vocabulary 128,256, untied; 70.55B parameters; context 8192"),
    "llama3.1-405b": (Decoder(name="llama3.1-405b", seq_len=8192, hidden=16_384, heads=128, kv_heads=8, layers=126,
                              ffn=53_248, mlp=Mlp.SWIGLU, vocab=128_256, tied=False), 405_853_388_800,
                      "meta-llama/Llama-3.1-405B config.json: hidden 16384, 126 layers, 128 heads, 8 key/value "
                      "heads, intermediate 53248, vocabulary 128,256, untied; 405.85B parameters; pretraining "
                      "sequence 8192 (Grattafiori et al. 2024, sec. 3.4)"),
    # GPT-3 (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads of 128, context 2048, "175.0B";
    # GPT-2's 50,257-token vocabulary padded to 50,304 rows as the workloads pad it, a learned position table, tied.
    # The shape holds 174.6B: the paper's figure is rounded.
    "gpt3-175b": (Decoder(name="gpt3-175b", seq_len=2048, hidden=12_288, heads=96, layers=96,
                          vocab=_padded(50_257), tied=True, positions=2048), 174_604_836_864,
                  "GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, context 2048; "
                  "GPT-2's vocabulary padded to 50,304 rows, learned positions, tied head"),
}


def _decoder_families() -> tuple:
    from workloads.base import Family

    return (Family.GPT, Family.LLAMA, Family.MOE)


def workload_decoder(name: str) -> Decoder | None:
    """A registered transformer workload as a Decoder (its config, padded vocabulary, learned positions of GPT-2's
    blocks), or None for another family."""
    from workloads import WORKLOADS
    from workloads.base import Family

    workload = WORKLOADS.get(name)
    if workload is None or workload.family not in _decoder_families():
        return None
    c = workload.config
    if workload.family is Family.GPT:
        return Decoder(name=name, seq_len=c.seq_len, hidden=c.n_embd, heads=c.n_head, layers=c.n_layer,
                       vocab=c.padded_vocab_size, tied=True, positions=c.seq_len)
    experts = (dict(experts=c.n_experts, top_k=c.top_k, shared_experts=c.n_shared_experts)
               if workload.family is Family.MOE else {})
    return Decoder(name=name, seq_len=c.seq_len, hidden=c.n_embd, heads=c.n_head, kv_heads=c.n_kv_head,
                   layers=c.n_layer, ffn=c.intermediate_size, mlp=Mlp.SWIGLU, vocab=c.padded_vocab_size,
                   tied=c.tie_embeddings, **experts)


def preset_names() -> list[str]:
    from workloads import WORKLOADS
    from workloads.base import Family

    workloads = [name for name, w in WORKLOADS.items() if w.family in _decoder_families()]
    return workloads + list(PUBLIC_PRESETS)


def preset(name: str) -> Decoder:
    """The named preset: a registered transformer workload or a public shape; a one-line SpecError naming them."""
    if name in PUBLIC_PRESETS:
        return PUBLIC_PRESETS[name][0]
    found = workload_decoder(name)
    if found is None:
        raise SpecError(f"unknown model {name!r}; allowed: {', '.join(preset_names())}")
    return found


def described(model: str | None, parameters: int | None, shape: Mapping[str, Any] | None,
              seq_len: int | None = None) -> Decoder:
    """The model a command describes: --model PRESET (optionally with --params, checked against it), or --shape
    with or without --params; --seq-len replaces the preset's sequence. One-line SpecErrors for the rest."""
    if model is not None and shape is not None:
        raise SpecError("give --model PRESET or --shape, not both (--model's shape is the preset's)")
    if model is not None:
        found = preset(model).with_stated_parameters(parameters)
    elif shape is not None:
        found = decoder_of(parameters, shape)
    else:
        raise SpecError(f"describe the model: --model PRESET (one of {', '.join(preset_names())}) or --shape "
                        f"{SHAPE_SYNTAX}")
    if seq_len is not None:
        found = replace(found, seq_len=int(seq_len))
    return found
