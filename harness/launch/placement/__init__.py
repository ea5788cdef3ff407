"""Placements, one module each: this host, the hosts of a hostfile, Slurm, Kubernetes. `make_placement` turns
a run's flags into one, checked before anything launches.

    python -m harness run --matrix full --hostfile hosts --nnodes 2
    python -m harness run --matrix full --slurm --nnodes 2 --slurm-args "--partition gpu"
    python -m harness run --matrix scaling --dry-run --nnodes 4       # 4 placeholder hosts, planned only
    python -m harness run --matrix scaling --dry-run --nnodes 4 --placement k8s --out k8s/scaling   # manifests

A cell of world size W over N nodes puts W/N ranks on each when N divides W; a smaller cell (the
single-process references, world size 1) runs on the first node alone.

`--emulate-link RATE` places cells on an emulated cluster on this machine (harness.emulate). `--placement k8s`
writes each launch as a Kubernetes manifest for the user to submit (dry runs only: parbench reaches no cluster).

Adding a placement: a module here with a `Placement` subclass, its line in PLACEMENTS, and how
`make_placement` chooses it (by its own flags, or by name: NAMED).
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Any, Mapping

from harness.emulate.network import EmulatedNetwork
from harness.launch.placement.base import Host, Placement
from harness.launch.placement.emulated import EmulatedPlacement
from harness.launch.placement.hostfile import (DEFAULT_REMOTE_SHELL, HostfilePlacement, check_remote_shell,
                                               read_hostfile)
from harness.launch.placement.k8s import KubernetesPlacement
from harness.launch.placement.local import LocalPlacement
from harness.launch.placement.slurm import SlurmPlacement
from harness.spec import SpecError

PLACEMENTS: dict[str, type[Placement]] = {
    LocalPlacement.name: LocalPlacement,
    HostfilePlacement.name: HostfilePlacement,
    SlurmPlacement.name: SlurmPlacement,
    EmulatedPlacement.name: EmulatedPlacement,
    KubernetesPlacement.name: KubernetesPlacement,
}
# Placements `--placement NAME` chooses; the others follow from their own flags (--hostfile, --slurm, ...).
NAMED = (KubernetesPlacement.name,)


def make_placement(hostfile: Path | None, nnodes: int | None, remote_shell: str | None, slurm: bool,
                   slurm_args: str | None, dry_run: bool = False,
                   emulated: EmulatedNetwork | None = None, named: str | None = None,
                   kubernetes: Mapping[str, Any] | None = None) -> Placement:
    """The placement a `run` asks for, checked before anything launches. A dry run may plan for nodes it
    cannot reach: `--nnodes M` with neither a hostfile nor Slurm plans for M placeholder hosts, and
    `--slurm` needs no sbatch here. `emulated`: the planned emulated cluster (built only when cells run).
    `named`: `--placement NAME`; `kubernetes`: KubernetesPlacement's fields its --k8s-* flags gave."""
    if named is not None:
        if named not in NAMED:
            raise SpecError(f"--placement {named!r}: known: {', '.join(NAMED)}")
        others = [flag for flag, given in (("--hostfile", hostfile), ("--slurm", slurm), ("--slurm-args", slurm_args),
                                           ("--remote-shell", remote_shell), ("--emulate-link", emulated)) if given]
        if others:
            raise SpecError(f"--placement {named} excludes {', '.join(others)}: the cluster chooses the hosts")
        if nnodes is not None and nnodes < 1:
            raise SpecError(f"--nnodes must be >= 1, got {nnodes}")
        if not dry_run:
            raise SpecError("--placement k8s launches nothing itself: parbench writes each launch's manifest with "
                            "--dry-run --out DIR, and you submit them with kubectl (docs/clusters.md)")
        try:
            return PLACEMENTS[named](nnodes=nnodes or 1, **(kubernetes or {}))
        except ValueError as error:
            raise SpecError(str(error)) from None
    if kubernetes:
        raise SpecError("the --k8s-* flags need --placement k8s")
    if emulated is not None:
        if hostfile or slurm or remote_shell or nnodes is not None:
            raise SpecError("--emulate-link runs every node on this machine: it excludes --hostfile, --slurm, "
                            "--remote-shell and --nnodes (say --emulate-nodes N)")
        return PLACEMENTS["emulated"].of(emulated)
    if hostfile and slurm:
        raise SpecError("--hostfile and --slurm exclude each other: Slurm chooses the hosts")
    if (remote_shell or slurm_args) and not (hostfile or slurm):
        raise SpecError("--remote-shell needs --hostfile, and --slurm-args needs --slurm")
    if nnodes is not None and nnodes < 1:
        raise SpecError(f"--nnodes must be >= 1, got {nnodes}")
    if hostfile:
        hosts = read_hostfile(hostfile)
        wanted = nnodes or len(hosts)
        if wanted > len(hosts):
            raise SpecError(f"--nnodes {wanted} but hostfile {hostfile} lists {len(hosts)} host(s)")
        shell = remote_shell or DEFAULT_REMOTE_SHELL
        check_remote_shell(shell)
        return PLACEMENTS["hostfile"](hosts=hosts[:wanted], remote_shell=shell, nnodes=wanted)
    if slurm:
        try:
            extra = tuple(shlex.split(slurm_args or ""))
        except ValueError as error:
            raise SpecError(f"--slurm-args cannot be split into arguments: {error}") from None
        if not dry_run and shutil.which("sbatch") is None:
            raise SpecError("--slurm needs Slurm's sbatch on PATH; it was not found")
        return PLACEMENTS["slurm"](slurm_args=extra, nnodes=nnodes or 1)
    if nnodes and nnodes > 1:
        if dry_run:
            return PLACEMENTS["hostfile"](hosts=tuple(Host(f"host{node}", None) for node in range(nnodes)),
                                          nnodes=nnodes, placeholder=True)
        raise SpecError(f"--nnodes {nnodes} needs --hostfile FILE or --slurm to say where the nodes are")
    return PLACEMENTS["local"]()


__all__ = ["PLACEMENTS", "NAMED", "DEFAULT_REMOTE_SHELL", "EmulatedPlacement", "Host", "HostfilePlacement",
           "KubernetesPlacement", "LocalPlacement", "Placement", "SlurmPlacement", "make_placement", "read_hostfile"]
