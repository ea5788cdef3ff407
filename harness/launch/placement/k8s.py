"""Kubernetes through Kubeflow: a dry run writes every launch as a manifest for `kubectl create -f`; parbench
itself submits nothing and reaches no cluster.

    python -m harness run --matrix scaling --dry-run --device cuda --gpus-per-node 8 --nnodes 4 \\
        --placement k8s --out k8s/scaling [--k8s-image REGISTRY/parbench:TAG] [--k8s-job trainjob]

Each cell's launcher runs as it does on a hostfile's hosts, in the image (the repository's Dockerfile), one
pod per node:

- torchrun (DDP, FSDP2): a PyTorchJob (kubeflow.org/v1), Master (node 0, serving the c10d rendezvous at the
  operator's $MASTER_ADDR:$MASTER_PORT) and nnodes - 1 Workers; with `--k8s-job trainjob`, a Trainer v2
  TrainJob instead, on parbench's copy of Trainer's torch-distributed runtime, which never restarts a node
  (written once to the folder, runtime-parbench-torch-distributed.yaml, for a cluster admin to apply; rendezvous
  at $PET_MASTER_ADDR:$PET_MASTER_PORT, node 0 hosting it: IS_HOST);
- DeepSpeed's launcher (ZeRO, pipeline): a PyTorchJob whose every pod runs `deepspeed --no_ssh` with the
  operator's $PET_NODE_RANK as its node rank and the cell's hostfile from the launch's ConfigMap;
- horovodrun (Horovod): an MPIJob (training-operator's kubeflow.org/v1), horovodrun on its Launcher pod, hosts
  from the operator's /etc/mpi/hostfile, reaching nnodes Worker pods through the operator's kubexec.sh once
  each answers it; the row is recorded on the first Worker, where the ranks' GPUs are;
- python (plain, DataParallel): a batch Job of one pod.

DeepSpeed, Horovod and single-process cells keep those kinds under `--k8s-job trainjob`. A cell's repeats are
separate launches, a manifest each, named as its cell folder. What the pods share (volumes, GPUs, the script
each node runs) is harness.launch.k8s_manifest's; the offline checks are harness.launch.k8s_check's.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Sequence

from harness.launch import k8s_manifest as k8s
from harness.launch.launcher import Node, Nodes
from harness.launch.placement.base import HOSTFILE, Placement, hostfile_text
from harness.launch.plan import (CELL_TOKEN_ENV, FORWARDED_PREFIXES, SPEC_FILE, LaunchPlan, LaunchRequest,
                                 launcher_of, threads_per_rank, worker_program)
from harness.spec import DeviceKind, RunSpec


class JobKind(StrEnum):
    """What a torchrun cell becomes (`--k8s-job`)."""

    PYTORCHJOB = "pytorchjob"    # training-operator v1's PyTorchJob
    TRAINJOB = "trainjob"        # Kubeflow Trainer v2's TrainJob


DEFAULT_IMAGE = "parbench:latest"      # the Dockerfile's image, `docker build -t parbench .`
HOSTS = "PARBENCH_HOSTS"               # horovodrun's -H, made from the MPI operator's hostfile
IS_HOST = "IS_HOST"                    # a TrainJob's node: "true" on node 0, which serves the rendezvous
# A TrainJob's nodes share one template, so each works out whether it hosts the c10d store from its node rank.
# Left to torchrun, it would compare $PET_MASTER_ADDR (<job>-node-0-0.<job>, a headless service's name) with
# its host name and FQDN, which that name matches on neither, and fall back to resolving it: where that lookup
# fails, no node hosts the store and every node waits for it until the rendezvous times out.
IS_HOST_PRELUDE = f'{IS_HOST}=$([ "$PET_NODE_RANK" = 0 ] && echo true || echo false)'
MPI_HOSTFILE = "/etc/mpi/hostfile"     # training-operator's MPIJob writes `POD slots=N` lines there
MPI_KUBEXEC = "/etc/mpi/kubexec.sh"    # and `kubexec.sh POD WORDS...` runs `sh -c "WORDS..."` in that pod
# The operator starts the Launcher as soon as it has made the Workers, ready or not (training-operator v1.9 has
# no readiness gate), and Horovod gives up after trying each host 5 times back to back ("could not connect to
# some hosts"). So the Launcher first waits for every host to answer, as long as a Worker may take to be
# scheduled and pull the image: within START_UP_S, which still bounds a launch whose Workers never come.
WORKER_WAIT_S = 600
# The row is recorded on the first Worker: its environment is the ranks' (GPUs, CPU, node), where the
# Launcher's is a pod without GPUs (the operator sets its NVIDIA_VISIBLE_DEVICES to "") that may run on any
# node, and the row's hardware is part of its cell's identity (harness.derive.identity), so a row taken there
# would never group with the DDP and ZeRO rows of the same GPUs. The Launcher keeps its exit status, wall time
# and limit, which it passes.
FIRST_WORKER = f"first_worker=$(head -n 1 {MPI_HOSTFILE} | cut -d' ' -f1)"
RECORD_ON_WORKER = f'{MPI_KUBEXEC} "$first_worker"'
# The pod's variables a launcher's argv may name, left for the pod's shell to expand (PyTorchJob: MASTER_*,
# PET_NODE_RANK; TrainJob: PET_*; POD_IP from the downward API; the scripts' own HOSTS and IS_HOST).
POD_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT", "POD_IP",
                 HOSTS, IS_HOST)
# Launchers Trainer's torch-distributed runtime is made for: it hands torchrun its PET_* settings.
TRAINJOB_LAUNCHERS = ("torchrun",)
# A job's name: its pods and services add "-worker-N", "-launcher", "-node-0-N" and must stay DNS labels (63).
NAME_LIMIT = 40
# Settings of this host a pod gets: the harness's and the libraries' knobs, not this host's paths, Python or
# device numbering, which are the image's and the pod's own.
POD_FORWARDED = tuple(prefix for prefix in FORWARDED_PREFIXES if prefix not in ("CUDA_", "PYTHON", "LD_LIBRARY_PATH",
                                                                                "PATH"))
# Of those, the ones that choose this host's network devices: a pod has its own interfaces (eth0 on most pod
# networks) and HCAs, and NCCL, Gloo or Horovod told to use one it lacks fails or falls back unseen.
HOST_DEVICE_SETTINGS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "HOROVOD_GLOO_IFACE")
# And the ones that name this host's files (TORCH_HOME, TORCH_EXTENSIONS_DIR, NCCL_DEBUG_FILE, NCCL_TOPO_FILE,
# HOROVOD_TIMELINE, ...): by a name that says so, or by a value that is a path.
PATH_NAME_ENDINGS = ("_HOME", "_DIR", "_PATH", "_FILE", "_ROOT")
PATH_VALUE_STARTS = ("/", "~", "./", "../")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


@dataclass(frozen=True, kw_only=True)
class KubernetesPlacement(Placement):
    name = "k8s"
    nnodes: int = 1
    manifests: Path = Path("k8s")              # the folder a dry run writes each launch's manifest to
    image: str = DEFAULT_IMAGE
    namespace: str = "default"
    results_claim: str = "parbench-results"    # a PersistentVolumeClaim every pod mounts at RESULTS_MOUNT
    job: JobKind = JobKind.PYTORCHJOB
    shm_size: str = "16Gi"                     # /dev/shm's sizeLimit (memory-backed: counts as the pod's memory)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "job", JobKind(self.job))
        except ValueError:
            raise ValueError(f"--k8s-job {self.job!r} is not one of: {', '.join(JobKind)}") from None
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"--k8s-image {self.image!r} is not an image reference")
        if not DNS_LABEL.fullmatch(self.namespace):
            raise ValueError(f"--k8s-namespace {self.namespace!r} is not a namespace name (lower case letters, "
                             "digits and '-', at most 63)")
        if not (DNS_SUBDOMAIN.fullmatch(self.results_claim) and len(self.results_claim) <= 253):
            raise ValueError(f"--k8s-results-claim {self.results_claim!r} is not a claim name (lower case letters, "
                             "digits, '-' and '.')")
        if not QUANTITY.fullmatch(self.shm_size):
            raise ValueError(f"--k8s-shm {self.shm_size!r} is not a quantity such as 16Gi")

    def describe(self) -> str:
        torchrun = (f"TrainJobs (runtime {k8s.TRAINER_RUNTIME})" if self.job is JobKind.TRAINJOB
                    else "PyTorchJobs")
        return (f"Kubernetes: each launch a manifest in {self.manifests} for `kubectl create -f`, submitted by you, "
                f"not by parbench: torchrun cells as {torchrun}, DeepSpeed's as PyTorchJobs, horovodrun's as "
                f"MPIJobs, single-process cells as batch Jobs; image {self.image}, namespace {self.namespace}, cell "
                f"folders and rows on claim {self.results_claim} at {k8s.RESULTS_MOUNT}")

    def rendezvous_port(self, spec: RunSpec) -> str:
        return "$MASTER_PORT"     # the operator's; a TrainJob's is $PET_MASTER_PORT (plan)

    def planned_port(self) -> str:
        return "$MASTER_PORT"

    def results_file(self) -> Path:
        """The run's results file in the pods, which names the cell folders on the claim (a manifest folder
        k8s/scaling puts them in /parbench/results/scaling-cells/)."""
        return Path(k8s.RESULTS_MOUNT) / f"{self.manifests.resolve().name or 'k8s'}.jsonl"

    def makes_trainjob(self, spec: RunSpec) -> bool:
        launcher = launcher_of(spec)
        return (self.job is JobKind.TRAINJOB and launcher.spans_nodes and not launcher.reaches_nodes
                and launcher.name in TRAINJOB_LAUNCHERS)

    def shared_files(self, specs: Sequence[RunSpec]) -> list[tuple[Path, str]]:
        """What the run's launches share, written once to the folder beside their manifests: the runtime its
        TrainJobs run on, if it has any."""
        if not any(self.makes_trainjob(spec) for spec in specs):
            return []
        return [(self.manifests / k8s.RUNTIME_FILE, k8s.dump([k8s.cluster_training_runtime(self.image)]))]

    def plan(self, request: LaunchRequest) -> LaunchPlan:
        spec, launcher, cell_dir = request.spec, request.launcher, request.cell_dir
        job = job_name(spec, cell_dir.name)
        repeat = int(cell_dir.name.rsplit("-r", 1)[1])
        labels = launch_labels(spec, job, repeat)
        own = pod_environment(os.environ)
        # The launch's marker names its job: in a pod there is no process of another launch to tell apart.
        environment = {**own, **request.environment, CELL_TOKEN_ENV: job}
        threads = threads_per_rank(spec)
        settings = k8s.PodSettings(image=self.image, labels=labels, environment=environment,
                                   config_map=f"{job}-launch", results_claim=self.results_claim,
                                   shm_size=self.shm_size, cpus=spec.ranks_per_node * threads,
                                   gpus=spec.ranks_per_node if spec.device is DeviceKind.CUDA else None)
        files = {SPEC_FILE: k8s.spec_file_text(spec.to_dict())}
        deadline = k8s.active_deadline(request.timeout_s)
        program = worker_program(cell_dir, Path(k8s.LAUNCH_MOUNT / SPEC_FILE))

        def script(nodes: Nodes, node: Node, prelude: Sequence[str] = (), record_through: str = "") -> list[str]:
            argv = in_image(launcher.argv(nodes, node))
            return ["bash", "-c", k8s.node_script(cell=PurePosixPath(cell_dir), node=node.rank, launch=argv,
                                                  variables=POD_VARIABLES, repeat=repeat, timeout_s=request.timeout_s,
                                                  placement=self.name, prelude=prelude, record_through=record_through)]

        hostfile = str(k8s.LAUNCH_MOUNT / HOSTFILE)
        workload: dict[str, Any]
        if not launcher.spans_nodes:
            nodes = Nodes(spec=spec, program=program, first_host="127.0.0.1", port="", host_slots="",
                          hostfile=hostfile, timeout_s=request.timeout_s, options=request.options)
            main = k8s.container(k8s.JOB_CONTAINER, script(nodes, Node("0")), settings)
            workload = k8s.batch_job(job, self.namespace, labels, k8s.pod_template(settings, main, k8s.NEVER),
                                     deadline)
        elif launcher.reaches_nodes:
            nodes = Nodes(spec=spec, program=program, first_host="", port="", host_slots=f"${HOSTS}",
                          hostfile=hostfile, timeout_s=request.timeout_s, options=request.options)
            hosts = f'export {HOSTS}="$(sed "s/ slots=/:/" {MPI_HOSTFILE} | paste -sd, -)"'
            prelude = [*wait_for_workers(), hosts, FIRST_WORKER]
            start = k8s.container(k8s.MPI_CONTAINER, script(nodes, Node("0"), prelude, RECORD_ON_WORKER), settings,
                                  runs_ranks=False)
            # Workers idle until horovodrun starts their ranks through `kubectl exec`.
            idle = k8s.container(k8s.MPI_CONTAINER, ["sleep", "infinity"], settings)
            workload = k8s.mpi_job(job, self.namespace, labels, spec.ranks_per_node, k8s.pod_template(settings, start),
                                   k8s.pod_template(settings, idle), spec.nnodes, deadline)
        elif self.makes_trainjob(spec):
            nodes = Nodes(spec=spec, program=program, first_host="$PET_MASTER_ADDR", port="$PET_MASTER_PORT",
                          host_slots="", hostfile=hostfile, timeout_s=request.timeout_s, options=request.options)
            command = script(nodes, Node("$PET_NODE_RANK", "$POD_IP", f"${IS_HOST}"), [IS_HOST_PRELUDE])
            workload = k8s.train_job(job, self.namespace, labels, settings, command, spec.nnodes, spec.ranks_per_node,
                                     deadline)
        else:
            nodes = Nodes(spec=spec, program=program, first_host="$MASTER_ADDR", port="$MASTER_PORT", host_slots="",
                          hostfile=hostfile, timeout_s=request.timeout_s, options=request.options)
            master = k8s.container(k8s.PYTORCH_CONTAINER, script(nodes, Node("0", "$POD_IP", True)), settings)
            worker = k8s.container(k8s.PYTORCH_CONTAINER, script(nodes, Node("$PET_NODE_RANK", "$POD_IP", False)),
                                   settings)
            if launcher.uses_hostfile:   # in node rank order: the Master is 0, Worker i is i + 1
                pods = [f"{job}-master-0", *(f"{job}-worker-{index}" for index in range(spec.nnodes - 1))]
                files[HOSTFILE] = hostfile_text(pods, spec.ranks_per_node)
            workload = k8s.pytorch_job(job, self.namespace, labels, spec.ranks_per_node,
                                       k8s.pod_template(settings, master), k8s.pod_template(settings, worker),
                                       spec.nnodes - 1, deadline)
        documents = [k8s.config_map(settings.config_map, self.namespace, labels, files), workload]
        manifest = self.manifests / f"{cell_dir.name}.yaml"
        pods = spec.nnodes + (1 if workload["kind"] == "MPIJob" else 0)
        return LaunchPlan(commands=(("kubectl", "create", "-f", str(manifest)),),
                          targets=(f"the cluster: {workload['kind']} {job} in namespace {self.namespace}, "
                                   f"{pods} pod(s)",),
                          cleanup=(("kubectl", "delete", "--ignore-not-found", "-f", str(manifest)),),
                          cleanup_targets=("the cluster",), files=((manifest, k8s.dump(documents)),))


def job_name(spec: RunSpec, launch_folder: str) -> str:
    """The launch's name in the cluster: strategy, world size and workload for people, then the cell's identity
    and the repeat from its folder's name (harness.launch.cell.launch_dir: <slug>-<identity>-r<repeat>)."""
    _, identity, repeat = launch_folder.rsplit("-", 2)
    tail = f"-{identity[:10]}-{repeat}"
    nodes = f"x{spec.nnodes}" if spec.nnodes > 1 else ""
    head = k8s.dns_label(f"pb-{spec.strategy}-ws{spec.world_size}{nodes}-{spec.workload}", NAME_LIMIT - len(tail))
    return head + tail


def wait_for_workers(limit_s: int = WORKER_WAIT_S) -> list[str]:
    """An MPIJob Launcher's script lines that wait until every host of the operator's hostfile runs a command
    through kubexec.sh, at most `limit_s` (each try at most 30 s: `kubectl exec` may hang), or exit 1 saying so."""
    return [f"deadline=$((SECONDS + {limit_s}))",
            f"for host in $(cut -d' ' -f1 {MPI_HOSTFILE}); do",
            f'    until timeout 30 {MPI_KUBEXEC} "$host" true >/dev/null 2>&1; do',
            '        if [ "$SECONDS" -ge "$deadline" ]; then',
            f'            echo "parbench: Worker $host did not answer {MPI_KUBEXEC} within {limit_s} s;'
            ' horovodrun was not started" >&2',
            "            exit 1",
            "        fi",
            "        sleep 5",
            "    done",
            "done"]


def pod_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """This host's settings a pod gets (POD_FORWARDED), less those that name its network devices or files."""
    return {name: value for name, value in environment.items()
            if name.startswith(POD_FORWARDED) and name not in HOST_DEVICE_SETTINGS
            and not name.endswith(PATH_NAME_ENDINGS) and not value.startswith(PATH_VALUE_STARTS)}


def launch_labels(spec: RunSpec, job: str, repeat: int) -> dict[str, str]:
    """Labels on the job and every pod, for `kubectl get pods -l parbench/launch=NAME` and the like."""
    return {"app.kubernetes.io/name": "parbench", "parbench/launch": job, "parbench/cell": k8s.dns_label(spec.label),
            "parbench/strategy": k8s.dns_label(spec.strategy), "parbench/world-size": str(spec.world_size),
            "parbench/repeat": str(repeat)}


def in_image(argv: Sequence[str]) -> list[str]:
    """A launcher's argv as the image runs it. The launcher names this host's interpreter and console scripts
    by path; the image has its own, first on its PATH (the Dockerfile's venv), so they go by name."""
    words = ["python" if word == sys.executable else word for word in argv]
    if words and os.path.isabs(words[0]):
        words[0] = os.path.basename(words[0])
    return words


def manifests_left_over(folder: Path, written: Sequence[Path]) -> list[Path]:
    """Manifests already in `folder` that this plan does not write (an earlier dry run's): `kubectl create -f
    FOLDER` would submit them too."""
    return sorted(set(folder.glob("*.yaml")) - {Path(path) for path in written}) if folder.is_dir() else []

