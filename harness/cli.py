"""Command line: a thin adapter over the harness's plain functions.

    python -m harness run --matrix full
    python -m harness run --matrix smoke --strategy ddp --world-sizes 2 --global-batch 32
    python -m harness run --matrix scaling --dry-run --gpus-per-node 8 --nnodes 4 --placement k8s --out k8s/scaling
    python -m harness list
    python -m harness memory --params 7B --dp 8 --option tp=8
    python -m harness comm --world-size 2
    python -m harness project results/reference/ci-cpu/smoke.jsonl --cluster dgx-h100-ib
    python -m harness project --params 1.5B --compute-ms 120 --cluster dgx-h100-ib --strategies ddp,zero3
    python -m harness plan --params 7B --shape 4096,4096,32,32 --cluster dgx-h100-ib --nodes 8 --tokens 1e9
    python -m harness report results/full-*.jsonl --out report/
    python -m harness compare results/base.jsonl results/new.jsonl
    python -m harness expect results/ci.jsonl --against results/reference/ci-expectations/ci.json
    python -m harness ab
    python -m harness derive-check
    python -m harness reproduce 3f2a9c

Exit statuses, the same for every command:
  0  done, and what was judged passed
  1  a regression (`compare`, `ab`), a difference (`expect`, `derive-check`), or a row that could not be appended
     (a full disk)
  2  bad input, in one line `parbench: error: ...`, before any process is launched
  3  `expect`: rows of other versions than the expectations' (an upgrade, whose figures must be re-recorded)
  4  `run`: a launch ended `failed`, `oom` or `timeout` (EXIT_CELLS_FAILED), after every other cell has run and
     every row is written
  5  `run`: a launch's rows failed a check, parity or a resume `mismatch` (EXIT_CHECK_FAILED), likewise
  6  `compare`, `ab`: nothing could be judged (EXIT_NOTHING_JUDGED), with one line saying why and how many launches
     a side would judge; `--allow-unjudged` exits 0 instead
`run --allow-failed-cells` exits 0 instead of 4 or 5, for runs whose rows are judged afterwards.
"""

from __future__ import annotations

import argparse
import decimal
import importlib.util
import math
import os
import shlex
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tqdm import tqdm

from harness.launch.plan import threads_per_rank
from harness.machine import Machine, oversubscription_warning
from harness.matrix import MATRICES, Selection, build_matrix, launch_order
from harness.outputs import check_folder, check_results_file
from harness.record import COMMBENCH_KIND, AppendError, ResultsError, read_rows
from harness.rank.faults import fault_from_environment
from harness.emulate.network import EmulatedNetwork
from harness.emulate.session import check_emulation
from harness.launch.interrupt import Interrupted, raising_on_stop_signals
from harness.launch.placement import NAMED, EmulatedPlacement, KubernetesPlacement, Placement, make_placement
from harness.launch.placement.k8s import DEFAULT_IMAGE, JobKind, manifests_left_over
from harness.spec import DeviceKind, RunResult, RunSpec, SpecError, Status


if TYPE_CHECKING:
    from harness.runner import Planned, RunOptions

# `run`'s exit status when a launch ended in one of FAILED_STATUSES: distinct from bad input (2) and a failed
# append (1), so a script driving the harness (the Docker check, CI) can tell that cells failed. `skipped` is
# not a failure: a strategy this environment cannot run says so in its row.
EXIT_CELLS_FAILED = 4
FAILED_STATUSES = frozenset({Status.FAILED, Status.OOM, Status.TIMEOUT})
# `run`'s exit status when a launch ran but its rows failed a check: a parity or a resume mismatch is a wrong
# result, as much a failure of the cell as a crash, and must not pass a script that reads only the status.
EXIT_CHECK_FAILED = 5
# `compare`'s and `ab`'s exit status where nothing could be judged: "0 metrics judged" is not a pass.
EXIT_NOTHING_JUDGED = 6
# `comm` on CPU refuses more ranks a core than this without --oversubscribe: 64 ranks on this 2-core machine ran on for
# 19 minutes after their parent was killed, timing nothing but the cores' sharing. 4 leaves the emulated clusters'
# layouts (8 ranks on 8 namespace nodes of 2 cores) and a 2-rank check on one core.
COMM_RANKS_PER_CORE = 4


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _strategies(text: str) -> tuple[str, ...]:
    """Comma-separated strategies, each NAME or NAME[KEY=VALUE,...] (`harness project --strategies`): a comma
    inside brackets separates options, not strategies (harness.project.run.parse_strategy reads each)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return tuple(part.strip() for part in (*parts, current) if part.strip())


def _int_csv(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None


SIZE_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
BYTE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# The largest count a command takes: a 64-bit integer's, far beyond any model, batch or token budget, and below
# where a float would stop holding whole numbers apart (2^53 is already 9e15).
COUNT_LIMIT = 2**63 - 1


def _count(text: str, suffixes: dict[str, int] = SIZE_SUFFIXES) -> int:
    """'124M', '1.5B', '8.03B', '4096', '1e9' -> a whole number, exactly (decimal arithmetic: 8.03B is
    8,030,000,000, not a float's 8,029,999,999); byte sizes use binary K/M/G. Not a number, not finite, not whole,
    below 1 or past COUNT_LIMIT: an ArgumentTypeError naming what is allowed."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("I")
    unit = raw[-1] if raw and raw[-1] in suffixes and not raw[-1].isdigit() else ""
    allowed = (f"a positive whole number with an optional suffix ({', '.join(s for s in suffixes if s)}), "
               f"at most {COUNT_LIMIT:.3g}")
    try:
        value = decimal.Decimal(raw[: len(raw) - len(unit)]) * suffixes[unit]
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
    if not value.is_finite() or value < 1 or value > COUNT_LIMIT:
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}: {value.normalize():f} is not whole")
    return int(value)


def _bytes(text: str) -> int:
    return _count(text, BYTE_SUFFIXES)


def _seconds(text: str) -> float:
    """A timeout: a positive, finite number of seconds (0 would kill every launch at once, inf never)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


def _threshold(text: str) -> tuple[str, float]:
    metric, _, value = text.rpartition("=")
    try:
        return metric or "*", float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or METRIC=NUMBER, got {text!r}") from None


def _shape(text: str) -> dict[str, object]:
    """--shape of `harness plan`, `memory` and `project` (harness.project.model.parse_shape)."""
    from harness.project.model import parse_shape

    try:
        return parse_shape(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    if lowered in ("none", "null"):
        return key, None
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (no usage dump) so they read like the harness's own."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SpecError(message)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --shape, --params and --seq-len: a described decoder (harness.project.model.described)."""
    from harness.project.model import SHAPE_SYNTAX

    parser.add_argument("--model", help="a preset: every transformer workload (gpt2-small ... llama3-8b) and public "
                        "shapes (llama3.2-3b, llama3-70b, llama3.1-405b, gpt3-175b)")
    parser.add_argument("--shape", type=_shape, help=SHAPE_SYNTAX)
    parser.add_argument("--params", type=_count, help="parameters, e.g. 7B (default: the shape's own count)")
    parser.add_argument("--seq-len", type=int, help="tokens a sample, instead of the preset's")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m harness", description="parbench: distributed training strategies, "
                     "benchmarked on identical workloads.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run a matrix of cells and append their rows")
    run.add_argument("--matrix", default="smoke", help=f"one of: {', '.join(MATRICES)}")
    run.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when a GPU is visible")
    run.add_argument("--gpus-per-node", type=int, help="with --device cuda: GPUs of each node to plan for "
                     "(default: those visible here; more than that only with --dry-run)")
    run.add_argument("--cpus-per-node", type=int, help="with --device cpu: cores of each node to plan for, a "
                     "rank per core (default: this host's; more than that only with --dry-run)")
    run.add_argument("--workload", type=_csv, help="comma-separated workloads to keep")
    run.add_argument("--strategy", type=_csv, help="comma-separated strategies to keep")
    run.add_argument("--world-sizes", type=_int_csv, help="comma-separated world sizes")
    run.add_argument("--repeats", type=int, help="launches per cell")
    run.add_argument("--global-batch", type=int, help="samples per optimizer step (overrides the matrix)")
    run.add_argument("--micro-batch", type=int, help="samples per forward pass per rank (overrides)")
    run.add_argument("--precision", help="fp32, bf16 or fp16 (overrides)")
    run.add_argument("--warmup-steps", type=int)
    run.add_argument("--timed-steps", type=int)
    run.add_argument("--seed", type=int)
    run.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                     help="strategy option for every selected cell (repeatable)")
    run.add_argument("--out", type=Path, help="results JSONL (default: results/<matrix>-<time>.jsonl); with "
                     "--placement k8s, the folder the manifests are written to")
    run.add_argument("--timeout", type=_seconds, default=900.0, help="seconds per launch before its ranks are killed")
    run.add_argument("--budget", type=_seconds, help="seconds the whole run may take: no launch starts with under "
                     "30 s of it left, each times out at what is left, and those not started are recorded skipped "
                     "(a lent GPU's or an allocation's time)")
    run.add_argument("--resume", action="store_true", help="with --out: skip launches already recorded ok there, and "
                     "record those whose measurements reached their cell folder without their row")
    run.add_argument("--dry-run", action="store_true", help="print the cells and exit (with --placement k8s, "
                     "also write each launch's manifest to --out DIR)")
    run.add_argument("--cluster", help="with --dry-run for GPU nodes (--gpus-per-node): the cluster its wall time "
                     "and GPU-hours are projected on, a preset (dgx-h100-ib, dgx-a100-ib, aws-p4d, aws-p5, "
                     f"commodity-100gbe) or a .toml file (default {DRY_RUN_CLUSTER}; its GPUs a node are --gpus-per-node)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --cluster: override a "
                     "cluster key for the dry run's projection, e.g. inter_node_bandwidth_GBps=100")
    run.add_argument("--allow-failed-cells", action="store_true", help=f"exit 0 even when a launch ended failed, "
                     f"oom or timeout (default: exit {EXIT_CELLS_FAILED} after the whole matrix has run)")
    run.add_argument("--hostfile", type=Path, help="DeepSpeed/MPI hostfile ('HOST slots=N' lines): run the "
                     "cells on these hosts, multi-rank cells spread over --nnodes of them")
    run.add_argument("--nnodes", type=int, help="nodes a multi-rank cell spreads over (default: every host of "
                     "the hostfile; 1 under --slurm)")
    run.add_argument("--remote-shell", help="with --hostfile: how to run a command on a host "
                     "(default 'ssh -o BatchMode=yes {host}'; {host} and {node} are filled in)")
    run.add_argument("--slurm", action="store_true", help="submit each launch as a Slurm job (sbatch --wait)")
    run.add_argument("--slurm-args", help="extra sbatch arguments, e.g. '--partition gpu --account proj'")
    run.add_argument("--emulate-link", metavar="RATE", help="run on an emulated cluster on this machine (root): "
                     "nodes as network namespaces whose links tc shapes to RATE, e.g. 100mbit or 1gbit")
    run.add_argument("--emulate-nodes", type=int, default=2, help="with --emulate-link: nodes (default 2)")
    run.add_argument("--placement", choices=NAMED, help="k8s: write each launch as a Kubernetes (Kubeflow) manifest "
                     "for you to submit with kubectl, with --dry-run --out DIR (docs/clusters.md)")
    run.add_argument("--k8s-image", help=f"with --placement k8s: the image every pod runs (default {DEFAULT_IMAGE}, "
                     "the Dockerfile's, pushed where the cluster pulls from)")
    run.add_argument("--k8s-namespace", help="with --placement k8s: the namespace (default default)")
    run.add_argument("--k8s-results-claim", help="with --placement k8s: the PersistentVolumeClaim every pod mounts "
                     "at /parbench/results, where cell folders and rows go (default parbench-results)")
    run.add_argument("--k8s-job", choices=[kind.value for kind in JobKind], help="with --placement k8s: what "
                     "torchrun cells become, a PyTorchJob (default) or a Trainer v2 TrainJob; other cells keep theirs")
    run.add_argument("--k8s-shm", help="with --placement k8s: the size of each pod's /dev/shm (default 16Gi)")
    run.add_argument("--profile-steps", type=int, default=0, help="GPU only: after the timed steps, profile "
                     "this many steps for NCCL kernel time and its overlap with compute")
    run.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s for MFU, used instead of "
                     "the datasheet table (which has no CPUs) and recorded as the user's")

    memory = commands.add_parser(
        "memory", help="predicted memory per rank for every strategy: model states, and with a model's shape every "
                       "other term",
        description="Model states (weights, gradients, optimizer state) per rank of every strategy, for a model "
                    "(--params, or --model PRESET / --shape for every term) on --dp data-parallel replicas, each a "
                    "group of tp ranks (fsdp2-tp, autotp: --option tp=N) or of pipeline stages (pipeline: --option "
                    "stages=N); GPUs = dp x tp x stages, and tp alone is one group of tp ranks. Each strategy's own "
                    "plan over the parameters one of its ranks holds: with a shape, the embeddings, norms and an "
                    "untied head whole on every tp rank; with --params alone every parameter split tp ways. With a "
                    "shape, also the activations, the logits and loss, the strategy's buckets, gathered parameters "
                    "and accumulated gradients and the allowance, at --micro-batch samples and --micro-batches a "
                    "step, as `harness plan` counts them. A strategy that cannot run --recipe shows '-', and every "
                    "'-' has its reason printed under the table.")
    add_model_arguments(memory)
    memory.add_argument("--micro-batch", type=int, default=1, help="with a shape: samples a forward (default 1)")
    memory.add_argument("--micro-batches", type=int, default=1, help="with a shape: micro-batches a replica runs a "
                        "step (default 1; above 1 FSDP2 keeps unsharded gradients between them)")
    memory.add_argument("--dp", type=int, required=True, help="data-parallel replicas, each one rank, a group of "
                        "tp ranks or a pipeline of stages")
    memory.add_argument("--recipe", default="autocast", help="precision recipe: fp32, autocast, deepspeed-bf16, "
                        "deepspeed-fp16, fsdp-mp-policy; a strategy that cannot run it shows '-'")
    memory.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the strategies that take it, e.g. tp=8 (fsdp2-tp, autotp, and tp's own "
                             "degree), stages=4 (pipeline), offload_optimizer=cpu (ZeRO), offload_policy=cpu "
                             "(FSDP2): offloaded states are counted on the host, not the device")
    memory.add_argument("--largest-layer", type=_count, help="the most parameters one module holds itself "
                        "(DeepSpeed's largest_layer_params, for its ZeRO-3 estimate; default: params / 20)")
    memory.add_argument("--gpus-per-node", type=int, help="for DeepSpeed's estimator: the --dp GPUs lie on "
                        "dp / gpus-per-node nodes (default: --dp, one node)")
    memory.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's estimator")

    comm = commands.add_parser("comm", help="collective microbenchmark: time, algbw, busbw per size")
    comm.add_argument("--world-size", type=int, default=2)
    comm.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when a GPU is visible")
    comm.add_argument("--collectives", type=_csv, help="default: all_reduce, all_gather, reduce_scatter, "
                      "broadcast, all_to_all")
    comm.add_argument("--min-bytes", type=_bytes, default=1024, help="smallest size (default 1K)")
    comm.add_argument("--max-bytes", type=_bytes, default=16 << 20, help="largest size (default 16M)")
    comm.add_argument("--warmup", type=int, default=5)
    comm.add_argument("--iters", type=int, default=20)
    comm.add_argument("--out", type=Path, help="results JSONL (default: results/comm-<time>.jsonl)")
    comm.add_argument("--timeout", type=_seconds, default=600.0, help="seconds before the benchmark's ranks are killed")
    comm.add_argument("--emulate-link", metavar="RATE", help="across the nodes of an emulated cluster (root), "
                      "links shaped to RATE (e.g. 100mbit), the ranks spread evenly over the nodes")
    comm.add_argument("--emulate-nodes", type=int, default=2, help="with --emulate-link: nodes (default 2)")
    comm.add_argument("--group-size", type=int, default=0, help="split the ranks into groups of this many, each "
                      "running the collectives among its members at the same time as the others (default: the world)")
    comm.add_argument("--group-layout", default="contiguous", help="with --group-size: contiguous (consecutive "
                      "ranks: inside a node) or strided (ranks world-size / group-size apart: across nodes)")
    comm.add_argument("--oversubscribe", action="store_true", help=f"on CPU, run more than {COMM_RANKS_PER_CORE} "
                      "ranks a core (refused otherwise: their timings measure the cores' sharing)")

    project = commands.add_parser("project", help="predict step time, throughput, scaling efficiency and "
                                  "memory per rank at world sizes not measured (harness.project.projection)")
    project.add_argument("rows", type=Path, nargs="*", help="results JSONL files with measured cell rows")
    project.add_argument("--comm", type=Path, nargs="+", default=[], help="`harness comm` rows of the host the rows "
                         "ran on: the measured overlap is judged against them; with no --cluster they are the target")
    project.add_argument("--cluster", help="target: a preset (dgx-h100-ib, dgx-a100-ib, aws-p4d, aws-p5, "
                         "commodity-100gbe) or a FILE.toml")
    project.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a cluster key, "
                         "e.g. inter_node_bandwidth_GBps=100 (repeatable)")
    project.add_argument("--algorithm", action="append", default=[], metavar="COLLECTIVE=ALGORITHM",
                         help="force one, e.g. all_reduce=hierarchical (default: each call by the least modelled "
                         "time among the library's algorithms; repeatable)")
    project.add_argument("--library", help="with --cluster: the collective library that runs there, nccl (default), "
                         "gloo or mpi: it decides which algorithms a call can get")
    project.add_argument("--world-sizes", type=_int_csv, help="default: 8,16,...,1024")
    project.add_argument("--scaling", type=_csv, default=("weak", "strong"), help="weak, strong or both (default)")
    project.add_argument("--out", type=Path, help="append the projected rows (kind projection) to this JSONL")
    project.add_argument("--validate", action="store_true", help="predict every measured multi-rank cell of ROWS "
                         "from its setting's world-size-1 cells and --comm rows, without it, and print the errors")
    project.add_argument("--design", default="interpolate", help="with --validate: which cells predict which: "
                         "interpolate (the nearest other world size; default), larger (cells above "
                         "--largest-source ranks from the largest at or below it), across-settings (each cell from "
                         "the same world size at another link rate)")
    project.add_argument("--largest-source", type=int, default=2, help="with --validate --design larger: the "
                         "largest world size a prediction may start from (default 2)")
    project.add_argument("--params", type=_count, help="a description instead of rows: parameters, e.g. 1.5B")
    project.add_argument("--model", help="a description from a preset (its parameters and shape): every transformer "
                         "workload and public shapes (llama3-70b, gpt3-175b, ...)")
    project.add_argument("--compute-ms", type=float, help="with --params: compute time of one step on one device "
                         "(default, with --shape and a --cluster naming its gpu: FLOPs / (peak x --mfu), as plan)")
    project.add_argument("--mfu", type=float, help="with --params --shape and no --compute-ms: fraction of the GPU's "
                         "peak its compute runs at (default 0.4, an assumption)")
    project.add_argument("--grad-bytes", type=float, help="with --params: bytes per gradient element "
                         "as reduced (and per parameter as gathered; default 4)")
    project.add_argument("--strategies", type=_strategies, help="strategies to project, each NAME or "
                         "NAME[KEY=VALUE,...] with options of its own (e.g. ddp,ps,ps[servers=8]): with --params, the "
                         "described model under each (default: every data-parallel one); with ROWS, only their cells "
                         "(with those options; default: all)")
    project.add_argument("--batch-per-device", type=int, help="with --params: samples per device per step "
                         "(default 1)")
    project.add_argument("--global-batch", type=int, help="with --params: strong scaling's global batch (default: "
                         "batch per device x the largest world size)")
    project.add_argument("--recipe", help="with --params: precision recipe for memory (default autocast)")
    project.add_argument("--shape", type=_shape, help="with --params: a transformer's SEQ,HIDDEN,HEADS,LAYERS[,...] "
                         "(as plan takes it), for the activations a rank holds (every block whole and checkpointed) "
                         "beside its model states")
    project.add_argument("--exposed-fraction", type=float, help="with --params: f, exposed time over "
                         "priced communication, >= 0 (default 1: no overlap; above 1: collectives cost more in the "
                         "step than priced)")
    project.add_argument("--storage-GBps", type=float, help="the target's aggregate storage write bandwidth, GB/s "
                         "(1e9 B/s): adds each point's checkpoint bytes and save time (harness.project.goodput)")
    project.add_argument("--mtbf-hours", type=float, help="with --storage-GBps: one GPU's mean time between "
                         "failures, hours (the job's is this / N): adds the Young/Daly checkpoint interval and goodput")
    project.add_argument("--restart-s", type=float, help="with --mtbf-hours: seconds from a failure until training "
                         "runs again (default 0)")

    planner = commands.add_parser(
        "plan", help="every layout of a described model on a described cluster: what fits, ranked by projected step",
        description="Every layout (DDP, Horovod, ZeRO-1/2/3, FSDP2, tp, fsdp2-tp, autotp, the pipeline; activation "
                    "checkpointing off and on) of a decoder (--model PRESET, or --shape with or without --params) on "
                    "--nodes nodes of --cluster: every byte a GPU needs by term, whether it fits, the projected step "
                    "with its range (compute at the MFU fitted on published GPU runs, communication on the "
                    "cluster's links), throughput, MFU, GPU-hours for --tokens; the layouts equivalent within the "
                    "error grouped, and the simplest one's `run --dry-run` on that cluster. Projected, not measured "
                    "(docs/projection.md, \"Planning a layout\"; docs/published-runs.md).")
    add_model_arguments(planner)
    planner.add_argument("--cluster", required=True, help="a preset (dgx-h100-ib, dgx-a100-ib, aws-p4d, aws-p5, "
                         "commodity-100gbe) or a cluster TOML file naming its gpu and gpu_memory_GiB")
    planner.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a cluster key, "
                         "e.g. gpu_memory_GiB=40")
    planner.add_argument("--nodes", type=int, required=True, help="nodes of the cluster to plan for")
    planner.add_argument("--tokens", type=_count, required=True, help="tokens to train, for the GPU-hours, e.g. 1e9")
    batch = planner.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-tokens", type=_count, help="tokens a step (default 4M = 2^22: 1024 samples "
                       "of 4096)")
    batch.add_argument("--global-batch", type=int, help="samples a step, instead of --global-batch-tokens")
    planner.add_argument("--micro-batch", type=int, help="samples a forward (default: the largest power of two "
                         "that fits)")
    planner.add_argument("--mfu", type=float, help="the compute MFU, a fraction of the peak (default: fitted on "
                         "published GPU runs for the cluster's GPU, the model's size and recomputation)")
    planner.add_argument("--recipe", help="precision recipe of every layout: users (default: each strategy's own, "
                         "FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16 section, autocast elsewhere), autocast, "
                         "fp32")
    planner.add_argument("--peak-tflops", type=float, help="one GPU's peak TFLOP/s, instead of its datasheet's")

    report = commands.add_parser("report", help="Markdown + self-contained HTML report, CSV and Parquet")
    report.add_argument("results", type=Path, nargs="+", help="results JSONL files (cell and comm rows)")
    report.add_argument("--out", type=Path, default=Path("report"), help="output folder (default: report/)")

    compare = commands.add_parser("compare", help="flag regressions between two results files (exit 1 if any)")
    compare.add_argument("base", type=Path)
    compare.add_argument("new", type=Path)
    compare.add_argument("--threshold", type=_threshold, action="append", default=[], metavar="[METRIC=]X",
                         help="override the measured thresholds: X for every metric, METRIC=X for one "
                         "(relative, e.g. 0.2; exposed_comm_share in share points, 0.05 = 5 points); repeatable")
    compare.add_argument("--alpha", type=float, default=0.05, help="largest chance that a comparison of "
                         "unchanged software names any regression (Holm over its metrics); with their number "
                         "it sets the launches needed (0.05: 3 a side for 1 metric, 5 for up to 12)")
    compare.add_argument("--metric", action="append", default=[], metavar="METRIC", help="judge only this metric "
                         "(repeatable; default: every one): a smaller family needs fewer launches a side")
    compare.add_argument("--all", action="store_true", help="also list unchanged metrics")
    compare.add_argument("--allow-unjudged", action="store_true", help=f"exit 0 where nothing could be judged "
                         f"(default: exit {EXIT_NOTHING_JUDGED}, saying why)")

    expect = commands.add_parser("expect", help="hold the figures that do not depend on the machine to committed "
                                 "expectations (exit 1 on a difference, 3 if recorded under other versions)")
    expect.add_argument("results", type=Path, nargs="+", help="results JSONL files of one run")
    expect.add_argument("--against", type=Path, required=True, help="the expectations file (JSON), e.g. "
                        "results/reference/ci-expectations/ci.json")
    expect.add_argument("--write", action="store_true", help="record the rows' figures as the expectations "
                        "instead of checking them (review the diff before committing it)")

    ab = commands.add_parser("ab", help="same-job A/B: the base commit and this checkout, launches in turns, "
                             "judged on step time and peak memory (exit 1 on a regression)")
    ab.add_argument("--base", default="HEAD^1", help="the base: the merge base of this ref and HEAD (default "
                    "HEAD^1, the previous main)")
    ab.add_argument("--a-a", action="store_true", help="base = HEAD: every regression is a false alarm")
    ab.add_argument("--repeat", type=int, default=1, help="run the tier N times and tally them (default 1)")
    ab.add_argument("--strategy", type=_csv, help="the cells' strategies, comma-separated (default: DDP and each "
                    "strategy the change touches, as many as the tier's budget holds; harness/ab.py, select_cells)")
    ab.add_argument("--launches", type=int, help="launches a side at least (default 8, harness/ab.py's AB_LAUNCHES, "
                    "fewer where the budget holds more touched cells; "
                    "3 at the least, and more where the gate needs them for the family)")
    ab.add_argument("--threshold", type=_threshold, action="append", default=[], metavar="[METRIC=]X",
                    help="as for compare (default: the tier's measured step-time threshold, harness/ab.py)")
    ab.add_argument("--plant-new", default="", metavar="FAULT", help="PARBENCH_FAULT for the new side's launches "
                    "alone, e.g. slow-step:factor=1.3:rank=all:step=0:strategy=ddp")
    ab.add_argument("--matrix", default="smoke", help=f"one of: {', '.join(MATRICES)} (default smoke)")
    ab.add_argument("--out", type=Path, help="folder for both sides' rows and launch logs (default results/ab-<time>)")
    ab.add_argument("--allow-unjudged", action="store_true", help=f"exit 0 where the tier judged nothing (a shallow "
                    f"clone, a base that does not launch; default: exit {EXIT_NOTHING_JUDGED}, saying why)")

    derive = commands.add_parser("derive-check", help="every derived figure of the committed reference rows, by the "
                                 "base's code and this checkout's, held to results/reference/derive-expectations.json "
                                 "(exit 1 on an unacknowledged change; harness/derive_check.py)")
    derive.add_argument("--base", default="HEAD^1", help="the base: the merge base of this ref and HEAD "
                        "(default HEAD^1)")
    derive.add_argument("--record", action="store_true", help="write this checkout's figures to the expectations file "
                        "instead (review the diff and commit it with the change)")
    derive.add_argument("--set", action="append", dest="sets", metavar="NAME", help="only this reference set "
                        "(repeatable; harness/derive/snapshot.py, REFERENCE_SETS)")
    derive.add_argument("--out", type=Path, help="also write both sides' figures here (head.json, base.json)")

    reproduce = commands.add_parser("reproduce", help="re-run the cell behind a row and append the new row")
    reproduce.add_argument("run_id", help="a row's run_id (a unique prefix is enough)")
    reproduce.add_argument("--results", type=Path, nargs="+", help="files to search (default: results/*.jsonl)")
    reproduce.add_argument("--timeout", type=_seconds, default=900.0, help="seconds before the launch's ranks are killed")

    commands.add_parser("list", help="matrices, workloads and strategies")

    doctor = commands.add_parser("doctor", help="what this machine can run: GPUs, versions, Horovod's and DeepSpeed's "
                                                "builds, launchers, strategies (exit 1: --matrix has cells it cannot run)")
    doctor.add_argument("--matrix", choices=list(MATRICES), help="also check this matrix's cells here")
    doctor.add_argument("--device", choices=[d.value for d in DeviceKind], help="cpu or cuda (default: cuda if "
                                                                                "visible)")
    return parser


def plan_run(args: argparse.Namespace) -> tuple[list[RunSpec], Placement]:
    """The validated cells a `run` invocation asks for and where they go, planned for the machine it names
    (this one, or with --dry-run one it need not be); raises SpecError before anything launches, and warns
    in one line on stderr where CPU ranks would outnumber a node's cores."""
    emulated = EmulatedNetwork.planned(args.emulate_link, args.emulate_nodes) if args.emulate_link else None
    kubernetes = {field: value for field, value in (("image", args.k8s_image), ("namespace", args.k8s_namespace),
                                                    ("results_claim", args.k8s_results_claim), ("job", args.k8s_job),
                                                    ("shm_size", args.k8s_shm)) if value is not None}
    if args.placement == KubernetesPlacement.name and args.dry_run:
        if args.out is None:
            raise SpecError("--placement k8s --dry-run needs --out DIR: the folder each launch's manifest is "
                            "written to")
        kubernetes["manifests"] = args.out
    placement = make_placement(args.hostfile, args.nnodes, args.remote_shell, args.slurm, args.slurm_args,
                               dry_run=args.dry_run, emulated=emulated, named=args.placement, kubernetes=kubernetes)
    # Under Slurm the nodes are not this host (a login node often has no GPU): their devices are described
    # by the flags, as for a dry run, and the job asks Slurm for them.
    machine = Machine.requested(args.device, gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node,
                                nodes=placement.nnodes, dry_run=args.dry_run or args.slurm)
    overrides = tuple((name, getattr(args, name)) for name in
                      ("global_batch", "micro_batch", "precision", "warmup_steps", "timed_steps", "seed")
                      if getattr(args, name) is not None)
    select = Selection(workloads=args.workload, strategies=args.strategy, world_sizes=args.world_sizes,
                       repeats=args.repeats, overrides=overrides, options=tuple(args.option))
    specs = [placement.place(spec, machine.devices_per_node) for spec in build_matrix(args.matrix, machine, select)]
    if emulated is not None and not args.dry_run:
        check_emulation(emulated, specs)
    warning = oversubscription_warning(specs, machine, threads_per_rank, placement.ranks_sharing_a_machine)
    if warning:
        print(f"parbench: warning: {warning}", file=sys.stderr)
    return specs, placement


def run_placed(specs: list[RunSpec], options: "RunOptions", **callbacks: Any) -> list[RunResult]:
    """harness.runner.run_specs at `options.placement`, inside the emulated cluster it names if it is one
    (built for these launches, torn down after, recorded in each row)."""
    from harness.runner import run_specs

    placement = options.placement
    if not isinstance(placement, EmulatedPlacement):
        return run_specs(specs, options, **callbacks)
    from harness.emulate.session import emulating

    print(f"parbench: on {placement.describe()}", file=sys.stderr)
    with emulating(placement.network, specs) as network:
        return run_specs(specs, replace(options, emulated_network=network), **callbacks)


# The cluster a GPU dry run's wall time is projected on where --cluster names none: a common current node (8 H100s
# on InfiniBand), said in the plan as an assumption.
DRY_RUN_CLUSTER = "dgx-h100-ib"


def dry_run_target(args: argparse.Namespace, placement: Placement) -> Machine | None:
    """The nodes a dry run plans for where the flags describe them (--gpus-per-node, --cpus-per-node, --nnodes
    above 1), whose skips are theirs; None where it plans this host's cells alone: this host is the target."""
    if args.gpus_per_node is None and args.cpus_per_node is None and placement.nnodes == 1:
        return None
    return Machine.requested(args.device, gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node,
                             nodes=placement.nnodes, dry_run=True)


def dry_run_cluster(args: argparse.Namespace, target: Machine | None) -> tuple[Any, str]:
    """(the cluster a GPU dry run's cells are projected on, where it came from), or (None, "") for any other run;
    --cluster elsewhere is a SpecError. Its GPUs a node are the plan's (--gpus-per-node), whatever it says."""
    from harness.project.cluster import load_cluster

    gpu_plan = args.dry_run and target is not None and target.device is DeviceKind.CUDA
    if args.cluster is not None and not gpu_plan:
        raise SpecError(f"--cluster {args.cluster} prices a dry run of GPU nodes; allowed only with --dry-run "
                        "--gpus-per-node N")
    if args.set and not gpu_plan:
        raise SpecError("--set overrides the cluster a dry run of GPU nodes is priced on; allowed only with "
                        "--dry-run --gpus-per-node N")
    if not gpu_plan:
        return None, ""
    from harness.project.cells import cluster_peaks

    from harness.project.cluster import parse_overrides

    overrides = {**parse_overrides(args.set), "gpus_per_node": target.devices_per_node}
    cluster = load_cluster(args.cluster or DRY_RUN_CLUSTER, overrides)
    cluster_peaks(cluster)      # a cluster without a known GPU fails here, before any manifest is written
    source = "--cluster" if args.cluster else "assumed: the default, --cluster PRESET|FILE.toml to change it"
    return cluster, f"{source}; {target.devices_per_node} GPUs a node as --gpus-per-node says"


def command_run(args: argparse.Namespace) -> int:
    from harness.runner import RunOptions, summary_table

    specs, placement = plan_run(args)
    plan: dict[str, Any] = {}       # a dry run's target, the cells it would skip and the cluster it is priced on
    if args.dry_run:
        from harness.launch.dry_run import left_out_on

        plan["target"] = dry_run_target(args, placement)
        if plan["target"] is not None:
            specs, plan["left_out"] = left_out_on(specs, plan["target"])
    plan["cluster"], plan["cluster_source"] = dry_run_cluster(args, plan.get("target"))
    if args.profile_steps < 0:
        raise SpecError(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.resume and args.out is None:
        raise SpecError("--resume needs --out FILE: the results file whose recorded launches to skip")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise SpecError(f"--peak-tflops must be a positive TFLOP/s figure, got {args.peak_tflops:g}")
    try:
        fault_from_environment()
    except ValueError as error:
        raise SpecError(str(error)) from None
    if args.profile_steps:
        os.environ["PARBENCH_PROFILE_STEPS"] = str(args.profile_steps)   # ranks inherit it; rows record it
    if args.dry_run and isinstance(placement, KubernetesPlacement):
        return write_manifests(specs, placement, args.out, args.timeout, **plan)
    if args.dry_run:   # the plan, with every node's command; launches nothing, writes nothing
        from harness.launch.dry_run import describe_plan
        from harness.runner import resume_plan

        planned_out = args.out or Path("results") / f"{args.matrix}-{datetime.now():%Y%m%d-%H%M%S}.jsonl"
        repeats = None      # every repeat of every cell, from r0
        if args.resume:     # what a resume would launch, not the whole matrix, in the folders it would use
            specs, repeats, counts = resume_plan(specs, RunOptions(results=planned_out, placement=placement,
                                                                   resume=True))
            print(f"{run_header(counts, planned_out)} (a dry run of the resume: nothing is launched or written)")
            if not specs:
                return 0
        print(describe_plan(specs, placement, results=planned_out, timeout_s=args.timeout, repeats=repeats, **plan))
        return 0
    out = args.out or Path("results") / f"{args.matrix}-{datetime.now():%Y%m%d-%H%M%S}.jsonl"
    check_results_file(out, "--out" if args.out else "results file")
    from harness.doctor import summary

    print(summary(), file=sys.stderr)
    peak = args.peak_tflops * 1e12 if args.peak_tflops is not None else None
    options = RunOptions(results=out, timeout_s=args.timeout, peak_flops_per_s=peak, resume=args.resume,
                         placement=placement, budget_s=args.budget, launch_order=launch_order(args.matrix))
    # The bar shows the cell being launched and tqdm's ETA (mean time per launch so far x launches left);
    # off when stderr is not a terminal, where the per-launch lines below are the log.
    with tqdm(total=sum(spec.repeats for spec in specs), unit="launch", file=sys.stderr, disable=None,
              dynamic_ncols=True) as bar:
        def planned(plan: "Planned") -> None:
            bar.write(run_header(plan, out), file=sys.stderr)
            bar.total = plan.launches + plan.recovered
            bar.refresh()

        def started(spec: RunSpec, repeat: int) -> None:
            bar.set_description(f"{spec.label} r{repeat}")

        def finished(result: RunResult) -> None:
            bar.write(f"  {result.status.value:<8} {result.spec.label} r{result.repeat} "
                      f"({result.wall_time_s:.0f} s){'  ' + result.message[:100] if result.message else ''}",
                      file=sys.stderr)
            bar.update(1)

        results = run_placed(specs, options, on_result=finished, on_start=started, on_plan=planned)
    print(summary_table([result.to_dict() for result in results], results_file=out))
    print(f"\nrows appended to {out}")
    return run_exit_status(results, allow_failed=args.allow_failed_cells,
                           checks_failed=failed_checks([result.to_dict() for result in results], out))


def failed_checks(rows: Sequence[dict], results_file: Path | None = None) -> list[str]:
    """"label: what failed" for each of `rows` that is a parity or a resume mismatch, judged as the summary judges
    them: beside every row of `results_file` (a reference recorded earlier counts)."""
    from harness.derive.parity import Verdict, judge
    from harness.derive.resume import resume_check
    from harness.derive.rows import label

    shown = {row.get("run_id") for row in rows}
    earlier = [row for row in read_rows([results_file]) if row.get("run_id") not in shown] \
        if results_file is not None and results_file.exists() else []
    failed = []
    for row, parity in zip(rows, judge(list(rows) + earlier)):
        if parity.verdict is Verdict.MISMATCH:
            failed.append(f"{label(row)}: parity mismatch ({', '.join(parity.failed) or parity.note[:80]})")
        if row.get("status") == "ok" and (row.get("measurements") or {}).get("checkpoint"):
            check = resume_check(row)
            if check["verdict"] == "mismatch":
                failed.append(f"{label(row)}: resume mismatch ({', '.join(check['failed'])})")
    return failed


def run_exit_status(results: Sequence[RunResult], *, allow_failed: bool, checks_failed: Sequence[str] = ()) -> int:
    """0; or EXIT_CELLS_FAILED with one line on stderr naming how many launches failed and how; or, where every
    launch ran, EXIT_CHECK_FAILED with a line per row that failed a check (`failed_checks`)."""
    failed = [result for result in results if result.status in FAILED_STATUSES]
    if not failed and not checks_failed:
        return 0
    status = EXIT_CELLS_FAILED if failed else EXIT_CHECK_FAILED
    lines = []
    if failed:
        kinds = ", ".join(f"{sum(r.status is status for r in failed)} {status.value}"
                          for status in sorted(FAILED_STATUSES) if any(r.status is status for r in failed))
        lines.append(f"{len(failed)} of {len(results)} launches did not end ok ({kinds})")
    if checks_failed:
        lines.append(f"{len(checks_failed)} launches failed a check: " + "; ".join(checks_failed))
    outcome = "; ".join(lines)
    if allow_failed:
        print(f"parbench: {outcome}; exit 0 as --allow-failed-cells asks", file=sys.stderr)
        return 0
    print(f"parbench: {outcome}; exit {status} (--allow-failed-cells: exit 0)", file=sys.stderr)
    return status


def write_manifests(specs: list[RunSpec], placement: KubernetesPlacement, out: Path, timeout_s: float,
                    **plan: Any) -> int:
    """A Kubernetes dry run: every launch's manifest written to the folder `out`, and what they share (the
    TrainJobs' runtime), and the plan printed (`plan`: describe_plan's target, left_out and cluster)."""
    from harness.launch.dry_run import describe_plan, plan_files

    results = placement.results_file()
    planned = plan_files(specs, placement, results=results, timeout_s=timeout_s)
    shared = placement.shared_files(specs)
    paths = [[path for path, _ in files] for files in planned]
    check_folder(out, "--out")
    left = manifests_left_over(out, [path for cell in paths for path in cell] + [path for path, _ in shared])
    if left:
        raise SpecError(f"--out {out} holds {len(left)} manifest(s) this plan does not write, such as {left[0].name} "
                        f"(an earlier dry run's?): `kubectl create -f {out}` would submit them too; remove them or "
                        "choose another folder")
    for files in [*planned, shared]:
        for path, text in files:
            path.write_text(text)
    print(describe_plan(specs, placement, results=results, timeout_s=timeout_s, written=paths, **plan))
    for path, _ in shared:
        print(f"\nalso wrote {path}: the runtime the TrainJobs run on, for a cluster admin to apply once before the "
              f"first of them: kubectl apply -f {path}")
    return 0


def run_header(plan: "Planned", out: Path) -> str:
    """The run's first line: what it will launch, and what a resumed run found already recorded."""
    def launches(count: int) -> str:
        return f"{count} launch{'' if count == 1 else 'es'}"

    text = f"parbench: {plan.cells} cells, {launches(plan.launches)} -> {out}"
    if plan.recorded:
        text += f"; {launches(plan.recorded)} already recorded there, not launched again"
    if plan.recovered:
        text += f"; {launches(plan.recovered)} recorded from their cell folders without launching"
    if plan.seconds is not None and plan.launches:
        text += f"; planned: about {plan.seconds / 60:.1f} min at the 2-core VM's launch times (harness/run_cost.py)"
    return text


def command_list(args: argparse.Namespace) -> int:
    from harness.strategies import STRATEGIES
    from workloads import WORKLOADS

    print("matrices:")
    for name, function in MATRICES.items():
        print(f"  {name:<14} {(function.__doc__ or '').strip().splitlines()[0]}")
    print("workloads:")
    for name, workload in WORKLOADS.items():
        print(f"  {name:<14} {workload.family.value:<7} {workload.layer_count:>3} layers  "
              f"{workload.train_flops_per_sample:.3g} train FLOPs/sample")
    print("strategies:")
    for name, strategy in STRATEGIES.items():
        options = ", ".join(f"{k}={v.default}" for k, v in strategy.options.items())
        print(f"  {name:<14} {strategy.launcher:<11} {strategy.description}"
              + (f"  [options: {options}]" if options else ""))
    return 0


def command_memory(args: argparse.Namespace) -> int:
    """Each strategy's model states per rank (`model_state_plan` over the parameters one of its ranks holds, as its
    `model_split` lays out --dp replicas), DeepSpeed's estimate beside ZeRO-2/3's, with a model's shape every other
    term `harness plan` counts (harness.project.rank_memory), and under the table the reason for every figure left
    "-"."""
    from harness.derive.memory import plan_bytes
    from harness.project.facts import REGISTRY_FACTS
    from harness.project.model import described
    from harness.project.rank_memory import ALLOWANCE_TEXT, layout_memory
    from harness.strategies import STRATEGIES, PrecisionRecipe

    recipes = [recipe.value for recipe in PrecisionRecipe]
    if args.recipe not in recipes:
        raise SpecError(f"recipe {args.recipe!r} is not one of: {', '.join(recipes)}")
    if args.dp < 1:
        raise SpecError(f"--dp must be >= 1, got {args.dp}")
    if args.micro_batch < 1 or args.micro_batches < 1:
        raise SpecError(f"--micro-batch and --micro-batches must be >= 1, got {args.micro_batch} and "
                        f"{args.micro_batches}")
    model = None
    if args.model is not None or args.shape is not None:
        model = described(args.model, args.params, args.shape, args.seq_len)
    elif args.params is None:
        raise SpecError("describe the model: --params N (model states alone), or --model PRESET or --shape "
                        "(every term)")
    elif args.seq_len is not None:
        raise SpecError("--seq-len changes a preset's or a shape's sequence: give --model or --shape with it")
    parameters = model.parameters if model is not None else args.params
    gpus_per_node = args.dp if args.gpus_per_node is None else args.gpus_per_node
    if gpus_per_node < 1 or args.dp % gpus_per_node:
        raise SpecError(f"--dp {args.dp} must be a whole number of nodes of --gpus-per-node {gpus_per_node} "
                        f"(DeepSpeed's estimate is for nodes x GPUs per node = --dp GPUs)")
    nodes = args.dp // gpus_per_node
    given = dict(args.option)
    unknown = sorted(set(given) - {name for strategy in STRATEGIES.values() for name in strategy.options})
    if unknown:
        raise SpecError(f"no strategy has option(s) {', '.join(unknown)}")
    # The recipe is --recipe's alone: an option choosing another beside it would print one recipe's figures under
    # the other's name.
    recipe_options = sorted(set(given) & {"precision_recipe", "mixed_precision"})
    if recipe_options:
        raise SpecError(f"memory takes the precision recipe from --recipe, not option(s) {', '.join(recipe_options)}")
    # tp's degree is its world size, no option of its own: the one --option tp gives fsdp2-tp and autotp, else
    # their option's default, so that every tensor-parallel row splits alike.
    tp_option = next(strategy.options["tp"] for strategy in STRATEGIES.values() if "tp" in strategy.options)
    tensor_parallel = tp_option.given(given["tp"]) if "tp" in given else tp_option.default
    tp_option.check("tp", "tp", tensor_parallel)
    use_deepspeed = not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None
    recipe = PrecisionRecipe(args.recipe)
    gib = float(1 << 30)
    largest_layer = args.largest_layer or parameters // 20

    rows, refused, no_estimate, splits = [], {}, [], {}
    for name, strategy in STRATEGIES.items():
        if name in ("plain", "bare", "dataparallel"):
            continue
        taken = {key: strategy.options[key].given(value) for key, value in given.items() if key in strategy.options}
        strategy.check_options(taken)
        options = strategy.resolve_options(taken)
        split = splits[name] = strategy.model_split(args.dp, tensor_parallel, options)
        layout = f"{split.data_parallel}x{split.tensor_parallel}x{split.pipeline_stages}"
        shown_options = f"  [{', '.join(f'{k}={v}' for k, v in taken.items())}]" if taken else ""
        refusal = strategy.recipe_refusal(recipe)
        if refusal is None and model is not None:
            from harness.project.layouts import shape_refusal

            refusal = shape_refusal(split, model, None) or None
        if refusal:
            refused[name] = refusal
            rows.append(f"{name:<13} {layout:>12} {'-':>11} {'-':>12} {'-':>10} {'-':>10} {'-':>10} {'-':>9} "
                        f"{'-':>19}" + (f" {'-':>11} {'-':>8} {'-':>8} {'-':>10}" if model else "") + shown_options)
            continue
        plan = strategy.model_state_plan(split.data_parallel, recipe, options)
        vocabulary_split = bool(options.get("loss_parallel"))
        held = (model.held_by_rank(split.tensor_parallel, split.pipeline_stages, vocabulary_split)
                if model is not None else split.evenly_held(parameters))
        states = plan_bytes(plan, held)
        per_parameter = "+".join(f"{getattr(plan, c).bytes_per_parameter:g}" for c in ("weights", "gradients",
                                                                                        "optimizer"))
        # DeepSpeed divides the sharded states by num_nodes x num_gpus_per_node: all --dp GPUs, so the estimate is
        # for the same cluster as the columns beside it.
        estimate = (strategy.deepspeed_estimate_bytes(parameters, largest_layer, gpus_per_node, nodes, options)
                    if use_deepspeed else None)
        if estimate is None:
            no_estimate.append(name)
        shown = f"{estimate / gib:>19.3f}" if estimate is not None else f"{'-':>19}"
        row = (f"{name:<13} {layout:>12} {per_parameter:>11} {states['weights'] / gib:>12.3f} "
               f"{states['gradients'] / gib:>10.3f} {states['optimizer'] / gib:>10.3f} "
               f"{states['total'] / gib:>10.3f} {states['host'] / gib:>9.3f} {shown}")
        if model is not None:
            terms = layout_memory(model=model, strategy=name, options=taken, split=split, recipe=recipe.value,
                                  micro_batch=args.micro_batch, micro_batches=args.micro_batches,
                                  checkpointed=options.get("activation_checkpointing", "none") not in ("none", None),
                                  facts=REGISTRY_FACTS, vocabulary_split=vocabulary_split)
            row += (f" {terms.activations / gib:>11.3f} {terms.logits / gib:>8.3f} {terms.working_total / gib:>8.3f} "
                    f"{terms.total / gib:>10.3f}")
        rows.append(row + shown_options)

    described_as = model.describe() if model is not None else f"{parameters:,} parameters"
    print(f"memory per rank, {described_as}, recipe {args.recipe}: each strategy's own bytes per parameter and "
          f"sharding (Rajbhandari et al. 2020, sec. 5.1)")
    print(f"layout dp x tp x pp: --dp {args.dp} data-parallel replicas, each a group of tp x pp ranks (GPUs = "
          f"dp x tp x pp); a rank holds 1/(tp x pp) of the parameters, and its strategy's plan shards their "
          f"states over the dp replicas or not")
    print(f"{'strategy':<13} {'dp x tp x pp':>12} {'bytes w+g+o':>11} {'weights GiB':>12} {'grads GiB':>10} "
          f"{'optim GiB':>10} {'states GiB':>10} {'host GiB':>9} {'DeepSpeed est. GiB':>19}"
          + (f" {'activations':>11} {'logits':>8} {'working':>8} {'GPU total':>10}" if model else ""))
    for row in rows:
        print(row)
    for degree in sorted({split.tensor_parallel for split in splits.values()} - {1}):
        names = [name for name, split in splits.items() if split.tensor_parallel == degree]
        default = "" if "tp" in given else " (the tp option's default; --option tp=N sets it)"
        if model is not None:
            print(f"tp={degree}{default}, {', '.join(names)}: each block's split layers divided {degree} ways, its "
                  f"norms and row-parallel biases, the embeddings and the head whole on every tp rank "
                  f"({model.held_by_rank(degree):,.0f} a rank before any data-parallel sharding; tp with "
                  "loss_parallel=true splits the vocabulary matrices too)")
        else:
            print(f"tp={degree}{default}, {', '.join(names)}: every parameter counted as split {degree} ways "
                  f"({parameters / degree:,.0f} a rank before any data-parallel sharding); a model's embeddings, "
                  f"layer norms and row-parallel biases stay whole on every tp rank and would add (1 - 1/{degree}) x "
                  f"their parameters x the bytes a parameter: --model or --shape counts them")
    for name, split in splits.items():
        if split.data_parallel != args.dp:
            print(f"{name}: one group of {split.ranks} ranks whatever --dp says: it has no data-parallel replicas")
    for stages in sorted({split.pipeline_stages for split in splits.values()} - {1}):
        names = [name for name, split in splits.items() if split.pipeline_stages == stages]
        default = "" if "stages" in given else " (the stages option's default; --option stages=N sets it)"
        print(f"stages={stages}{default}, {', '.join(names)}: the layers cut into {stages} stages, each counted as "
              f"holding 1/{stages} of the parameters; a stage that holds a tied weight's copy holds more")
    if model is not None:
        print(f"activations, logits: at micro-batch {args.micro_batch} of {model.seq_len} tokens, "
              f"{args.micro_batches} micro-batch(es) a step (harness.derive.activations: the family's block and the "
              f"workloads' loss); working: the strategy's buckets, gathered parameters and accumulated gradients; "
              f"GPU total: every term on the busiest GPU, the allowance included ({ALLOWANCE_TEXT}), as "
              "`harness plan` counts it")
    if use_deepspeed:
        print(f"DeepSpeed est.: its estimate_zero{{2,3}}_model_states_mem_needs, with the offload options given, for "
              f"{args.dp} GPUs ({nodes} node(s) x {gpus_per_node} GPUs), largest layer {largest_layer:,} parameters")
        if recipe not in (PrecisionRecipe.DEEPSPEED_BF16, PrecisionRecipe.DEEPSPEED_FP16):
            # DeepSpeed's functions know one recipe: 16-bit weights and gradients with fp32 master weights and
            # Adam moments (2 + 2 + 12 bytes a parameter). Beside another recipe's columns they differ by the
            # recipe, not by the sharding.
            print(f"  it counts 16-bit weights and gradients with fp32 master copies and moments (2 + 2 + 12 bytes "
                  f"a parameter), not recipe {args.recipe}'s: compare it with --recipe deepspeed-bf16")
    if refused or no_estimate:
        print("'-', why:")
    for name, refusal in refused.items():
        print(f"  {name}: {refusal}")
    if no_estimate:
        why = ("--no-deepspeed" if args.no_deepspeed else "deepspeed is not installed here" if not use_deepspeed
               else "DeepSpeed's estimator has functions for ZeRO-2 and ZeRO-3 of a whole model alone")
        print(f"  DeepSpeed est. of {', '.join(no_estimate)}: {why}")
    return 0


def command_comm(args: argparse.Namespace) -> int:
    from harness import commbench

    collectives = args.collectives or commbench.COLLECTIVES
    unknown = [c for c in collectives if c not in commbench.COLLECTIVES]
    if unknown:
        raise SpecError(f"unknown collective {unknown[0]!r}; known: {', '.join(commbench.COLLECTIVES)}")
    if args.world_size < 2:
        raise SpecError(f"--world-size must be >= 2 for a collective benchmark, got {args.world_size}")
    if args.warmup < 0 or args.iters < 1:
        raise SpecError(f"--warmup must be >= 0 and --iters >= 1, got {args.warmup} and {args.iters}")
    try:
        commbench.sizes_between(args.min_bytes, args.max_bytes)
        if args.group_size:
            commbench.groups_of(args.world_size, args.group_size, args.group_layout)
    except ValueError as error:
        raise SpecError(str(error)) from None
    machine = Machine.detect(args.device)
    device = machine.device
    check_comm_ranks(args.world_size, machine, oversubscribe=args.oversubscribe)
    emulated = EmulatedNetwork.planned(args.emulate_link, args.emulate_nodes) if args.emulate_link else None
    if emulated is not None:
        check_emulation(emulated, ())
    out = args.out or Path("results") / f"comm-{datetime.now():%Y%m%d-%H%M%S}.jsonl"
    check_results_file(out, "--out" if args.out else "results file")
    print(f"parbench: collective benchmark at world size {args.world_size} on {device.value} -> {out}",
          file=sys.stderr)
    try:
        if emulated is None:
            rows = commbench.run(args.world_size, device.value, collectives, args.min_bytes, args.max_bytes,
                                 args.warmup, args.iters, out, args.timeout, group_size=args.group_size,
                                 group_layout=args.group_layout)
        else:
            from harness.emulate.network import emulated_network

            print(f"parbench: on {emulated.describe()}", file=sys.stderr)
            with emulated_network(emulated):
                rows = commbench.run(args.world_size, device.value, collectives, args.min_bytes, args.max_bytes,
                                     args.warmup, args.iters, out, args.timeout, emulated=emulated,
                                     group_size=args.group_size, group_layout=args.group_layout)
    except commbench.BenchmarkFailed as error:
        print(f"parbench: error: {error}", file=sys.stderr)
        return 1
    print(commbench.format_table(rows))
    print(f"\nrow appended to {out}")
    return 0


def check_comm_ranks(world_size: int, machine: Machine, *, oversubscribe: bool) -> None:
    """On CPU, where every rank of `comm` runs on this machine's cores (an emulated cluster's nodes too): a warning
    where the ranks outnumber them, as `run` warns, and one line refusing more than COMM_RANKS_PER_CORE a core
    unless `oversubscribe`, before anything starts."""
    if machine.device is not DeviceKind.CPU:
        return
    cores = machine.devices_per_node
    if world_size > COMM_RANKS_PER_CORE * cores and not oversubscribe:
        share = f"{world_size / cores:.2f}".rstrip("0").rstrip(".")      # 9 on 2 cores: 4.5, not a rounded 4
        share = share if float(share) * cores == world_size else f"about {share}"
        raise SpecError(f"--world-size {world_size} puts {share} ranks on each of this machine's "
                        f"{cores} cores, over {COMM_RANKS_PER_CORE}: their timings would measure the cores' sharing; "
                        "--oversubscribe runs it anyway")
    if world_size > cores:
        print(f"parbench: warning: {world_size} ranks on this machine's {cores} cores: the collectives' times measure "
              "the cores' sharing, not the link", file=sys.stderr)


def command_project(args: argparse.Namespace) -> int:
    from harness.project.run import projection_from_arguments

    if args.out is not None:
        check_results_file(args.out, "--out")
    print(projection_from_arguments(args))
    return 0


def command_plan(args: argparse.Namespace) -> int:
    """The plan's table, then the `run --dry-run` of the simplest layout among those equivalent within the error, on
    the cluster and overrides given (harness.project.plan)."""
    from harness.project.cluster import load_cluster
    from harness.project.model import described
    from harness.project.plan import (DEFAULT_GLOBAL_BATCH_TOKENS, DEFAULT_RECIPE, Settings, equivalent, format_plan,
                                      plan)

    model = described(args.model, args.params, args.shape, args.seq_len)
    samples = args.global_batch
    if samples is None:
        tokens = args.global_batch_tokens or DEFAULT_GLOBAL_BATCH_TOKENS
        if tokens % model.seq_len:
            raise SpecError(f"--global-batch-tokens {tokens:,} is not a whole number of {model.seq_len}-token samples")
        samples = tokens // model.seq_len
    settings = Settings(global_batch=samples, tokens=float(args.tokens), recipe=args.recipe or DEFAULT_RECIPE,
                        mfu=args.mfu, micro_batch=args.micro_batch,
                        peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12)
    cluster = load_cluster(args.cluster, args.set)
    planned = plan(model, cluster, args.nodes, settings)
    print(format_plan(planned, model, cluster, args.nodes, settings))
    group = equivalent(planned)
    if not group:
        print("\nno layout fits: nothing to run")
        return 0
    chosen = group[0]
    argv, workload = plan_run_arguments(chosen, model, cluster.gpus_per_node, args.nodes, args.cluster, args.set)
    what = (f"{workload} itself" if workload == model.name else
            f"{workload}, the largest of the hybrid matrix's GPU transformers this layout takes (it has none of this "
            f"shape): it checks the launch on the cluster, not this model's step")
    print(f"\nfollowed: {chosen.layout.label}, micro-batch {chosen.micro_batch}, the simplest of the "
          f"{len(group)} equivalent within the error. The run below lays it out on {what}. Its placement uses "
          f"placeholder hosts; give --hostfile (or --slurm, --placement k8s) to run it:")
    print("python -m harness " + " ".join(shlex.quote(part) for part in argv))
    return command_run(build_parser().parse_args(argv))


def plan_run_arguments(chosen: Any, model: Any, gpus_per_node: int, nodes: int, cluster: str,
                       overrides: Sequence[str]) -> tuple[list[str], str]:
    """(`harness run` arguments of the chosen layout as a dry run on `cluster` with `overrides`, the workload it
    runs): the model itself where the hybrid matrix runs it on GPUs, else that matrix's GPU transformer with the
    most parameters whose heads the layout's tensor-parallel degree divides and whose layers its stages do not
    outnumber."""
    from harness.matrix import HYBRID_PLANS
    from workloads import get_workload

    layout = chosen.layout
    split = layout.split

    def takes(name: str) -> bool:
        config = get_workload(name).config
        return config.n_head % split.tensor_parallel == 0 and split.pipeline_stages <= config.n_layer

    if model.name in HYBRID_PLANS[DeviceKind.CUDA]:
        workload = model.name
    else:
        candidates = [name for name in HYBRID_PLANS[DeviceKind.CUDA] if takes(name)]
        if not candidates:
            raise SpecError(f"no GPU transformer of parbench's takes {layout.label}")
        workload = max(candidates, key=lambda name: get_workload(name).published_params or 0)
    argv = ["run", "--matrix", "hybrid", "--workload", workload, "--strategy", layout.strategy,
            "--world-sizes", str(split.ranks), "--global-batch", str(chosen.micro_batch * chosen.micro_batches
                                                                      * split.data_parallel),
            "--micro-batch", str(chosen.micro_batch), "--precision", "fp32" if layout.recipe == "fp32" else "bf16",
            "--device", "cuda", "--gpus-per-node", str(gpus_per_node), "--nnodes", str(nodes), "--cluster", cluster]
    for pair in overrides:
        argv += ["--set", pair]
    for key, value in layout.options:
        if key != "activation_checkpointing" or value != "none":
            argv += ["--option", f"{key}={value}"]
    return argv + ["--dry-run"], workload


def command_report(args: argparse.Namespace) -> int:
    from harness.report import write_report

    for path in args.results:   # an empty report, exit 0, would pass for a run that measured nothing
        if not read_rows([path]) and not read_rows([path], kind=COMMBENCH_KIND):
            raise SpecError(f"{path} holds no cell rows and no `harness comm` rows: nothing to report")
    check_folder(args.out, "--out")
    written = write_report(args.results, args.out)
    for path in written:
        print(path)
    return 0


def command_compare(args: argparse.Namespace) -> int:
    from harness.compare import compare_files, format_result
    from harness.derive.gate import check_metrics, check_thresholds

    if not 0 < args.alpha < 1:
        raise SpecError(f"--alpha must be in (0, 1), got {args.alpha}")
    try:
        thresholds = check_thresholds(dict(args.threshold))
    except ValueError as error:
        raise SpecError(f"--threshold: {error}") from None
    try:
        check_metrics(args.metric)
    except ValueError as error:
        raise SpecError(f"--metric: {error}") from None
    for path in (args.base, args.new):   # "0 metrics judged", exit 0, would pass a run that measured nothing
        if not read_rows([path]):
            raise SpecError(f"{path} holds no cell rows: nothing to compare")
    result = compare_files(args.base, args.new, thresholds, args.alpha, args.metric)
    print(format_result(result, show_all=args.all))
    if result.regressed:
        return 1
    return nothing_judged_status(nothing_judged(result), allow=args.allow_unjudged)


def nothing_judged(result) -> str:
    """Why a gate result judged no metric, with the launches a side that would judge them; "" where it judged one."""
    from harness.derive.gate import Verdict

    if result.judgements and result.count(Verdict.NOT_JUDGED) < len(result.judgements):
        return ""
    launches = sorted({(len(j.base), len(j.new)) for j in result.judgements})
    had = ", ".join(f"{base} v {new}" for base, new in launches) or "none"
    return (f"nothing judged: {len(result.judgements)} metrics with too few launches (had {had}; "
            f"{result.launches_needed_a_side} a side judge this family of {result.family}), "
            f"{len(result.not_compared)} cells not compared (no ok launch, or not in both files)")


def nothing_judged_status(why: str, *, allow: bool) -> int:
    """0 where something was judged; else one line saying why and EXIT_NOTHING_JUDGED (0 where `allow`)."""
    if not why:
        return 0
    status = 0 if allow else EXIT_NOTHING_JUDGED
    print(f"parbench: {why}; exit {status}" + ("" if allow else " (--allow-unjudged: exit 0)"), file=sys.stderr)
    return status


def command_expect(args: argparse.Namespace) -> int:
    from harness.derive.expectations import ExpectationsError, check, dumps, load, record

    rows = []
    for path in args.results:   # "0 figures", exit 0, would pass a run that measured nothing
        found = read_rows([path])
        if not found:
            raise SpecError(f"{path} holds no cell rows: nothing to hold to expectations")
        rows.extend(found)
    try:
        if args.write:
            if args.against.is_dir():
                raise SpecError(f"--against {args.against} is a folder; expected the expectations file (.json)")
            check_folder(args.against.parent, "--against", shown=args.against)
            expectations = record(rows)
            args.against.write_text(dumps(expectations))
            print(f"recorded {len(expectations['cells'])} cells' figures in {args.against}: review the diff")
            return 0
        outcome = check(rows, load(args.against))
    except ExpectationsError as error:
        raise SpecError(str(error)) from None
    update = f"python -m harness expect {' '.join(str(path) for path in args.results)} --against {args.against} --write"
    print("\n".join(outcome.lines(update)))
    return outcome.exit_status

def command_ab(args: argparse.Namespace) -> int:
    from harness import ab
    from harness.environment import PROJECT_ROOT

    if args.matrix not in MATRICES:
        raise SpecError(f"--matrix {args.matrix!r}: known: {', '.join(MATRICES)}")
    out = args.out or Path("results") / f"ab-{datetime.now():%Y%m%d-%H%M%S}"
    try:
        results = ab.measure(PROJECT_ROOT, out, base_ref=args.base, a_a=args.a_a, repeat=args.repeat,
                             min_launches=args.launches, thresholds=dict(args.threshold), plant_new=args.plant_new,
                             matrix=args.matrix, strategies=args.strategy)
    except ab.Unavailable as why:
        print(f"A/B run: {ab.Outcome.SKIPPED.value}: {why}")
        return nothing_judged_status(f"nothing judged: {why}", allow=args.allow_unjudged)
    worst = max(result.exit_status for result in results)
    # A run whose gate judged no metric at all (its base failed to launch, no cell on both sides); one that judged
    # some and left others has its verdict on those.
    empty = [result for result in results if result.gate is None or nothing_judged(result.gate)]
    if worst == 0 and empty:
        return nothing_judged_status(f"nothing judged in {len(empty)} of {len(results)} runs: {empty[0].reason}",
                                     allow=args.allow_unjudged)
    return worst


def command_derive_check(args: argparse.Namespace) -> int:
    from harness.derive_check import command

    return command(args.base, record_only=args.record, sets=args.sets, out=args.out)


def command_reproduce(args: argparse.Namespace) -> int:
    from harness.environment import capture_environment
    from harness.reproduce import environment_differences, find_row, placement_for, same_losses
    from harness.runner import RunOptions, summary_table
    from harness.strategies import checked

    paths = args.results or sorted(Path("results").glob("*.jsonl"))
    found = find_row(args.run_id, paths)
    check_results_file(found.path, "the results file")   # the new row is appended beside the original
    original = found.result
    placement = placement_for(original)
    for line in environment_differences(original.environment, capture_environment()):
        print(f"parbench: warning: {line}", file=sys.stderr)
    print(f"parbench: reproducing {original.spec.label} (run {original.run_id[:12]}) -> {found.path}",
          file=sys.stderr)
    spec = checked(original.spec.replace(repeats=1))    # its strategy and options as this version knows them
    [again] = run_placed([spec], RunOptions(results=found.path, timeout_s=args.timeout, placement=placement))
    print(summary_table([again.to_dict()], results_file=found.path))
    if again.status.value != "ok":
        return 1
    verdict = "identical, bit for bit" if same_losses(original, again) else "different"
    print(f"\nlosses {verdict}; new row {again.run_id[:12]} appended to {found.path}")
    return 0


def command_doctor(args: argparse.Namespace) -> int:
    from harness.doctor import render, report

    findings, status = report(args.matrix, args.device)
    print(render(findings))
    return status


COMMANDS = {"run": command_run, "list": command_list, "doctor": command_doctor, "memory": command_memory, "comm": command_comm,
            "project": command_project, "plan": command_plan, "report": command_report, "compare": command_compare,
            "expect": command_expect, "reproduce": command_reproduce, "ab": command_ab,
            "derive-check": command_derive_check}


def interrupted_outcome(stop: Interrupted) -> str:
    """What a stop signal left: what was stopped, and a row recorded as interrupted only where one was."""
    recorded = f"; recorded as interrupted: {'; '.join(stop.recorded)}" if stop.recorded else ""
    return f"what was running is stopped and cleaned up{recorded}; rows already written are kept"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        with raising_on_stop_signals():      # SIGINT, SIGTERM, SIGHUP: stop what runs, clean up, exit 128 + signal
            return COMMANDS[args.command](args)
    except Interrupted as stop:
        print(f"parbench: {stop.name}: {interrupted_outcome(stop)}; exit {stop.exit_status}", file=sys.stderr)
        return stop.exit_status
    except (SpecError, ResultsError) as error:
        print(f"parbench: error: {error}", file=sys.stderr)
        return 2
    except AppendError as error:   # not bad input: the results file's disk or file system failed
        print(f"parbench: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("parbench: interrupted; rows of finished cells are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
