"""Analytic communication: nccl-tests' bus bandwidth, and the volume each strategy should issue per step.

Bus bandwidth (nccl-tests, doc/PERFORMANCE.md): algbw = size / time, busbw = algbw x factor, where the
factor makes the figure comparable to the hardware's link bandwidth for a ring/tree of n ranks:
all_reduce 2(n-1)/n; all_gather and reduce_scatter (n-1)/n (size = the whole gathered / scattered
buffer); broadcast and reduce 1; all_to_all (n-1)/n.

Volume per optimizer step per rank, in the same "buffer size" bytes the counter records (harness.
comm_counter), for a model of P parameters whose gradients have g bytes per element, K micro-batches per
step and n data-parallel ranks (Rajbhandari et al. 2020, sec. 7: ZeRO-1/2 move as much as DDP, ZeRO-3
1.5x as much):
- ddp, horovod: one all-reduce of the gradients, P x g (accumulation communicates on the last
  micro-batch only: DDP's no_sync, Horovod's backward_passes_per_step);
- zero1: reduce-scatter of the gradients at the step boundary, all-gather of the updated parameters: P x g
  each;
- zero2: the gradient reduce-scatter after every micro-batch, K x P x g, and the parameter all-gather P x g;
- zero3, fsdp2: every micro-batch all-gathers the parameters for forward and again for backward (2 K x P
  x w; once when parameters are not resharded after forward) and reduce-scatters the gradients (DeepSpeed
  every micro-batch, FSDP2 once per step, since gradient sync is off on the others); parameters DeepSpeed
  keeps whole (below param_persistence_threshold) are never gathered, so the measured figure is lower
  on small models;
- pipeline: activations between stages, which depend on the cut, are not modelled.

These are the algorithms' volumes; the counted figures show where an implementation departs from them.
Measured with DeepSpeed 0.19 on CPU (gloo): ZeRO-1/2 reduce gradients with all-reduces of whole buckets
(each rank then keeps its partition), moving the paper's bytes under all_reduce instead of reduce_scatter;
ZeRO-3 gathers each parameter about once per step, because it keeps gathered parameters alive up to
stage3_max_live_parameters and re-uses them within stage3_max_reuse_distance (both 1e9 by default).
"""

from __future__ import annotations

from typing import Mapping

BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_bandwidth(collective: str, size_bytes: float, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s for one collective of `size_bytes` that took `seconds` on `ranks` ranks."""
    algbw = size_bytes / seconds
    return algbw, algbw * BUSBW_FACTORS[collective](ranks)


def analytic_volume(strategy: str, parameters: int, data_parallel: int, micro_batches: int,
                    gradient_bytes: int = 4, parameter_bytes: int = 4,
                    options: Mapping[str, object] | None = None) -> dict[str, float] | None:
    """Bytes per step per rank each collective type should move, or None where not modelled."""
    options = options or {}
    grads = parameters * gradient_bytes
    params = parameters * parameter_bytes
    k = micro_batches
    if data_parallel == 1 and strategy != "pipeline":
        return {}
    if strategy in ("ddp", "horovod"):
        return {"all_reduce": grads}
    if strategy == "zero1":
        return {"reduce_scatter": grads, "all_gather": params}
    if strategy == "zero2":
        return {"reduce_scatter": k * grads, "all_gather": params}
    if strategy == "zero3":
        return {"all_gather": 2 * k * params, "reduce_scatter": k * grads}
    if strategy == "fsdp2":
        gathers = 2 if options.get("reshard_after_forward", True) else 1
        return {"all_gather": gathers * k * params, "reduce_scatter": grads}
    return None
