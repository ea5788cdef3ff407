"""What this machine can run, on one screen, before a long job: the preflight users run first (in the spirit of
DeepSpeed's `ds_report`).

    python -m harness doctor                       # the machine, its versions, launchers and strategies
    python -m harness doctor --matrix reference    # and the matrix's cells: exit 1 where any would be skipped

It reads what a launch would find (GPUs and their memory, torch's CUDA and NCCL against the driver, Horovod's
built collectives and controllers, DeepSpeed's ops that build on first use and the compiler they need, the
launchers) and asks each strategy why it could not run here, as a launch does before it starts
(`Strategy.skip_reason`, the `full` matrix's cells on this machine). It launches nothing.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from harness.machine import Machine
from harness.matrix import EXPERT_PARALLEL, SEQUENCE_PARALLEL_STRATEGIES, Selection, build_matrix
from harness.spec import DeviceKind, RunSpec, SpecError

# The matrix whose cells show what each strategy can do here: every strategy, each at the sizes this machine holds.
STRATEGY_MATRIX = "wide"
EXPERT_MATRIX = "moe"
LAUNCHERS = ("torchrun", "deepspeed", "horovodrun", "mpirun", "srun")


@dataclass(frozen=True)
class Finding:
    """A line of the report: what was looked at, and what was found."""

    topic: str
    text: str


def machine_line(machine: Machine) -> Finding:
    memory = _host_memory_gib()
    host = f"{os.cpu_count() or 1} CPU cores" + (f", {memory:.1f} GiB" if memory else "")
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        return Finding("machine", f"{host}; no CUDA device visible (torch {torch.__version__}, {built})")
    gpus = [torch.cuda.get_device_properties(index) for index in range(torch.cuda.device_count())]
    named = ", ".join(f"{gpu.name} {gpu.total_memory / 2**30:.0f} GiB" for gpu in gpus)
    return Finding("machine", f"{host}; {len(gpus)} GPU(s): {named}")


def versions_line() -> Finding:
    found = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    found += [f"{name} {_version(name) or 'not installed'}" for name in ("deepspeed", "horovod")]
    if torch.version.cuda:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "unread (no GPU)"
        found += [f"CUDA {torch.version.cuda} (torch's build)", f"NCCL {nccl}", f"driver {_driver() or 'not found'}"]
    else:
        found.append("no CUDA or NCCL (torch built without CUDA)")
    return Finding("versions", ", ".join(found))


def horovod_line() -> Finding:
    """Horovod's collectives and controllers as built (a Horovod built without NCCL reduces GPU tensors through
    the host; one without Gloo or MPI has no controller to start its ranks with)."""
    if _version("horovod") is None:
        return Finding("horovod", "not installed: the horovod strategy and its launcher are skipped")
    try:
        import horovod.torch as hvd
    except ImportError as error:
        return Finding("horovod", f"installed but its torch extension does not load ({error}): the horovod strategy "
                                  "is skipped")
    built = {"NCCL": hvd.nccl_built(), "Gloo": hvd.gloo_built(), "MPI": hvd.mpi_built()}
    return Finding("horovod", "built for torch with " + ", ".join(f"{name} {'yes' if on else 'no'}"
                                                                  for name, on in built.items()))


def deepspeed_line() -> Finding:
    """DeepSpeed's ops the strategies use that JIT-build on first use (ZeRO-Offload's CPU Adam), and the compiler and
    ninja that build them."""
    if _version("deepspeed") is None:
        return Finding("deepspeed", "not installed: ZeRO, the pipeline and AutoTP are skipped")
    tools = ", ".join(f"{tool} {shutil.which(tool) or 'not found'}" for tool in ("c++", "ninja"))
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        compatible = CPUAdamBuilder().is_compatible(verbose=False)
    except Exception as error:          # an op builder that fails to import is what the user must hear about
        return Finding("deepspeed", f"its op builders do not load ({error}); {tools}")
    return Finding("deepspeed", f"cpu_adam (ZeRO-Offload) builds on first use: {'compatible' if compatible else 'NOT compatible'}"
                                f" here; {tools}")


def launchers_line() -> Finding:
    return Finding("launchers", ", ".join(f"{name} {_found(name) or 'not found'}" for name in LAUNCHERS))


def strategy_lines(machine: Machine) -> list[Finding]:
    """Which strategies can run here, and why each other cannot: the reason of its first cell in the `full` matrix on
    this machine (the `moe` matrix for those that shard experts, `long-context` for those that split a sequence), where
    none of its cells can run."""
    reasons: dict[str, list[str | None]] = {}
    own = [cell for matrix, strategies in OWN_MATRICES for cell in _own_matrix_cells(machine, matrix, strategies, reasons)]
    for spec in build_matrix(STRATEGY_MATRIX, machine, Selection()) + own:
        reasons.setdefault(spec.strategy, []).append(skip_reason(spec))
    can = [name for name, why in reasons.items() if None in why]
    cannot = {name: next(reason for reason in why if reason) for name, why in reasons.items() if None not in why}
    lines = [Finding("strategies", f"{len(can)} of {len(reasons)} can run here ({machine.device.value}): "
                                   + ", ".join(can))]
    lines += [Finding("", f"{name} cannot: {reason}") for name, reason in cannot.items()]
    return lines


# The strategies whose cells only a matrix of their own plans, and that matrix.
OWN_MATRICES = ((EXPERT_MATRIX, EXPERT_PARALLEL), ("long-context", SEQUENCE_PARALLEL_STRATEGIES))


def _own_matrix_cells(machine: Machine, matrix: str, strategies: tuple[str, ...],
                      reasons: dict[str, list[str | None]]) -> list[RunSpec]:
    """`matrix`'s cells of `strategies`; where it plans none on this machine, its reason for each of them in
    `reasons`."""
    try:
        return [spec for spec in build_matrix(matrix, machine, Selection()) if spec.strategy in strategies]
    except SpecError as error:
        reasons.update({name: [str(error)] for name in strategies})
        return []


def matrix_lines(name: str, machine: Machine) -> tuple[list[Finding], bool]:
    """The matrix's cells on this machine: how many run, the reasons of those that would be skipped; whether all run."""
    cells = build_matrix(name, machine, Selection())
    skipped: dict[str, list[RunSpec]] = {}
    for spec in cells:
        reason = skip_reason(spec)
        if reason:
            skipped.setdefault(reason, []).append(spec)
    count = sum(len(specs) for specs in skipped.values())
    lines = [Finding("matrix", f"{name}: {len(cells) - count} of {len(cells)} cells can run here"
                               + (" (every one)" if not count else f"; {count} would be skipped:"))]
    lines += [Finding("", f"{len(specs)} x {reason} ({', '.join(sorted({s.strategy for s in specs}))})")
              for reason, specs in skipped.items()]
    return lines, not count


def skip_reason(spec: RunSpec) -> str | None:
    from harness.memory_fit import skip_reason

    return skip_reason(spec)


def report(matrix: str | None = None, device: str | None = None) -> tuple[list[Finding], int]:
    """Every finding, and the exit status: 1 where the matrix asked for has a cell that would be skipped here."""
    machine = Machine.detect(device)
    findings = [machine_line(machine), versions_line(), horovod_line(), deepspeed_line(), launchers_line(),
                *strategy_lines(machine)]
    status = 0
    if matrix is not None:
        lines, all_run = matrix_lines(matrix, machine)
        findings += lines
        status = 0 if all_run else 1
    return findings, status


def render(findings: Sequence[Finding]) -> str:
    width = max(len(finding.topic) for finding in findings)
    return "\n".join(f"{finding.topic:<{width}}  {finding.text}" for finding in findings)


def summary() -> str:
    """One line for the start of a run: the machine and the libraries a launch will use."""
    return (f"parbench: on {machine_line(Machine.detect()).text}; "
            f"deepspeed {_version('deepspeed') or 'not installed'}, horovod {_version('horovod') or 'not installed'}"
            " (python -m harness doctor says what can run here)")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _found(name: str) -> str | None:
    beside = Path(sys.executable).parent / name            # the launchers the ranks' installation brings
    return str(beside) if beside.exists() else shutil.which(name)


def _driver() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=30)
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else None


def _host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None
