"""Whether a transformer cell fits its GPU, by the plan's own memory (harness.project.rank_memory: every byte `harness
plan` and `harness memory` count), judged before launch: a cell whose need is well over the GPU's memory is skipped
with the figures, not launched to run out of memory. A Llama 3 8B at 8192 tokens on one 80 GB GPU needs 119.7 GiB of
model states alone; `full` on a node would otherwise launch each of its unsharded cells five times to learn that.

Only clear cases are skipped: the need over the memory by more than FIT_MARGIN, the plan's error so far being far
under it (GPT-2 small's peak on an H200 predicted to 0.45%, docs/projection.md). A cell the model does not describe
(ResNet, the parameter servers, a strategy the plan leaves out) is launched, and an out-of-memory cell is recorded
as any failure is.
"""

from __future__ import annotations

from harness.spec import DeviceKind, Precision, RunSpec

FIT_MARGIN = 0.10
GIB = 2 ** 30
# Strategies the plan prices as another: the plain and bare loops hold what DDP holds at one rank, less its buckets.
PRICED_AS = {"plain": "ddp", "bare": "ddp"}


def planned_need_bytes(spec: RunSpec) -> tuple[float, str] | None:
    """(bytes the busiest rank of `spec` needs, the terms in words) by the plan's memory, or None where the plan
    does not describe the cell."""
    from harness.project.layouts import layout_at, memory_of
    from harness.project.model import workload_decoder
    from harness.spec import SpecError

    model = workload_decoder(spec.workload)
    if model is None:
        return None
    options = spec.options_dict
    recipe = ("fp32" if spec.precision is Precision.FP32 else "fsdp-mp-policy" if options.get("mixed_precision") == "policy"
              else str(options.get("precision_recipe", "autocast")))
    strategy = PRICED_AS.get(spec.strategy, spec.strategy)
    try:
        layout = layout_at(strategy, tuple(sorted((k, v) for k, v in options.items() if k != "compile")),
                           spec.world_size, recipe=recipe)
        per_step = spec.global_batch // (spec.micro_batch * layout.split.data_parallel)
        terms = memory_of(layout, model, micro_batch=spec.micro_batch, micro_batches=max(1, per_step))
    except (SpecError, KeyError, ValueError):
        return None
    return terms.total, terms.describe()


def does_not_fit(spec: RunSpec, gpu_bytes: float) -> str | None:
    """Why `spec` would run out of a GPU of `gpu_bytes` (a one-line reason naming the figures), or None."""
    planned = planned_need_bytes(spec)
    if planned is None:
        return None
    need, terms = planned
    if need <= gpu_bytes * (1 + FIT_MARGIN):
        return None
    return (f"does not fit: needs {need / GIB:.1f} GiB a rank by the plan's memory ({terms}), over the "
            f"{gpu_bytes / GIB:.1f} GiB of GPU it has by more than {FIT_MARGIN:.0%} (harness memory; a smaller "
            f"micro-batch or a sharded strategy fits)")


def skip_reason(spec: RunSpec) -> str | None:
    """Why `spec` cannot run on this host (its strategy's reason, `Strategy.skip_reason`), or on this host's GPU by
    the plan's memory (`does_not_fit`); None where it can. Kept out of the strategies: the plan's memory reads every
    strategy's facts, and a strategy's own files are what the A/B tier times it on (harness.touched)."""
    import torch

    from harness.strategies import get_strategy

    reason = get_strategy(spec.strategy).skip_reason(spec)
    if reason is None and spec.device is DeviceKind.CUDA:      # a visible GPU, or the strategy would have said
        # Ranks beyond a node's GPUs share them round-robin (harness.strategies.base.place_rank): each its share.
        sharing = -(-spec.world_size // (spec.nnodes * max(1, torch.cuda.device_count())))
        reason = does_not_fit(spec, torch.cuda.get_device_properties(0).total_memory / sharing)
    return reason
