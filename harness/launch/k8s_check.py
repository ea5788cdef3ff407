"""Offline checks of the manifests `run --placement k8s --dry-run` writes; no cluster is needed or reached.

    python -m harness.launch.k8s_check k8s/scaling      # every manifest in the folder; exit 1 on a problem

Four checks, each named in the problems it reports:

- kubeflow: a PyTorchJob or MPIJob (kubeflow.org/v1) against the Kubeflow Training SDK's models
  (kubeflow-training). The SDK's own deserialiser ignores fields it does not know and coerces "1" to 1, so the
  walk is ours, over the fields and types its models (and the Kubernetes client's, for pod templates) declare:
  an unknown field or a value of another type is a problem. Then the SDK builds the object, which applies
  its models' own rules (required fields).
- trainer: a TrainJob and the ClusterTrainingRuntime it runs on (trainer.kubeflow.org/v1alpha1) against the
  Kubeflow Trainer API's pydantic models (kubeflow-trainer-api): the same walk for unknown fields (its
  `from_dict` drops them), then `from_dict`, whose strict types reject a value of another type. They reach
  into the runtime's JobSet, its Job templates and their pods.
- kubernetes: every core object (the launch's ConfigMap, a batch Job) and every pod a Kubeflow object makes,
  its template wrapped as a core v1 PodTemplate (a TrainJob's from its trainer and its runtime patch; each of
  the runtime's replicated jobs as a batch Job), against Kubernetes' JSON schemas with unknown fields rejected
  (kubernetes-validate, strict), for KUBERNETES_VERSION. Without the wrapping, kubernetes-validate has no schema
  for Kubeflow's kinds and would pass them unchecked.
- plan: what no schema knows, against the cell's spec.json the manifest carries: each pod that runs ranks asks
  for exactly the cell's ranks per node in GPUs (none on CPU), the replicas add up to the cell's nodes,
  nprocPerNode / slotsPerWorker / numProcPerNode are its ranks per node, nothing restarts, the job has a deadline
  that outlasts the launch's own limit, every pod mounts /dev/shm, the results claim and the launch's ConfigMap,
  names and labels are valid, and the operators' admission rules this code relies on hold (a PyTorchJob's single
  Master and its container "pytorch", a TrainJob's reserved env names and runtime patch). The runtime, which
  carries no cell, is checked for what a benchmark needs of it: its node job's backoffLimit 0, its pods'
  restartPolicy Never, and what Trainer's webhook wants (one replica, a container "node").

Not checked: what only a cluster decides (that the operators, the runtime, the claim, the image and the GPUs
exist; quotas; scheduling), and whether the pods' scripts do what they should when they run.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, Union, get_args, get_origin

import yaml

from harness.launch import k8s_manifest as k8s
from harness.launch.placement.k8s import (FIRST_WORKER, IS_HOST_PRELUDE, NAME_LIMIT, RECORD_ON_WORKER,
                                          TRAINJOB_LAUNCHERS, wait_for_workers)
from harness.launch.plan import SPEC_FILE, launcher_of
from harness.spec import DeviceKind, RunSpec, SpecError

# The API the pod templates are checked against: training-operator v1.9 is built on Kubernetes 1.31's
# (k8s.io/api v0.31); a later cluster accepts what 1.31 does.
KUBERNETES_VERSION = "1.31"
KUBEFLOW, TRAINER, KUBERNETES, PLAN = "kubeflow", "trainer", "kubernetes", "plan"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)    # libyaml's, where PyYAML was built with it: 10x faster
VALIDATORS = "kubeflow-training, kubernetes-validate and kubeflow-trainer-api"
KUBEFLOW_MODELS = {"PyTorchJob": "KubeflowOrgV1PyTorchJob", "MPIJob": "KubeflowOrgV1MPIJob"}
TRAINER_MODELS = {"TrainJob": "TrainerV1alpha1TrainJob",
                  "ClusterTrainingRuntime": "TrainerV1alpha1ClusterTrainingRuntime"}
REPLICAS = {"PyTorchJob": "pytorchReplicaSpecs", "MPIJob": "mpiReplicaSpecs"}
# The Kubernetes client's declared primitive types, and the Python types a value of each may have.
PRIMITIVES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "date": (str,),
              "datetime": (str,), "object": (object,)}
RESERVED_TRAINER_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True)
class Problem:
    check: str      # which check found it: KUBEFLOW, TRAINER, KUBERNETES or PLAN
    where: str      # the object, and the path to the field
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.where}: {self.message}"


class MissingValidators(ImportError):
    """The libraries the schema checks use are not installed (they are the `dev` extra's)."""


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise MissingValidators(f"the offline checks need {VALIDATORS}: pip install -e '.[dev]'") from None


def check_folder(folder: Path) -> dict[Path, list[Problem]]:
    """Every manifest (*.yaml) in `folder`, and the problems of each."""
    return {path: check_manifest(path) for path in sorted(Path(folder).glob("*.yaml"))}


def check_manifest(path: Path) -> list[Problem]:
    try:
        documents = [document for document in yaml.load_all(Path(path).read_text(), Loader=LOADER)
                     if document is not None]
    except yaml.YAMLError as error:
        return [Problem(KUBERNETES, str(path), f"not YAML: {error}")]
    return check_documents(documents)


def check_documents(documents: Sequence[Any]) -> list[Problem]:
    """The problems of one launch's manifest, parsed: every check on every document."""
    problems: list[Problem] = []
    for document in documents:
        if not isinstance(document, dict):
            problems.append(Problem(KUBERNETES, "a document", f"not a Kubernetes object: {_shown(document)}"))
            continue
        kind = document.get("kind")
        if kind in KUBEFLOW_MODELS:
            problems += kubeflow_problems(document)
        elif kind in TRAINER_MODELS:
            problems += trainer_problems(document)
        problems += kubernetes_problems(document)
    return problems + plan_problems(documents)


# ---- kubeflow: the Training SDK's models ----------------------------------------------------------------------


class _Response:
    """What the SDK's ApiClient.deserialize reads: a response's JSON body."""

    def __init__(self, document: Any) -> None:
        self.data = json.dumps(document)


def kubeflow_problems(document: Mapping[str, Any]) -> list[Problem]:
    training = _module("kubeflow.training")
    model = KUBEFLOW_MODELS[document["kind"]]
    name = _name(document)
    problems = [Problem(KUBEFLOW, f"{name}: {path}", message)
                for path, message in _openapi_walk(document, model, training.models, "")]
    try:
        training.ApiClient().deserialize(_Response(document), model)
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        problems.append(Problem(KUBEFLOW, name, f"the SDK cannot build a {model}: {error}"))
    return problems


def _openapi_walk(value: Any, kind: str, models: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, problem) for every field the OpenAPI-generated models (`openapi_types`, `attribute_map`) do not
    declare and every value not of its declared type."""
    if kind.startswith("list["):
        if not isinstance(value, list):
            yield path, f"expected a list, got {_shown(value)}"
            return
        for index, item in enumerate(value):
            yield from _openapi_walk(item, kind[5:-1], models, f"{path}[{index}]")
    elif kind.startswith("dict("):
        if not isinstance(value, dict):
            yield path, f"expected a mapping, got {_shown(value)}"
            return
        inner = re.fullmatch(r"dict\(([^,]*), (.*)\)", kind).group(2)
        for key, item in value.items():
            yield from _openapi_walk(item, inner, models, f"{path}.{key}")
    elif kind in PRIMITIVES:
        allowed = PRIMITIVES[kind]
        # True is an int to Python, not to the API: a bool passes only where bool (or anything) is declared.
        if not isinstance(value, allowed) or (isinstance(value, bool) and not {bool, object} & set(allowed)):
            yield path, f"expected {kind}, got {_shown(value)}"
    else:
        model = getattr(models, kind)
        if not isinstance(value, dict):
            yield path, f"expected a {kind} mapping, got {_shown(value)}"
            return
        fields = {json_name: attribute for attribute, json_name in model.attribute_map.items()}
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key not in fields:
                yield where, f"unknown field: {kind} has no {key!r}"
            else:
                yield from _openapi_walk(item, model.openapi_types[fields[key]], models, where)


# ---- trainer: the Trainer API's pydantic models -------------------------------------------------------------------


def trainer_problems(document: Mapping[str, Any]) -> list[Problem]:
    pydantic = _module("pydantic")
    model = getattr(_module("kubeflow_trainer_api.models"), TRAINER_MODELS[document["kind"]])
    name = _name(document)
    problems = [Problem(TRAINER, f"{name}: {path}", message)
                for path, message in _pydantic_walk(document, model, pydantic.BaseModel, "")]
    try:
        model.from_dict(dict(document))
    except pydantic.ValidationError as error:
        problems += [Problem(TRAINER, f"{name}: {error.title}.{'.'.join(map(str, item['loc']))}", item["msg"])
                     for item in error.errors()]
    except (ValueError, TypeError) as error:     # a oneOf wrapper (a Quantity) reports as a ValueError
        problems.append(Problem(TRAINER, name, str(error).splitlines()[0]))
    return problems


def _pydantic_walk(value: Any, model: type, base: type, path: str) -> Iterator[tuple[str, str]]:
    """(path, problem) for every field the pydantic models do not declare (by their JSON names)."""
    if "actual_instance" in model.model_fields or not isinstance(value, dict):
        return       # a oneOf wrapper (Quantity), or a value of another type: from_dict judges those
    fields = {field.alias or attribute: field.annotation for attribute, field in model.model_fields.items()}
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            yield where, f"unknown field: {model.__name__} has no {key!r}"
        else:
            yield from _annotation_walk(item, fields[key], base, where)


def _annotation_walk(value: Any, annotation: Any, base: type, path: str) -> Iterator[tuple[str, str]]:
    origin, arguments = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        for argument in arguments:
            if argument is not type(None):
                yield from _annotation_walk(value, argument, base, path)
    elif origin is list and isinstance(value, list):
        for index, item in enumerate(value):
            yield from _annotation_walk(item, arguments[0], base, f"{path}[{index}]")
    elif origin is dict and isinstance(value, dict):
        for key, item in value.items():
            yield from _annotation_walk(item, arguments[1], base, f"{path}.{key}")
    elif inspect.isclass(annotation) and issubclass(annotation, base):
        yield from _pydantic_walk(value, annotation, base, path)


# ---- kubernetes: the core schemas, strict --------------------------------------------------------------------------


def kubernetes_problems(document: Mapping[str, Any]) -> list[Problem]:
    jsonschema = _module("jsonschema")
    problems = []
    for where, core in _core_objects(document):
        try:
            validator = core_validator(str(core.get("kind")), str(core.get("apiVersion")))
        except FileNotFoundError:
            problems.append(Problem(KUBERNETES, where, f"no Kubernetes {KUBERNETES_VERSION} schema for kind "
                                    f"{core.get('kind')!r} of {core.get('apiVersion')!r}"))
            continue
        try:
            validator.validate(core)
        except jsonschema.ValidationError as error:
            path = ".".join(map(str, error.path))
            problems.append(Problem(KUBERNETES, f"{where}: {path}" if path else where, error.message))
    return problems


@functools.lru_cache(maxsize=None)
def core_validator(kind: str, api_version: str) -> Any:
    """kubernetes_validate.validate(..., KUBERNETES_VERSION, strict=True)'s validator for one kind, built as it
    builds it (kubernetes_validate/utils.py: the same schema files, registry and Draft 2020-12 validator) but
    once: it parses its 1.3 MB of definitions again at every call, which made a matrix's manifests take half a
    minute to check. FileNotFoundError for a kind it has no schema for."""
    utils = _module("kubernetes_validate.utils")
    jsonschema, referencing = _module("jsonschema"), _module("referencing")
    version = [known for known in utils.all_versions()
               if utils.major_minor(known) <= utils.major_minor(KUBERNETES_VERSION)][-1]
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    schema = utils.schema_contents(f"{folder}/{kind.lower()}-{group}.json", KUBERNETES_VERSION)
    definitions = utils.schema_contents(f"{folder}/_definitions.json", KUBERNETES_VERSION)
    registry = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def _core_objects(document: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, object) to validate: the document itself where it is a core kind, else the pods it makes."""
    kind, name = document.get("kind"), _name(document)
    if kind in REPLICAS:
        replicas = _get(document, "spec", REPLICAS[kind]) or {}
        return [(f"{name}: {role} pod", _pod_template(f"{name}-{role}", _get(replica, "template")))
                for role, replica in (replicas.items() if isinstance(replicas, dict) else [])]
    if kind == "TrainJob":
        return [(f"{name}: node pod (trainer and runtime patch)", _pod_template(name, _trainer_pod(document)))]
    if kind == "ClusterTrainingRuntime":   # each replicated job of its JobSet, and so its pods, as a batch Job
        return [(f"{name}: replicated job {_get(job, 'name')}",
                 {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": str(_get(job, "name")),
                                                                         **(_get(job, "template", "metadata") or {})},
                  "spec": _get(job, "template", "spec")}) for job in _runtime_jobs(document)]
    return [(name, document)]


def _runtime_jobs(document: Mapping[str, Any]) -> list[Any]:
    jobs = _get(document, "spec", "template", "spec", "replicatedJobs")
    return [job for job in jobs if isinstance(job, dict)] if isinstance(jobs, list) else []


def _pod_template(name: str, template: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def _trainer_pod(document: Mapping[str, Any]) -> dict[str, Any]:
    """The pod a TrainJob's node job gets from its trainer and runtime patch, as far as the TrainJob says: the
    runtime's "node" container with the trainer's fields, and the patch's volumes and mounts."""
    trainer = _get(document, "spec", "trainer") or {}
    container = {key: trainer[field] for key, field in (("image", "image"), ("command", "command"), ("args", "args"),
                                                        ("env", "env"), ("resources", "resourcesPerNode"))
                 if isinstance(trainer, dict) and field in trainer}
    spec: dict[str, Any] = {"containers": [{"name": k8s.TRAINER_NODE, **container}]}
    metadata: Any = {}
    for job in _patched_jobs(document):
        metadata = _get(job, "template", "spec", "template", "metadata") or metadata
        pod = _get(job, "template", "spec", "template", "spec") or {}
        if not isinstance(pod, dict):
            continue
        for patch in pod.get("containers") or []:
            if isinstance(patch, dict) and patch.get("name") == k8s.TRAINER_NODE:
                spec["containers"][0].update({key: value for key, value in patch.items() if key != "name"})
        spec.update({key: value for key, value in pod.items() if key != "containers"})
    return {"metadata": metadata, "spec": spec}


def _patched_jobs(document: Mapping[str, Any]) -> list[Any]:
    jobs = []
    for patch in _get(document, "spec", "runtimePatches") or []:
        jobs += _get(patch, "trainingRuntimeSpec", "template", "spec", "replicatedJobs") or []
    return jobs


# ---- plan: what no schema knows ---------------------------------------------------------------------------------


def plan_problems(documents: Sequence[Any]) -> list[Problem]:
    """The manifest against the cell it carries (its ConfigMap's spec.json); the TrainJobs' runtime, which
    carries none, against what a benchmark needs of it."""
    if len(documents) == 1 and _get(documents[0], "kind") == "ClusterTrainingRuntime":
        return runtime_plan_problems(documents[0])
    maps = [d for d in documents if isinstance(d, dict) and d.get("kind") == "ConfigMap"]
    workloads = [d for d in documents if isinstance(d, dict) and d.get("kind") != "ConfigMap"]
    if len(maps) != 1 or len(workloads) != 1:
        return [Problem(PLAN, "the manifest", f"expected the launch's ConfigMap and one job, got {len(maps)} "
                        f"ConfigMap(s) and {len(workloads)} other document(s)")]
    config, workload = maps[0], workloads[0]
    try:
        spec = RunSpec.from_dict(json.loads(_get(config, "data", SPEC_FILE)))
    except (TypeError, ValueError, KeyError, AttributeError, SpecError) as error:
        return [Problem(PLAN, f"{_name(config)}: data.{SPEC_FILE}", f"not the cell's spec: {error}")]
    name, problems = _name(workload), []

    def problem(where: str, message: str) -> None:
        problems.append(Problem(PLAN, f"{name}: {where}" if where else name, message))

    launcher = launcher_of(spec)
    kinds = (("Job",) if not launcher.spans_nodes else ("MPIJob",) if launcher.reaches_nodes
             else ("PyTorchJob", "TrainJob") if launcher.name in TRAINJOB_LAUNCHERS else ("PyTorchJob",))
    kind, k = workload.get("kind"), spec.ranks_per_node
    if kind not in kinds:
        problem("kind", f"a {launcher.name} cell runs as {' or '.join(kinds)}, not {kind}")
        return problems
    checks = {"Job": _job_plan, "PyTorchJob": _pytorch_plan, "MPIJob": _mpi_plan, "TrainJob": _trainer_plan}
    for where, container in checks[kind](workload, spec, problem):
        limits = _get(container, "resources", "limits") or {}
        gpus = limits.get(k8s.GPU_RESOURCE) if isinstance(limits, dict) else None
        if spec.device is DeviceKind.CUDA and not _equals(gpus, k):
            problem(f"{where}.resources.limits", f"asks for {gpus} {k8s.GPU_RESOURCE}; the cell runs {k} rank(s) on "
                    "each node, a GPU each")
        if spec.device is DeviceKind.CPU and gpus is not None:
            problem(f"{where}.resources.limits", f"asks for {gpus} {k8s.GPU_RESOURCE} for a CPU cell")
    for where, template in _templates(workload):
        _volume_plan(f"{where}.spec", _get(template, "spec") or {}, _get(config, "metadata", "name"), problem)
    if launcher.name == "torchrun":
        _is_host_plan(workload, problem)
    _deadline_plan(workload, problem)
    _name_plan(workload, problem)
    for document in (config, workload):
        if _get(document, "metadata", "namespace") != _get(workload, "metadata", "namespace"):
            problem("metadata.namespace", "the ConfigMap and the job are in different namespaces")
    return problems


def _job_plan(job: Mapping[str, Any], spec: RunSpec, problem: Any) -> list[tuple[str, Any]]:
    if spec.nnodes != 1:
        problem("spec", f"a single-process cell runs on 1 node, this one plans {spec.nnodes}")
    for field, expected in (("backoffLimit", 0), ("completions", 1), ("parallelism", 1)):
        if _get(job, "spec", field) != expected:
            problem(f"spec.{field}", f"must be {expected}, is {_get(job, 'spec', field)!r}")
    if _get(job, "spec", "template", "spec", "restartPolicy") != k8s.NEVER:
        problem("spec.template.spec.restartPolicy", "must be Never: a benchmark must not restart unseen")
    return _containers("spec.template", _get(job, "spec", "template"))


def _replicas(job: Mapping[str, Any], problem: Any) -> dict[str, Any]:
    field = REPLICAS[job["kind"]]
    replicas = _get(job, "spec", field)
    if not isinstance(replicas, dict):
        problem(f"spec.{field}", "missing")
        return {}
    for role, replica in replicas.items():
        if _get(replica, "restartPolicy") != k8s.NEVER:
            problem(f"spec.{field}.{role}.restartPolicy", "must be Never: a benchmark must not restart unseen")
    if _get(job, "spec", "runPolicy", "backoffLimit") != 0:
        problem("spec.runPolicy.backoffLimit", "must be 0: a failed launch is a row, not a retry")
    return replicas


def _pytorch_plan(job: Mapping[str, Any], spec: RunSpec, problem: Any) -> list[tuple[str, Any]]:
    replicas = _replicas(job, problem)
    counts = {role: _get(replica, "replicas") for role, replica in replicas.items()}
    if set(counts) - {"Master", "Worker"}:
        problem("spec.pytorchReplicaSpecs", f"roles are Master and Worker, not {sorted(set(counts))}")
    if counts.get("Master") != 1:   # the operator's webhook: exactly one Master
        problem("spec.pytorchReplicaSpecs.Master.replicas", f"must be 1, is {counts.get('Master')!r}")
    total = sum(count for count in counts.values() if isinstance(count, int) and not isinstance(count, bool))
    if total != spec.nnodes:
        problem("spec.pytorchReplicaSpecs", f"{total} pod(s) in all; the cell runs on {spec.nnodes} node(s)")
    if _get(job, "spec", "nprocPerNode") != str(spec.ranks_per_node):
        problem("spec.nprocPerNode", f"is {_get(job, 'spec', 'nprocPerNode')!r}; the cell runs "
                f"{spec.ranks_per_node} rank(s) on each node")
    found = []
    for role, replica in replicas.items():
        containers = _containers(f"spec.pytorchReplicaSpecs.{role}.template", _get(replica, "template"))
        if not any(_get(container, "name") == k8s.PYTORCH_CONTAINER for _, container in containers):
            problem(f"spec.pytorchReplicaSpecs.{role}", f"the operator needs a container named {k8s.PYTORCH_CONTAINER}")
        found += containers
    return found


def _mpi_plan(job: Mapping[str, Any], spec: RunSpec, problem: Any) -> list[tuple[str, Any]]:
    replicas = _replicas(job, problem)
    if _get(replicas, "Launcher", "replicas") != 1:
        problem("spec.mpiReplicaSpecs.Launcher.replicas", "must be 1")
    if _get(replicas, "Worker", "replicas") != spec.nnodes:
        problem("spec.mpiReplicaSpecs.Worker.replicas", f"is {_get(replicas, 'Worker', 'replicas')!r}; the cell "
                f"runs on {spec.nnodes} node(s), a Worker each")
    if _get(job, "spec", "slotsPerWorker") != spec.ranks_per_node:
        problem("spec.slotsPerWorker", f"is {_get(job, 'spec', 'slotsPerWorker')!r}; the cell runs "
                f"{spec.ranks_per_node} rank(s) on each node")
    launcher = _get(replicas, "Launcher", "template")
    for where, container in _containers("spec.mpiReplicaSpecs.Launcher.template", launcher):
        if k8s.GPU_RESOURCE in (_get(container, "resources", "limits") or {}):
            # The operator lists a launcher that asks for GPUs in the hostfile, as a host for ranks.
            problem(f"{where}.resources.limits", "the Launcher runs no rank and must ask for no GPU")
        if where.endswith("containers[0]"):   # the one the operator sets up, which runs horovodrun
            _launcher_script_plan(f"{where}.command", _script(container), problem)
    return _containers("spec.mpiReplicaSpecs.Worker.template", _get(replicas, "Worker", "template"))


def runtime_plan_problems(runtime: Mapping[str, Any]) -> list[Problem]:
    """parbench's runtime (harness.launch.k8s_manifest.cluster_training_runtime): a node job that Trainer's
    webhook takes and that never runs a node twice."""
    name, problems = _name(runtime), []

    def problem(where: str, message: str) -> None:
        problems.append(Problem(PLAN, f"{name}: {where}", message))

    if _get(runtime, "metadata", "name") != k8s.TRAINER_RUNTIME:
        problem("metadata.name", f"the TrainJobs name {k8s.TRAINER_RUNTIME}")
    if not isinstance(_get(runtime, "spec", "mlPolicy", "torch"), dict):
        problem("spec.mlPolicy.torch", "missing: the torch plugin hands torchrun its PET_* settings")
    jobs = [job for job in _runtime_jobs(runtime) if _get(job, "name") == k8s.TRAINER_NODE]
    if len(jobs) != 1:
        problem("spec.template.spec.replicatedJobs", f"needs one job named {k8s.TRAINER_NODE!r}")
    for job in jobs:
        where = f"spec.template.spec.replicatedJobs[{k8s.TRAINER_NODE}]"
        if _get(job, "template", "metadata", "labels", k8s.TRAINER_STEP_LABEL) != k8s.TRAINER_STEP:
            problem(f"{where}.template.metadata.labels", f"{k8s.TRAINER_STEP_LABEL} must be {k8s.TRAINER_STEP}: "
                    "the job the TrainJob's trainer fills in")
        if _get(job, "replicas") != 1:   # Trainer's webhook
            problem(f"{where}.replicas", f"must be 1, is {_get(job, 'replicas')!r}")
        if _get(job, "template", "spec", "backoffLimit") != 0:
            problem(f"{where}.template.spec.backoffLimit", "must be 0: a Job's default, 6, re-runs a failed node, "
                    "whose node 0 then clears the launch's outcome and records it again")
        pod = _get(job, "template", "spec", "template", "spec")
        if _get(pod, "restartPolicy") != k8s.NEVER:
            problem(f"{where}.template.spec.template.spec.restartPolicy", "must be Never: JobSet makes it OnFailure, "
                    "which restarts a failed node in place")
        if not any(_get(container, "name") == k8s.TRAINER_NODE for container in _get(pod, "containers") or []):
            problem(f"{where}.template.spec.template.spec.containers", f"needs the container {k8s.TRAINER_NODE!r} "
                    "(Trainer's webhook)")
    return problems


def _launcher_script_plan(where: str, script: str, problem: Any) -> None:
    """An MPIJob Launcher waits for every Worker before horovodrun tries them, and records the row on the first
    Worker, whose environment is the ranks' (harness.launch.placement.k8s)."""
    lines = script.splitlines()
    start = next((index for index, line in enumerate(lines) if line.startswith("launch=(")), len(lines))
    wait = wait_for_workers()
    if not any(lines[index:index + len(wait)] == wait for index in range(start)):
        problem(where, "the Launcher must wait until every host of the hostfile answers kubexec.sh before "
                "horovodrun starts: Horovod tries each 5 times at once and gives up")
    if FIRST_WORKER not in lines[:start] or not any(
            line.strip().startswith(RECORD_ON_WORKER) and "${record[*]@Q}" in line for line in lines[start:]):
        problem(where, "the Launcher must record the row on the first Worker (kubexec.sh): its own pod has no GPU "
                "and would give the row another cell's hardware")


def _trainer_plan(job: Mapping[str, Any], spec: RunSpec, problem: Any) -> list[tuple[str, Any]]:
    trainer = _get(job, "spec", "trainer") or {}
    if (_get(job, "spec", "runtimeRef", "name"), _get(job, "spec", "runtimeRef", "kind")) != (
            k8s.TRAINER_RUNTIME, "ClusterTrainingRuntime"):
        problem("spec.runtimeRef", f"must name the ClusterTrainingRuntime {k8s.TRAINER_RUNTIME}, which never "
                "restarts a node (Trainer's torch-distributed does)")
    for field, expected in (("numNodes", spec.nnodes), ("numProcPerNode", spec.ranks_per_node)):
        if _get(trainer, field) != expected:
            problem(f"spec.trainer.{field}", f"is {_get(trainer, field)!r}; the cell's is {expected}")
    reserved = [_get(env, "name") for env in _get(trainer, "env") or [] if _get(env, "name") in RESERVED_TRAINER_ENV]
    if reserved:   # the torch plugin's webhook refuses them: the runtime sets them
        problem("spec.trainer.env", f"must not set {', '.join(reserved)}")
    for index, patch in enumerate(_get(job, "spec", "runtimePatches") or []):
        manager = str(_get(patch, "manager"))
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/\S+", manager):   # the webhook: a domain-prefixed path
            problem(f"spec.runtimePatches[{index}].manager", f"{manager!r} is not a domain-prefixed path")
    for job_patch in _patched_jobs(job):
        for container in _get(job_patch, "template", "spec", "template", "spec", "containers") or []:
            if _get(container, "env"):   # the webhook: the node container's env comes from the trainer alone
                problem("spec.runtimePatches", "a container patch of the node job must not set env")
    return [("spec.trainer", {"resources": _get(trainer, "resourcesPerNode")})]


def _containers(where: str, template: Any) -> list[tuple[str, Any]]:
    containers = _get(template, "spec", "containers")
    return [(f"{where}.spec.containers[{index}]", container)
            for index, container in enumerate(containers if isinstance(containers, list) else [])]


def _templates(workload: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(where, pod template) of each pod the job makes; a TrainJob's as its trainer and patch make it."""
    kind = workload.get("kind")
    if kind in REPLICAS:
        replicas = _get(workload, "spec", REPLICAS[kind])
        return [(f"spec.{REPLICAS[kind]}.{role}.template", _get(replica, "template") or {})
                for role, replica in (replicas.items() if isinstance(replicas, dict) else [])]
    if kind == "TrainJob":
        return [("spec.runtimePatches", _trainer_pod(workload))]
    return [("spec.template", _get(workload, "spec", "template") or {})]


def _volume_plan(where: str, pod: Any, config_map: str, problem: Any) -> None:
    """Every pod's container mounts /dev/shm (memory), the results claim and the launch's ConfigMap."""
    volumes = {_get(volume, "name"): volume for volume in _get(pod, "volumes") or [] if isinstance(volume, dict)}
    for container in _get(pod, "containers") or []:
        mounts = {_get(mount, "mountPath"): _get(mount, "name") for mount in _get(container, "volumeMounts") or []}
        for path, source, expected in (("/dev/shm", ("emptyDir", "medium"), "Memory"),
                                       (str(k8s.RESULTS_MOUNT), ("persistentVolumeClaim", "claimName"), None),
                                       (str(k8s.LAUNCH_MOUNT), ("configMap", "name"), config_map)):
            volume = volumes.get(mounts.get(path))
            value = _get(volume, *source)
            if volume is None or value is None or (expected is not None and value != expected):
                problem(where, f"container {_get(container, 'name')!r} does not mount {path} from "
                        f"{'.'.join(source)}{' ' + expected if expected else ''}")


# Where each kind keeps its deadline.
DEADLINES = {"Job": ("spec", "activeDeadlineSeconds"), "PyTorchJob": ("spec", "runPolicy", "activeDeadlineSeconds"),
             "MPIJob": ("spec", "runPolicy", "activeDeadlineSeconds"), "TrainJob": ("spec", "activeDeadlineSeconds")}
# How a pod's script starts its launcher (harness.launch.k8s_manifest.node_script): its limit, and the grace after it.
LAUNCH_LIMIT = re.compile(r"^timeout --kill-after=([0-9]+) ([0-9]+) ", re.M)


def _deadline_plan(workload: Mapping[str, Any], problem: Any) -> None:
    """A deadline on the job, which ends a launch stuck before its scripts start (pods Pending) and leaves a
    launch that started its whole limit, and the kill after it."""
    path = DEADLINES[workload["kind"]]
    deadline = _get(workload, *path)
    limits = [int(grace) + int(limit) for _, template in _templates(workload)
              for _, container in _containers("", template)
              for grace, limit in LAUNCH_LIMIT.findall(_script(container))]
    if not isinstance(deadline, int) or isinstance(deadline, bool) or deadline <= 0:
        problem(".".join(path), f"must be a number of seconds (a launch stuck before it starts ends there), is "
                f"{deadline!r}")
    elif not limits:
        problem("containers", "no pod runs its launcher under `timeout --kill-after=S LIMIT`")
    elif deadline < max(limits):
        problem(".".join(path), f"is {deadline} s, less than the launch's limit and its kill, {max(limits)} s: the "
                "job would end before the launch does, without its row")


# torchrun's word that says whether its node hosts the c10d store (harness.launch.launcher.torchrun).
IS_HOST_WORD = re.compile(r'--rdzv-conf=is_host=(true|false|"\$IS_HOST")(?=\s|\))')
# What each role of a torchrun cell must say: a PyTorchJob's Master hosts it, its Workers do not, a TrainJob's
# node works it out from its node rank.
IS_HOST_BY_ROLE = {"Master": "true", "Worker": "false"}


def _is_host_plan(workload: Mapping[str, Any], problem: Any) -> None:
    """Every torchrun pod tells torchrun whether it hosts the rendezvous store: left to guess from host names,
    on a pod network it may conclude that no node does."""
    for where, template in _templates(workload):
        role = where.split(".")[2] if workload.get("kind") == "PyTorchJob" else None
        for place, container in _containers(where, template):
            script = _script(container)
            said = IS_HOST_WORD.findall(script)
            expected = IS_HOST_BY_ROLE.get(role, '"$IS_HOST"')
            if said != [expected]:
                problem(f"{place}.command", f"torchrun must be told --rdzv-conf=is_host={expected} once, is told "
                        f"{said or 'nothing'}")
            elif expected == '"$IS_HOST"' and IS_HOST_PRELUDE not in script.splitlines():
                problem(f"{place}.command", f"the script must set IS_HOST from its node rank: {IS_HOST_PRELUDE}")


def _script(container: Any) -> str:
    """The script a pod runs (`bash -c SCRIPT`), or ''."""
    command = _get(container, "command")
    return command[2] if isinstance(command, list) and len(command) == 3 and isinstance(command[2], str) else ""


def _name_plan(workload: Mapping[str, Any], problem: Any) -> None:
    """Names the operators can make their pods' and services' names from (DNS-1035, with room for their
    suffixes), and labels the API server takes."""
    name = _get(workload, "metadata", "name")
    if not (isinstance(name, str) and DNS_1035.fullmatch(name) and len(name) <= NAME_LIMIT):
        problem("metadata.name", f"{name!r} is not a DNS-1035 label of at most {NAME_LIMIT} characters")
    labels = [_get(workload, "metadata", "labels")] + [_get(template, "metadata", "labels")
                                                       for _, template in _templates(workload)]
    for mapping in labels:
        for key, value in (mapping.items() if isinstance(mapping, dict) else []):
            if not (isinstance(value, str) and LABEL_KEY.fullmatch(str(key)) and LABEL_VALUE.fullmatch(value)
                    and len(value) <= 63):
                problem("labels", f"{key}: {value!r} is not a valid label")


def _equals(quantity: Any, count: int) -> bool:
    try:
        return quantity is not None and not isinstance(quantity, bool) and int(str(quantity)) == count
    except ValueError:
        return False


def _get(value: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _name(document: Mapping[str, Any]) -> str:
    return f"{document.get('kind')} {_get(document, 'metadata', 'name')}"


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(arg) for arg in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m harness.launch.k8s_check DIR_OR_MANIFEST...", file=sys.stderr)
        return 2
    checked = {}
    for path in paths:
        checked.update(check_folder(path) if path.is_dir() else {path: check_manifest(path)})
    for path, problems in checked.items():
        for found in problems:
            print(f"{path}: {found}")
    bad = sum(bool(problems) for problems in checked.values())
    print(f"{len(checked)} manifest(s) checked, {bad} with problems", file=sys.stderr)
    return 1 if bad or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
