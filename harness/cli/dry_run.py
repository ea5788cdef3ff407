"""What `harness run --dry-run` reads from its arguments: the nodes it plans for, the cluster a GPU plan is priced
on, and a Kubernetes dry run's manifests, written to --out; the plan's text is harness.launch.dry_run's.

    python -m harness run --matrix scaling --dry-run --device cuda --gpus-per-node 8 --nnodes 4 --placement k8s \\
        --out k8s/scaling
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness.launch.placement import KubernetesPlacement, Placement
from harness.launch.placement.k8s import manifests_left_over
from harness.machine import Machine
from harness.outputs import check_folder
from harness.spec import DeviceKind, RunSpec, SpecError

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
