"""Published GPU training runs, laid out as `harness plan` lays out a layout: the ground truth its compute is fitted
on and checked against (harness.project.mfu_model), and its memory model's check (no run that ran may be marked
"does not fit").

    python -m harness.project.mfu_model          # docs/published-runs.md's tables, from this file's runs

The runs are results/reference/published-runs/runs.csv, one row a run as its source publishes it (the model's
shape, the GPUs, the layout, the batch, the sequence, the precision, recomputation, the throughput) with where each
figure was read and what the source leaves unsaid and was taken as usual (its `note`). Each run becomes:

- a Decoder (harness.project.model) of its shape, the published parameter count where the source gives it;
- a cluster: a preset with the run's overrides (`cluster_set`: the GPU's memory, a slower network);
- a Layout (harness.project.layouts): the data-parallel strategy among its replicas (`scheme`, `scheme_options`:
  FSDP's FULL_SHARD is `fsdp2`, its SHARD_GRAD_OP `fsdp2` with reshard_after_forward off, a sharded optimizer
  `zero1`) with its tensor-parallel and pipeline split,
  the recipe, recomputation and sequence parallelism, at its micro-batch and micro-batches;
- its tokens/s per GPU: as published, or its TFLOP/s per GPU over the FLOPs a token of its source's own formula
  (`flops_a_token`), so that no convention of ours enters the published figure.

Torch-free but for the strategies' facts (harness.project.facts).
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.derive.memory import ModelSplit
from harness.project.cluster import Cluster, load_cluster
from harness.project.facts import REGISTRY_FACTS, RegistryFacts
from harness.project.layouts import Layout, memory_of, peak_flops, price_step, shape_refusal
from harness.project.model import Decoder, Mlp
from harness.project.rank_memory import GIB, MemoryTerms

RUNS_FILE = Path(__file__).resolve().parents[2] / "results" / "reference" / "published-runs" / "runs.csv"


def megatron_flops_a_token(run: dict[str, Any]) -> float:
    """Megatron-LM's `num_floating_point_operations` (megatron/training/training.py at f2e5db402c) over one token of
    a GPT without grouped-query attention or SwiGLU: 12 L h^2 (1 + 1 + s / h + f / h + V / (2 L h)), the attention's
    q|k|v and projection, the scores, the MLP (f / h = 4) and the logits."""
    layers, h, s, f, v = (int(run[k]) for k in ("layers", "hidden", "seq_len", "ffn", "vocab"))
    return 12.0 * layers * h * h * (2 + s / h + f / h + v / (2 * layers * h))


# How each source's TFLOP/s per GPU turn into tokens/s per GPU: its own FLOPs a token.
FLOPS_A_TOKEN = {"megatron-lm": megatron_flops_a_token}


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One row of the runs file, laid out for the plan's machinery."""

    row: dict[str, str]

    # ---- what was published ----

    @property
    def id(self) -> str:
        return self.row["id"]

    @property
    def source(self) -> str:
        return self.row["source"]

    @property
    def gpus(self) -> int:
        return int(self.row["gpus"])

    @property
    def global_batch(self) -> int:
        return int(self.row["global_batch"])

    @property
    def micro_batch(self) -> int:
        return int(self.row["micro_batch"])

    @property
    def micro_batches(self) -> int:
        return int(self.row["micro_batches"])

    @property
    def recompute(self) -> bool:
        return self.row["recompute"] == "full"

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """As published, or the source's TFLOP/s per GPU over its own FLOPs a token."""
        if self.row["tokens_per_s_per_gpu"]:
            return float(self.row["tokens_per_s_per_gpu"])
        return float(self.row["tflops_per_gpu"]) * 1e12 / FLOPS_A_TOKEN[self.source](self.row)

    # ---- as the plan lays it out ----

    @functools.cached_property
    def model(self) -> Decoder:
        r = self.row
        published = int(r["published_parameters"]) if r["published_parameters"] else None
        return Decoder(name=r["model"], seq_len=int(r["seq_len"]), hidden=int(r["hidden"]), heads=int(r["heads"]),
                       kv_heads=int(r["kv_heads"]) if r["kv_heads"] else None, layers=int(r["layers"]),
                       ffn=int(r["ffn"]), mlp=Mlp(r["mlp"]), vocab=int(r["vocab"]), tied=r["tied"] == "true",
                       positions=int(r["positions"]), stated_parameters=published)

    @functools.cached_property
    def cluster(self) -> Cluster:
        overrides = [part for part in self.row["cluster_set"].split(";") if part]
        return load_cluster(self.row["cluster"], overrides)

    @functools.cached_property
    def layout(self) -> Layout:
        r = self.row
        split = ModelSplit(data_parallel=int(r["dp"]), tensor_parallel=int(r["tp"]), pipeline_stages=int(r["pp"]))
        options: dict[str, Any] = {"activation_checkpointing": "blocks" if self.recompute else "none"}
        for part in filter(None, r["scheme_options"].split(";")):
            key, _, value = part.partition("=")
            options[key] = {"true": True, "false": False}.get(value, value)
        if r["scheme"] == "fsdp2":
            options["gradient_sync"] = "every"        # FSDP1 under Composer reduce-scatters every micro-batch
        recipe = r["recipe"]
        if recipe == "fsdp-mp-policy":
            options["mixed_precision"] = "policy"
        elif recipe == "deepspeed-bf16":
            options["precision_recipe"] = recipe
        return Layout(strategy=r["scheme"], options=tuple(sorted(options.items())), split=split, recipe=recipe,
                      sequence_parallel=r["sequence_parallel"] == "true")

    @property
    def step_s(self) -> float:
        """The published step: a GPU's tokens a step over its tokens/s."""
        return self.global_batch * self.model.seq_len / self.gpus / self.tokens_per_s_per_gpu

    def check(self) -> str:
        """Why the run cannot be laid out as its row says (a split that does not multiply to its GPUs, a batch
        that does not split), or ""."""
        split = self.layout.split
        if split.ranks != self.gpus:
            return f"tp x pp x dp = {split.ranks}, not its {self.gpus} GPUs"
        if self.micro_batch * self.micro_batches * split.data_parallel != self.global_batch:
            return (f"micro-batch {self.micro_batch} x {self.micro_batches} x dp {split.data_parallel} is not its "
                    f"global batch {self.global_batch}")
        return shape_refusal(split, self.model, self.cluster.gpus_per_node, uneven_stages=True)

    # ---- the plan's figures of it ----

    def priced(self, compute_mfu: float, facts: RegistryFacts = REGISTRY_FACTS):
        """The plan's step of this run at `compute_mfu` (harness.project.layouts.price_step)."""
        return price_step(self.layout, self.model, self.cluster, global_batch=self.global_batch,
                          micro_batch=self.micro_batch, compute_mfu=compute_mfu,
                          peak=peak_flops(self.cluster, self.layout.recipe), facts=facts)

    def implied_compute_mfu(self, facts: RegistryFacts = REGISTRY_FACTS) -> float | None:
        """The compute MFU at which the plan's step equals the published one: the FLOPs it executes (recomputation
        and the bubble included) over the peak and the published step less the plan's communication (all
        exposed); None where the plan's communication alone reaches the published step."""
        at_one = self.priced(1.0, facts)
        left = self.step_s - at_one.comm_s
        return at_one.compute_s / left if left > 0 else None

    def memory(self, facts: RegistryFacts = REGISTRY_FACTS) -> MemoryTerms:
        """The busiest GPU's bytes as the plan counts them, the loss as the run computes it (`loss`)."""
        return memory_of(self.layout, self.model, micro_batch=self.micro_batch, micro_batches=self.micro_batches,
                         facts=facts, loss=self.row["loss"])

    def fits(self, facts: RegistryFacts = REGISTRY_FACTS) -> bool:
        return self.memory(facts).total <= self.cluster.gpu_memory_GiB * GIB


@functools.cache
def published_runs(path: Path = RUNS_FILE) -> tuple[PublishedRun, ...]:
    """Every run of the file, in its order."""
    with open(path, newline="") as handle:
        return tuple(PublishedRun(row=dict(row)) for row in csv.DictReader(handle))


def model_mfu(run: PublishedRun) -> float:
    """The run's MFU by PaLM's convention (harness.project.model: the model's FLOPs, no recomputation, over the
    datasheet peak), from its tokens/s per GPU."""
    return run.tokens_per_s_per_gpu * run.model.flops_per_token / peak_flops(run.cluster, run.layout.recipe)


__all__ = ["RUNS_FILE", "PublishedRun", "model_mfu", "megatron_flops_a_token", "published_runs"]
