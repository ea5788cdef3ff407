"""The compute MFU `harness plan` prices a step at, fitted on published GPU training runs and checked on the runs it
was not fitted on (harness.project.published_runs; docs/published-runs.md prints what this module computes).

    python -m harness.project.mfu_model        # the fit, the held-out errors, the runs' table (docs/published-runs.md)

The plan prices a step as compute + exposed communication (harness.project.layouts). Fitted here, on the runs of
the fit set, by least squares on the relative error of the step (every run weighs alike):

    step = C x (a_gpu + b x log10(N / 1e9) + c x recomputed) + f x comm_dp + comm_tp,pp

- C: the step's executed FLOPs on one GPU (the model's, x 4/3 recomputed, x the pipeline's bubble) at the GPU's
  datasheet peak; 1 / (a_gpu + b log10 N + c r) is the **compute MFU**: the fraction of the peak the GPU's
  compute runs at, by GPU (A100; H100, which H200 shares), model size (N parameters, clamped to the sizes fitted
  on: nothing is extrapolated beyond them) and recomputation;
- comm_dp: the data-parallel collectives as harness.project.collectives prices them on the run's cluster, of
  which f is exposed (the rest hidden behind backward and forward, as FSDP's prefetch and DDP's buckets hide it);
- comm_tp,pp: tensor parallelism's all-reduces and the pipeline's sends, all exposed, as parbench's strategies
  issue them (DTensor's all-reduces sit between a block's matmuls). Runs whose framework hides them
  (Megatron-LM's --tp-comm-overlap) come out slower than published by what it hides: said, not fitted away.

The **held-out set** is fixed by a rule, not chosen: in the file's order, every third run of each source (the 3rd,
the 6th, ...). Its errors are |predicted / published tokens/s per GPU - 1| with the model fitted on the others:
the compute confidence `harness plan` prints beside each row.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import median
from typing import Sequence

import numpy as np

from harness.project.facts import REGISTRY_FACTS, RegistryFacts
from harness.project.layouts import StepPrice
from harness.project.published_runs import PublishedRun, published_runs
from harness.spec import SpecError

HELD_OUT_EVERY = 3
# The GPU kinds the runs measured, and the devices each stands for (harness.derive.peaks names): an H200's compute
# is an H100 SXM's (the same 989.4 TFLOP/s bf16 dense; more memory).
GPU_KINDS = {"A100": ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB"),
             "H100": ("NVIDIA H100 80GB HBM3", "NVIDIA H200")}
# Labels of the scheduled collectives (harness.project.layouts.schedule_of) by what the model does with them.
DATA_PARALLEL_LABELS = ("dp",)


def gpu_kind(gpu: str | None) -> str | None:
    """The fitted kind a GPU's compute is priced as, or None where no published run measured one like it."""
    return next((kind for kind, names in GPU_KINDS.items() if gpu in names), None)


def data_parallel_seconds(price: StepPrice, gpus: int, cluster) -> tuple[float, float]:
    """(data-parallel, tensor/pipeline) seconds of a priced step's communication."""
    from harness.project.collectives import ClusterModel
    from harness.project.projection import comm_seconds

    model = ClusterModel(cluster)
    dp = [s for s in price.schedule if s.label in DATA_PARALLEL_LABELS]
    rest = [s for s in price.schedule if s.label not in DATA_PARALLEL_LABELS]
    return comm_seconds(dp, gpus, model), comm_seconds(rest, gpus, model)


@dataclass(frozen=True, kw_only=True)
class MfuModel:
    """The fitted coefficients (module docstring) and the sizes they were fitted on."""

    per_gpu: dict[str, float]           # a_gpu
    size: float                         # b, a decade of parameters
    recompute: float                    # c
    exposed_data_parallel: float        # f
    log_size_range: tuple[float, float]  # log10(N / 1e9) of the smallest and largest model fitted on
    fitted_on: tuple[str, ...]

    def compute_mfu(self, gpu: str | None, parameters: float, recomputed: bool) -> float:
        """The compute MFU of a model of `parameters` on `gpu` (a harness.derive.peaks name); a one-line SpecError
        where no published run measured a GPU like it."""
        kind = gpu_kind(gpu)
        if kind is None:
            known = ", ".join(name for names in GPU_KINDS.values() for name in names)
            raise SpecError(f"no published run measured the {gpu or 'unnamed GPU'}: give --mfu (the compute MFU "
                            f"fitted covers {known})")
        low, high = self.log_size_range
        size = min(max(math.log10(parameters / 1e9), low), high)
        return 1.0 / (self.per_gpu[kind] + self.size * size + self.recompute * recomputed)

    def clamped(self, parameters: float) -> bool:
        """Whether `parameters` lies outside the sizes fitted on (its MFU is the nearest size's)."""
        low, high = self.log_size_range
        return not low <= math.log10(parameters / 1e9) <= high

    def exposed_s(self, data_parallel_s: float, other_s: float) -> float:
        return self.exposed_data_parallel * data_parallel_s + other_s

    def describe(self, gpu: str | None, parameters: float, recomputed: bool) -> str:
        kind = gpu_kind(gpu)
        mfu = self.compute_mfu(gpu, parameters, recomputed)
        edge = " (outside the sizes fitted on: the nearest one's)" if self.clamped(parameters) else ""
        return (f"compute MFU {mfu:.1%}{edge}: fitted on {len(self.fitted_on)} published runs for {kind}, "
                f"{parameters / 1e9:.3g}B parameters{', recomputed' if recomputed else ''} "
                "(docs/published-runs.md)")


@dataclass(frozen=True, kw_only=True)
class RunFeatures:
    """A run as the fit sees it: the compute at the peak, its two kinds of communication, and its published step."""

    run: PublishedRun
    compute_s: float
    data_parallel_s: float
    other_s: float

    @classmethod
    def of(cls, run: PublishedRun, facts: RegistryFacts = REGISTRY_FACTS) -> "RunFeatures":
        price = run.priced(1.0, facts)
        dp, other = data_parallel_seconds(price, run.gpus, run.cluster)
        return cls(run=run, compute_s=price.compute_s, data_parallel_s=dp, other_s=other)

    def row(self, kinds: Sequence[str]) -> list[float]:
        kind = gpu_kind(self.run.cluster.gpu)
        c = self.compute_s
        return [c * (kind == k) for k in kinds] + [c * math.log10(self.run.model.parameters / 1e9),
                                                   c * self.run.recompute, self.data_parallel_s]

    def predicted_step_s(self, model: MfuModel) -> float:
        mfu = model.compute_mfu(self.run.cluster.gpu, self.run.model.parameters, self.run.recompute)
        return self.compute_s / mfu + model.exposed_s(self.data_parallel_s, self.other_s)

    def ratio(self, model: MfuModel) -> float:
        """Predicted over published tokens/s per GPU: the published step over the predicted one."""
        return self.run.step_s / self.predicted_step_s(model)


def held_out(runs: Sequence[PublishedRun]) -> list[bool]:
    """The module docstring's rule: every HELD_OUT_EVERY-th run of each source, in the file's order."""
    seen: dict[str, int] = {}
    flags = []
    for run in runs:
        seen[run.source] = seen.get(run.source, 0) + 1
        flags.append(seen[run.source] % HELD_OUT_EVERY == 0)
    return flags


def last_bounded_least_squares(matrix: np.ndarray, target: np.ndarray, low: float, high: float) -> np.ndarray:
    """argmin |matrix x - target|^2 with the last coefficient in [low, high], the others free. Least squares
    minimised over the free coefficients is convex in the last one, so the bounded optimum is the unbounded one
    where it lies in the bounds (numpy's lstsq, as scipy's lsq_linear first solves it and then keeps it, bit for
    bit), else the nearer bound with the others solved again: exact, where lsq_linear iterates to a tolerance, and
    without importing scipy (a second of a dry run)."""
    solution = np.linalg.lstsq(matrix, target, rcond=-1)[0]
    if low <= solution[-1] <= high:
        return solution
    last = min(max(float(solution[-1]), low), high)
    rest = np.linalg.lstsq(matrix[:, :-1], target - matrix[:, -1] * last, rcond=-1)[0]
    return np.append(rest, last)


def fit(features: Sequence[RunFeatures]) -> MfuModel:
    """Least squares of the relative step error over `features` (module docstring), f bounded to [0, 1]."""
    kinds = tuple(GPU_KINDS)
    matrix = np.array([f.row(kinds) for f in features]) / np.array([[f.run.step_s] for f in features])
    target = np.array([1.0 - f.other_s / f.run.step_s for f in features])
    solution = last_bounded_least_squares(matrix, target, 0.0, 1.0)
    sizes = [math.log10(f.run.model.parameters / 1e9) for f in features]
    return MfuModel(per_gpu=dict(zip(kinds, map(float, solution[:len(kinds)]))), size=float(solution[len(kinds)]),
                    recompute=float(solution[len(kinds) + 1]), exposed_data_parallel=float(solution[-1]),
                    log_size_range=(min(sizes), max(sizes)), fitted_on=tuple(f.run.id for f in features))


@dataclass(frozen=True, kw_only=True)
class Validation:
    """The fit and its errors: |predicted / published tokens/s per GPU - 1| on the fit set and the held-out set."""

    model: MfuModel
    features: tuple[RunFeatures, ...]
    held: tuple[bool, ...]

    def errors(self, held: bool, source: str | None = None) -> list[float]:
        return [abs(f.ratio(self.model) - 1) for f, h in zip(self.features, self.held)
                if h == held and (source is None or f.run.source == source)]

    @property
    def held_out_median(self) -> float:
        return median(self.errors(True))

    @property
    def held_out_max(self) -> float:
        return max(self.errors(True))

    def confidence_text(self) -> str:
        return (f"median {self.held_out_median:.0%}, max {self.held_out_max:.0%} "
                f"({len(self.errors(True))} published runs held out)")


@functools.cache
def validation(facts: RegistryFacts = REGISTRY_FACTS) -> Validation:
    """The MFU model fitted on the fit set of the published runs, with every run's features."""
    runs = published_runs()
    features = tuple(RunFeatures.of(run, facts) for run in runs)
    held = tuple(held_out(runs))
    model = fit([f for f, h in zip(features, held) if not h])
    return Validation(model=model, features=features, held=held)


def mfu_model() -> MfuModel:
    return validation().model


# ---- docs/published-runs.md ---------------------------------------------------------------------------------------

# The largest |error| the plan aims at on a held-out run, and at the median (the goals, stated in the doc).
GOAL_MEDIAN, GOAL_MAX = 0.15, 0.30


def _pct(value: float) -> str:
    return f"{value:.1%}"


def markdown_tables(fitted: Validation | None = None, facts: RegistryFacts = REGISTRY_FACTS) -> str:
    """The tables docs/published-runs.md holds between its markers, computed from the runs file (tests/
    test_published_runs.py holds the doc to this)."""
    from harness.project.rank_memory import GIB

    fitted = fitted or validation(facts)
    model = fitted.model
    lines = ["### The fit", "",
             "| coefficient | value | what it is |", "| --- | --- | --- |"]
    for kind, value in model.per_gpu.items():
        lines.append(f"| a ({kind}) | {value:.4f} | 1 / compute MFU of a 1B model on {kind}, not recomputed |")
    low, high = model.log_size_range
    lines += [f"| b | {model.size:.4f} | a decade of parameters (sizes fitted on: {10 ** low:.3g}B to "
              f"{10 ** high:.3g}B) |",
              f"| c | {model.recompute:.4f} | recomputed (full activation checkpointing) |",
              f"| f | {model.exposed_data_parallel:.4f} | exposed share of the data-parallel collectives |", ""]
    lines += ["Compute MFU at some sizes (not recomputed / recomputed):", "",
              "| GPU | 1B | 7B | 70B | 175B |", "| --- | --- | --- | --- | --- |"]
    for kind, names in GPU_KINDS.items():
        cells = [f"{model.compute_mfu(names[0], n, False):.1%} / {model.compute_mfu(names[0], n, True):.1%}"
                 for n in (1e9, 7e9, 70e9, 175e9)]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", "### Errors", "",
              "|predicted / published tokens/s per GPU - 1|, the model fitted on the fit set alone:", "",
              "| runs | set | count | median | max |", "| --- | --- | --- | --- | --- |"]
    sources = sorted({f.run.source for f in fitted.features})
    for held in (True, False):
        name = "held out" if held else "fitted on"
        for source in (None, *sources):
            errors = fitted.errors(held, source)
            if errors:
                lines.append(f"| {source or 'all'} | {name} | {len(errors)} | {_pct(median(errors))} | "
                             f"{_pct(max(errors))} |")
    beyond = [(f, h) for f, h in zip(fitted.features, fitted.held) if abs(f.ratio(model) - 1) > GOAL_MAX]
    lines += ["", f"Runs off by more than {GOAL_MAX:.0%} (goal: none held out):", ""]
    lines += [f"- `{f.run.id}` ({'held out' if h else 'fitted on'}): predicted / published {f.ratio(model):.3f}"
              for f, h in beyond] or ["- none"]
    memory = [(f.run, f.run.memory(facts)) for f in fitted.features]
    refused = [(run, terms) for run, terms in memory if terms.total > run.cluster.gpu_memory_GiB * GIB]
    lines += ["", "Runs whose layout the plan would mark \"does not fit\" (goal: none):", ""]
    lines += [f"- `{run.id}`: {terms.describe()} GiB of {run.cluster.gpu_memory_GiB:g}" for run, terms in refused] \
        or ["- none"]
    lines += ["", "### The runs", "",
              "| run | GPUs | model | seq | layout | batch | published tokens/s/GPU | MFU (ours) | predicted | "
              "set | GiB/GPU counted |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    from harness.project.published_runs import model_mfu

    for (f, held), (run, terms) in zip(zip(fitted.features, fitted.held), memory):
        split = run.layout.split
        layout = f"{run.layout.label}"
        predicted = run.model.seq_len * run.global_batch / run.gpus / f.predicted_step_s(model)
        lines.append(f"| `{run.id}` | {run.gpus} {run.cluster.gpu} | {run.model.name} "
                     f"({run.model.parameters / 1e9:.3g}B) | {run.model.seq_len} | {layout} | "
                     f"{run.global_batch} = {run.micro_batch} x {run.micro_batches} x {split.data_parallel} | "
                     f"{run.tokens_per_s_per_gpu:,.0f} | {model_mfu(run):.1%} | {predicted:,.0f} "
                     f"({f.ratio(model):.3f}) | {'held out' if held else 'fit'} | "
                     f"{terms.total / GIB:.1f} of {run.cluster.gpu_memory_GiB:g} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_tables())
