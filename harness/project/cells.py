"""A matrix cell's optimizer step projected on a described cluster, for a dry run's wall time and GPU-hours
(harness.launch.dry_run): the rule harness.project.plan prices a layout's step by, applied to a cell as the
matrix gives it (its workload, strategy, options, world size and batch) instead of a described decoder.

- **compute** = the FLOPs the busiest GPU runs a step / (the GPU's datasheet peak in the cell's precision x a
  compute MFU): the workload's own training FLOPs a sample (`Workload.train_flops_per_sample`: for the GPTs PaLM's
  6N + 12 L h s a token, Chowdhery et al. 2022, appendix B; for ResNets 2 FLOPs a multiply-accumulate, forward and
  twice it backward) x a replica's samples, over the ranks that split a replica (tensor parallelism, stages), x
  RECOMPUTE_FACTOR where checkpointed, x the strategy's bubble. The compute MFU is, first, what parbench's own plain
  loop measured on a GPU for that workload and precision (MEASURED_GPU_ROWS: an H200, whose dense peaks are an H100
  SXM's), else, for a transformer, the one fitted on published GPU runs (harness.project.mfu_model) for the
  cluster's GPU and the workload's size; neither (a ResNet never measured in that precision): unknown.
- **communication** = the strategy's expected collectives for the cell (`RegistryFacts.traffic_for_cell`, on
  nodes of the cluster's GPUs) priced on the cluster by harness.project.collectives, all of it exposed (no overlap
  measured: an upper bound).
- **unknown**, with the reason, where a figure would be a guess: a CPU cell, an fp32 cell (whether TF32 runs is
  torch's switches' at run time: harness.derive.peaks.tf32_in_use), a strategy whose traffic is not modelled
  (DataParallel's copies), a layout the strategy refuses on these nodes, no anchor for its compute.

Torch-free at import like the rest of harness.project: the workloads and the strategies come in where used.
"""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.derive.peaks import PEAKS, DevicePeaks, MathMode
from harness.project.cluster import Cluster
from harness.project.collectives import ClusterModel
from harness.project.facts import REGISTRY_FACTS, RegistryFacts
from harness.project.layouts import RECOMPUTE_FACTOR
from harness.project.projection import Scheduled, comm_seconds, exposed_seconds, star_servers, with_servers
from harness.spec import SpecError


@dataclass(frozen=True, kw_only=True, slots=True)
class CellStep:
    """A matrix cell's projected optimizer step on a described cluster, or why it has none (`unknown`)."""

    step_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    unknown: str = ""
    compute_from: str = ""      # where its compute MFU came from


# parbench's own rows from a GPU, whose plain loop's MFU prices a cell of the same workload and precision.
MEASURED_GPU_ROWS = Path(__file__).resolve().parents[2] / "results" / "reference" / "h200" / "a3663fd" / "rows.jsonl"


@functools.cache
def measured_mfu(path: Path = MEASURED_GPU_ROWS) -> dict[tuple[str, str], float]:
    """{(workload, precision): the MFU its plain loop measured}: the workload's training FLOPs a step over the
    median step time and the datasheet peak of the device the row names (harness.derive.peaks), ok rows only."""
    found: dict[tuple[str, str], float] = {}
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        row = json.loads(line)
        spec, m = row["spec"], row.get("measurements") or {}
        if row.get("status") != "ok" or spec["strategy"] != "plain" or not m.get("step_time_s"):
            continue
        peak = PEAKS[m["device_name"]].for_mode(MathMode(spec["precision"]))
        flops = float(m["train_flops_per_sample"]) * spec["global_batch"] / spec["world_size"]
        found[(spec["workload"], spec["precision"])] = flops / statistics.median(m["step_time_s"]) / peak
    return found


def compute_mfu_for(spec: Any, cluster: Cluster, recomputed: bool) -> tuple[float | None, str]:
    """(the compute MFU a cell is priced at, where it comes from), or (None, why none): the module docstring's
    order, measured rows first."""
    from workloads import get_workload
    from workloads.base import Family

    measured = measured_mfu().get((spec.workload, spec.precision.value))
    if measured is not None:
        return measured, f"its plain loop measured on an H200 ({MEASURED_GPU_ROWS.parent.name})"
    workload = get_workload(spec.workload)
    if workload.family not in (Family.GPT, Family.LLAMA):
        return None, f"no GPU row of {spec.workload} in {spec.precision.value} and no published run of its family"
    from harness.project.mfu_model import mfu_model
    from harness.project.model import workload_decoder

    try:
        parameters = workload_decoder(spec.workload).parameters
        return mfu_model().compute_mfu(cluster.gpu, parameters, recomputed), "fitted on published runs"
    except SpecError as error:
        return None, str(error)


def cluster_peaks(cluster: Cluster) -> DevicePeaks:
    """The datasheet peaks of the cluster's GPU (harness.derive.peaks), or a one-line SpecError naming those known."""
    if cluster.gpu not in PEAKS:
        raise SpecError(f"cluster {cluster.name!r} names no GPU of harness.derive.peaks ({cluster.gpu or 'none'}); "
                        f"allowed: gpu = one of {', '.join(PEAKS)}")
    return PEAKS[cluster.gpu]


# Kept for the process: a cell's expected traffic walks its layers' parameters (on the meta device) several times,
# and a session plans the same cells again (another cluster, the tests' dry runs). Its result is read, never changed.
@functools.lru_cache(maxsize=1024)
def _cell_layout(facts: RegistryFacts, workload: str, strategy: str, options: tuple, precision: str, world_size: int,
                 global_batch: int, micro_batch: int, gpus_per_node: int) -> tuple[dict, int, int, int]:
    """(the cell's expected traffic, its data-parallel size, tensor-parallel ranks, pipeline stages)."""
    cell = dict(workload=workload, strategy=strategy, options=dict(options), precision=precision,
                world_size=world_size, global_batch=global_batch, micro_batch=micro_batch)
    expected, data_parallel = facts.traffic_for_cell(**cell, gpus_per_node=gpus_per_node)
    tensor_parallel, stages = facts.model_split(**cell)
    return expected, data_parallel, tensor_parallel, stages


def cell_step(spec: Any, cluster: Cluster, facts: RegistryFacts = REGISTRY_FACTS, mfu: float | None = None) -> CellStep:
    """One optimizer step of the cell `spec` (a harness.spec.RunSpec) on `cluster` (module docstring); `mfu` where
    the caller fixes the compute MFU."""
    from harness.spec import DeviceKind
    from workloads import get_workload

    if spec.device is not DeviceKind.CUDA:
        return CellStep(unknown="a CPU cell: the projection prices GPUs")
    if spec.precision.value not in ("bf16", "fp16"):
        return CellStep(unknown=f"{spec.precision.value}: its peak depends on whether TF32 runs, decided at run time")
    peak = cluster_peaks(cluster).for_mode(MathMode(spec.precision.value))
    options = dict(spec.options)
    try:
        expected, data_parallel, tensor_parallel, stages = _cell_layout(
            facts, spec.workload, spec.strategy, tuple(sorted(options.items())), spec.precision.value,
            spec.world_size, spec.global_batch, spec.micro_batch, cluster.gpus_per_node)
    except SpecError as refused:        # a layout the strategy refuses on this cluster's nodes
        return CellStep(unknown=str(refused))
    if expected.get("not_modelled_because"):
        return CellStep(unknown=f"{spec.strategy}'s traffic is not modelled ({expected['not_modelled_because']})")
    micro_batches = max(1, spec.global_batch // (data_parallel * spec.micro_batch))
    flops = spec.global_batch / data_parallel * get_workload(spec.workload).train_flops_per_sample / (
        tensor_parallel * stages)
    checkpointed = options.get("activation_checkpointing", "none") not in ("none", None)
    source = "given"
    if mfu is None:
        mfu, source = compute_mfu_for(spec, cluster, checkpointed)
        if mfu is None:
            return CellStep(unknown=source)
    compute = (flops * (RECOMPUTE_FACTOR if checkpointed else 1.0) / (peak * mfu)
               * facts.bubble_factor(spec.strategy, options, micro_batches))
    # An entry among the whole world's neighbours is the data-parallel group's (None: where a parameter server's
    # sends are its star's); a named group, or one whose members are spread (a pipeline's sends, a replica's
    # width apart), keeps its own ranks and stride.
    schedule = with_servers((Scheduled(collective=e["collective"], size_bytes=float(e["size_bytes"]),
                                       calls=float(e["calls"]), origin="expected", label=str(e.get("group", "")),
                                       group=None if e.get("group", "world") == "world"
                                       and int(e.get("stride", 1)) == 1 else int(e["ranks"]),
                                       stride=int(e.get("stride", 1)))
                             for e in expected["collectives"] if e["calls"]),
                            star_servers(facts, spec.strategy, options))
    ranks = data_parallel * tensor_parallel * stages       # those running the model (a star's servers beyond)
    comm = comm_seconds(schedule, ranks, ClusterModel(cluster))
    return CellStep(step_s=compute + exposed_seconds(comm, compute, 1.0), compute_s=compute, comm_s=comm,
                    compute_from=source)
