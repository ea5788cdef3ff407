"""The Kubernetes objects of one launch, as plain dicts, and their YAML: the pieces harness.launch.placement.k8s
puts together. Pure: nothing here reads the run's flags, a cluster or the disk.

    python -m harness run --matrix scaling --dry-run --device cuda --gpus-per-node 8 --nnodes 4 \\
        --placement k8s --out k8s/scaling

Every pod of a launch runs the image with the same volumes: the launch's ConfigMap (the cell's spec.json and,
for DeepSpeed, its hostfile) read-only at LAUNCH_MOUNT, the results claim at RESULTS_MOUNT, and /dev/shm as a
memory-backed emptyDir (a container's default 64 MB /dev/shm is too small for NCCL and data loader workers).
Each pod that runs ranks asks for its node's GPUs (`nvidia.com/gpu`), or on CPU for a core per rank thread.

Each node runs `bash -c` of `node_script`: the launcher's argv under `timeout`, its output kept in the cell
folder on the claim, and on node 0 afterwards the launch's row recorded there (harness.launch.record_launch),
in node 0's pod or, where that pod runs no rank (an MPIJob's Launcher), in one that does.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Mapping, Sequence

import yaml

from harness.launch.placement.slurm import shell_words
from harness.launch.plan import SPEC_FILE
from harness.rank.worker import ERROR_FILE, MEASUREMENTS_FILE

RESULTS_MOUNT = PurePosixPath("/parbench/results")   # the results claim: cell folders and rows
LAUNCH_MOUNT = PurePosixPath("/parbench/launch")     # the launch's ConfigMap: spec.json, DeepSpeed's hostfile
IMAGE_WORKDIR = PurePosixPath("/parbench")           # the Dockerfile's WORKDIR, where a pod's script starts
GPU_RESOURCE = "nvidia.com/gpu"                      # NVIDIA's device plugin's resource name
LOG_FILE = "log.txt"                                 # harness.launch.cell's: node 0's launcher output
KILL_AFTER_S = 30            # `timeout` sends SIGTERM at the launch's limit, SIGKILL this much later
# A job's deadline counts from its creation, while the launch's own limit starts only when a pod's script runs:
# this much more lets the pods be scheduled (waiting for free GPUs: no gang scheduling is asked for), pull the
# image (several GB, the first time on each node), wait for each other and record the row; a launch stuck
# longer (pods Pending for ever) ends as the job's failure instead of holding the namespace.
START_UP_S = 1800

# Kubeflow's API versions and kinds, and the names their operators require (training-operator v1.9:
# pkg/webhooks/pytorch requires a container "pytorch"; an MPIJob's launcher sets up container 0, "mpi" by
# default; Trainer v2's torch-distributed runtime names its replicated job and container "node").
KUBEFLOW_V1 = "kubeflow.org/v1"
TRAINER_V1ALPHA1 = "trainer.kubeflow.org/v1alpha1"
PYTORCH_CONTAINER, MPI_CONTAINER, TRAINER_NODE, JOB_CONTAINER = "pytorch", "mpi", "node", "parbench"
# TrainJobs run on parbench's copy of Trainer's torch-distributed runtime (cluster_training_runtime), which a
# dry run writes to this file in its folder, for a cluster admin to apply once.
TRAINER_RUNTIME = "parbench-torch-distributed"
RUNTIME_FILE = f"runtime-{TRAINER_RUNTIME}.yaml"
# Trainer's label on a runtime's replicated job that says which step it is; "trainer" gets the TrainJob's trainer.
TRAINER_STEP_LABEL, TRAINER_STEP = "trainer.kubeflow.org/trainjob-ancestor-step", "trainer"
# Who owns the TrainJob's runtime patch: Trainer's webhook wants a domain-prefixed path.
PATCH_MANAGER = "parbench/placement-k8s"
# A benchmark must not restart behind our back: a restarted launch would be measured as one.
NEVER = "Never"


@dataclass(frozen=True, kw_only=True)
class PodSettings:
    """What every pod of one launch shares."""

    image: str
    labels: Mapping[str, str]
    environment: Mapping[str, str]      # plain values; POD_IP is added from the downward API
    config_map: str                     # the launch's ConfigMap, mounted at LAUNCH_MOUNT
    results_claim: str                  # the PersistentVolumeClaim mounted at RESULTS_MOUNT
    shm_size: str                       # sizeLimit of /dev/shm, a quantity such as 16Gi
    gpus: int | None                    # GPUs a pod that runs ranks asks for; None on CPU
    cpus: int                           # cores a pod that runs ranks asks for


def env_list(environment: Mapping[str, str]) -> list[dict[str, Any]]:
    """The container's env: the harness's settings, and the pod's own address (torchrun's --local-addr)."""
    return [*({"name": name, "value": value} for name, value in sorted(environment.items())),
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def resources(settings: PodSettings, runs_ranks: bool) -> dict[str, Any]:
    """Quantities as strings, as the core API's clients declare them (the server takes numbers too)."""
    if not runs_ranks:   # an MPIJob's launcher only starts horovodrun
        return {"requests": {"cpu": "1"}}
    asked: dict[str, Any] = {"requests": {"cpu": str(settings.cpus)}}
    if settings.gpus is not None:
        asked["limits"] = {GPU_RESOURCE: str(settings.gpus)}
    return asked


def volumes(settings: PodSettings) -> list[dict[str, Any]]:
    return [{"name": "launch", "configMap": {"name": settings.config_map}},
            {"name": "results", "persistentVolumeClaim": {"claimName": settings.results_claim}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}}]


def volume_mounts() -> list[dict[str, Any]]:
    return [{"name": "launch", "mountPath": str(LAUNCH_MOUNT), "readOnly": True},
            {"name": "results", "mountPath": str(RESULTS_MOUNT)},
            {"name": "shm", "mountPath": "/dev/shm"}]


def container(name: str, command: Sequence[str], settings: PodSettings, runs_ranks: bool = True) -> dict[str, Any]:
    return {"name": name, "image": settings.image, "command": list(command), "env": env_list(settings.environment),
            "resources": resources(settings, runs_ranks), "volumeMounts": volume_mounts()}


def pod_template(settings: PodSettings, main: dict[str, Any], restart_policy: str | None = None) -> dict[str, Any]:
    """A pod template with one container. Kubeflow's kinds take the restart policy from the replica spec (and
    warn where a template sets one), so only a batch Job's template sets it."""
    spec: dict[str, Any] = {"containers": [main], "volumes": volumes(settings)}
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    return {"metadata": {"labels": dict(settings.labels)}, "spec": spec}


def node_script(*, cell: PurePosixPath, node: str, launch: Sequence[str], variables: Sequence[str],
                repeat: int, timeout_s: float, placement: str, prelude: Sequence[str] = (),
                spec_file: PurePosixPath = LAUNCH_MOUNT / SPEC_FILE, record_through: str = "",
                workdir: PurePosixPath = IMAGE_WORKDIR) -> str:
    """What one pod runs (`bash -c`): `launch`, the launcher's argv in which only `variables` expand, under
    `timeout`, its output in the cell folder on the claim. `node` is the pod's node rank, "0" or a variable
    the operator sets. Node 0 also puts the cell's spec.json in the cell folder and clears an earlier
    launch's outcome before it starts, and records the row after it (harness.launch.record_launch).
    `spec_file`: where the pod finds the cell's spec.json (its ConfigMap's). `record_through`: shell words of a
    command that runs its last argument, a shell line, in another pod, where node 0 records the row (in
    `workdir` there) instead of in its own; "" records it here."""
    limit = math.ceil(timeout_s)
    stale = " ".join(f'"$cell"/{name}' for name in (MEASUREMENTS_FILE, ERROR_FILE.format(rank="*")))
    return "\n".join([
        "set -u",
        f"node={shell_words([node], variables)}",
        f"cell={shlex.quote(str(cell))}",
        *prelude,
        f"launch=({shell_words(list(launch), variables)})",
        'mkdir -p "$cell"',
        'if [ "$node" = 0 ]; then',
        f'    cp {shlex.quote(str(spec_file))} "$cell"/{SPEC_FILE}',
        f"    rm -f {stale}",
        f'    log="$cell"/{LOG_FILE}',
        "else",
        '    log="$cell"/log-node"$node".txt',
        "fi",
        # The first line of log.txt is the command, as harness.launch.processes writes it (`resume` reads it).
        "printf '$ %s\\n' " '"${launch[*]@Q}" > "$log"',
        "SECONDS=0",
        f'timeout --kill-after={KILL_AFTER_S} {limit} "${{launch[@]}}" 2>&1 | tee -a "$log"',
        "status=${PIPESTATUS[0]}",
        'if [ "$node" = 0 ]; then',
        f'    record=(python -m harness.launch.record_launch --cell "$cell" --repeat {repeat} --exit-status "$status"',
        f'            --wall-s "$SECONDS" --timeout-s {limit} --placement {placement} -- "${{launch[@]}}")',
        # Quoted by bash's @Q, in single quotes, which the other pod's `sh -c` reads back word for word.
        (f'    {record_through} {shlex.quote(f"cd {workdir} && ")}"${{record[*]@Q}}" \\' if record_through
         else '    "${record[@]}" \\'),
        """        || echo "parbench: the launch's row was not recorded in $cell" >&2""",
        "fi",
        'exit "$status"',
    ]) + "\n"


def config_map(name: str, namespace: str, labels: Mapping[str, str], files: Mapping[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)}, "data": dict(files)}


def metadata(name: str, namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": dict(labels)}


def active_deadline(timeout_s: float) -> int:
    """activeDeadlineSeconds of the job of a launch whose limit is `timeout_s`."""
    return math.ceil(timeout_s) + START_UP_S


def run_policy(deadline_s: int) -> dict[str, Any]:
    """Kubeflow v1's run policy: no retry, a deadline, and pods still running when the job ends (an MPIJob's
    idle workers, a straggling node) are removed; finished pods stay for their logs."""
    return {"backoffLimit": 0, "cleanPodPolicy": "Running", "activeDeadlineSeconds": deadline_s}


def replica(count: int, template: dict[str, Any]) -> dict[str, Any]:
    return {"replicas": count, "restartPolicy": NEVER, "template": template}


def pytorch_job(name: str, namespace: str, labels: Mapping[str, str], ranks_per_node: int,
                master: dict[str, Any], worker: dict[str, Any] | None, workers: int, deadline_s: int) -> dict[str, Any]:
    """Kubeflow's PyTorchJob: a Master (node 0, which serves the rendezvous at $MASTER_ADDR:$MASTER_PORT) and
    `workers` Workers; the operator tells every pod PET_NNODES, PET_NPROC_PER_NODE and PET_NODE_RANK."""
    replicas = {"Master": replica(1, master)}
    if workers:
        replicas["Worker"] = replica(workers, worker)
    return {"apiVersion": KUBEFLOW_V1, "kind": "PyTorchJob", "metadata": metadata(name, namespace, labels),
            "spec": {"nprocPerNode": str(ranks_per_node), "runPolicy": run_policy(deadline_s),
                     "pytorchReplicaSpecs": replicas}}


def mpi_job(name: str, namespace: str, labels: Mapping[str, str], slots: int, launcher: dict[str, Any],
            worker: dict[str, Any], workers: int, deadline_s: int) -> dict[str, Any]:
    """training-operator's MPIJob (kubeflow.org/v1): the Launcher pod runs horovodrun, which reaches the
    Worker pods through the operator's /etc/mpi/kubexec.sh (`kubectl exec`; Horovod uses it when the operator
    sets OMPI_MCA_plm_rsh_agent to it), hosts from the operator's /etc/mpi/hostfile (`POD slots=N`)."""
    return {"apiVersion": KUBEFLOW_V1, "kind": "MPIJob", "metadata": metadata(name, namespace, labels),
            "spec": {"slotsPerWorker": slots, "runPolicy": run_policy(deadline_s),
                     "mpiReplicaSpecs": {"Launcher": replica(1, launcher), "Worker": replica(workers, worker)}}}


def batch_job(name: str, namespace: str, labels: Mapping[str, str], template: dict[str, Any],
              deadline_s: int) -> dict[str, Any]:
    """A single-process cell needs no operator: a batch Job of one pod, never retried."""
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata(name, namespace, labels),
            "spec": {"backoffLimit": 0, "activeDeadlineSeconds": deadline_s, "completions": 1, "parallelism": 1,
                     "template": template}}


def train_job(name: str, namespace: str, labels: Mapping[str, str], settings: PodSettings, command: Sequence[str],
              nodes: int, ranks_per_node: int, deadline_s: int) -> dict[str, Any]:
    """Kubeflow Trainer v2's TrainJob on parbench's runtime, which tells each node PET_NNODES,
    PET_NPROC_PER_NODE, PET_NODE_RANK and PET_MASTER_ADDR/PORT. The trainer takes the image, command, env
    and resources; the volumes are a runtime patch of the runtime's "node" job (its webhook refuses env
    there for the node container, so env stays on the trainer)."""
    patch = {"metadata": {"labels": dict(labels)},
             "spec": {"volumes": volumes(settings),
                      "containers": [{"name": TRAINER_NODE, "volumeMounts": volume_mounts()}]}}
    return {"apiVersion": TRAINER_V1ALPHA1, "kind": "TrainJob", "metadata": metadata(name, namespace, labels),
            "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                    "name": TRAINER_RUNTIME},
                     "activeDeadlineSeconds": deadline_s,    # Trainer >= v2.2, counted from the TrainJob's creation
                     "trainer": {"image": settings.image, "command": list(command), "numNodes": nodes,
                                 "numProcPerNode": ranks_per_node, "env": env_list(settings.environment),
                                 "resourcesPerNode": resources(settings, runs_ranks=True)},
                     "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
                         "replicatedJobs": [{"name": TRAINER_NODE, "template": {"spec": {"template": patch}}}]}}}}]}}


def cluster_training_runtime(image: str) -> dict[str, Any]:
    """Trainer v2.3.0's torch-distributed runtime (manifests/base/runtimes/torch_distributed.yaml) under parbench's
    name, with what a benchmark needs and a TrainJob cannot patch in: backoffLimit 0 on the node job (a Job's
    default is 6 retries) and restartPolicy Never on its pods (JobSet's webhook makes it OnFailure where the
    runtime says nothing). Without them a failed or timed-out node runs again in place, and node 0's second run
    clears the launch's outcome, rewrites log.txt and records a second row. The image is a placeholder: each
    TrainJob's trainer names its own."""
    pod = {"spec": {"restartPolicy": NEVER, "containers": [{"name": TRAINER_NODE, "image": image}]}}
    node = {"name": TRAINER_NODE, "replicas": 1,    # Trainer's webhook: a trainer step is one Job
            "template": {"metadata": {"labels": {TRAINER_STEP_LABEL: TRAINER_STEP}},
                         "spec": {"backoffLimit": 0, "template": pod}}}
    return {"apiVersion": TRAINER_V1ALPHA1, "kind": "ClusterTrainingRuntime",
            "metadata": {"name": TRAINER_RUNTIME, "labels": {"trainer.kubeflow.org/framework": "torch",
                                                             "app.kubernetes.io/name": "parbench"}},
            "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {"replicatedJobs": [node]}}}}


def dns_label(text: str, limit: int = 63) -> str:
    """`text` as an RFC 1123 label: lower case letters, digits and '-', at most `limit` long, no '-' at
    either end."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower())
    return re.sub(r"-{2,}", "-", label)[:limit].strip("-")


# libyaml's emitter where PyYAML was built with it (as k8s_check.LOADER reads them): the pure-Python one took 18 of a
# k8s dry run's 20 s on the scaling matrix at 4 nodes, for the same text.
_BASE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _Dumper(_BASE_DUMPER):
    """Block style, keys in the order built, and a multi-line string (a pod's script) as a literal block."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def dump(documents: Sequence[Mapping[str, Any]]) -> str:
    """The documents as one multi-document YAML file, for `kubectl create -f`."""
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def spec_file_text(spec_dict: Mapping[str, Any]) -> str:
    """spec.json as harness.launch.cell writes it."""
    return json.dumps(spec_dict, indent=1)
