"""`--placement k8s`: a dry run writes one Kubernetes manifest per launch, each passes the offline checks
(harness.launch.k8s_check), and an error planted in one is caught by the check that should catch it. No
cluster is reached; the one test that runs a pod's script runs it here, under bash, on a CPU cell."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

from harness.cli import main
from harness.launch import k8s_check
from harness.launch.k8s_check import KUBEFLOW, KUBERNETES, PLAN, TRAINER, check_documents, check_manifest
from harness.launch.dry_run import left_out_on
from harness.launch.k8s_manifest import GPU_RESOURCE, RESULTS_MOUNT, START_UP_S, node_script
from harness.launch.placement.k8s import (FIRST_WORKER, NAME_LIMIT, POD_VARIABLES, RECORD_ON_WORKER,
                                          wait_for_workers)
from harness.launch.record_launch import ROW_FILE, launch_row
from harness.machine import Machine
from harness.matrix import build_matrix
from harness.record import read_results
from harness.spec import DeviceKind, RunSpec, Status

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = "runtime-parbench-torch-distributed.yaml"
SCALING = ["run", "--matrix", "scaling", "--dry-run", "--device", "cuda", "--gpus-per-node", "8", "--nnodes", "4",
           "--placement", "k8s"]


def documents(path: Path) -> list[dict]:
    # libyaml's safe loader where PyYAML has it (k8s_check.LOADER): the pure-Python one took 25 s over the manifests.
    return list(yaml.load_all(path.read_text(), Loader=k8s_check.LOADER))


def launches(folder: Path) -> list[Path]:
    """The launches' manifests in a dry run's folder, without the runtime its TrainJobs share."""
    return sorted(path for path in folder.glob("*.yaml") if path.name != RUNTIME)


def manifest_of(folder: Path, fragment: str) -> list[dict]:
    """The documents of the first manifest (its -r0) whose name holds `fragment`."""
    return documents(sorted(folder.glob(f"*{fragment}*-r0.yaml"))[0])


@pytest.fixture(scope="module")
def scaling(tmp_path_factory) -> tuple[Path, str]:
    """The Done-means command, in-process: (manifest folder, what it printed)."""
    out = tmp_path_factory.mktemp("k8s") / "scaling"
    capture = tmp_path_factory.mktemp("stdout") / "plan.txt"
    with open(capture, "w") as printed:
        stdout, sys.stdout = sys.stdout, printed
        try:
            assert main([*SCALING, "--out", str(out)]) == 0
        finally:
            sys.stdout = stdout
    return out, capture.read_text()


def test_the_scaling_matrix_on_four_8_gpu_nodes_gets_one_manifest_per_launch(scaling):
    out, printed = scaling
    target = Machine(device=DeviceKind.CUDA, devices_per_node=8, nodes=4)
    # The cells these nodes would skip (tensor parallelism across nodes, ...) get no manifest: they are named once.
    specs, left = left_out_on(build_matrix("scaling", target), target)
    launches = sum(spec.repeats for spec in specs)
    manifests = sorted(out.glob("*.yaml"))
    assert left and len(manifests) == launches and sorted(out.iterdir()) == manifests
    assert printed.count("\n  wrote ") == launches and f"{launches} files written" in printed
    assert f"left out: {len(left)} cells the cluster" in printed
    assert all(f"  {reason} (" in printed for _, reason in left)
    names = {document["metadata"]["name"] for path in manifests for document in documents(path)[1:]}
    assert len(names) == launches     # every launch, repeats included, a job of its own


def same_but_repeat(text: str, repeat: int) -> str:
    """A repeat-0 manifest's text as repeat `repeat`'s would read: its names, folders and repeat labels."""
    return (text.replace("-r0", f"-r{repeat}").replace("parbench/repeat: '0'", f"parbench/repeat: '{repeat}'")
            .replace("--repeat 0 ", f"--repeat {repeat} "))


def test_every_manifest_passes_every_offline_check(scaling):
    # Each first repeat's manifest through the checks (the models' deserialising dominates: 26 s for every repeat's);
    # every later repeat's is its first's, but for the repeat in its names, folders and labels.
    out, _ = scaling
    firsts = sorted(out.glob("*-r0.yaml"))
    problems = {path.name: [str(p) for p in check_manifest(path)] for path in firsts}
    assert not {name: found for name, found in problems.items() if found}
    later = sorted(set(out.glob("*.yaml")) - set(firsts))
    assert firsts and later
    for path in later:
        first, repeat = path.name.rsplit("-r", 1)
        expected = same_but_repeat((out / f"{first}-r0.yaml").read_text(), int(repeat.removesuffix(".yaml")))
        assert path.read_text() == expected, path.name


def test_each_launcher_gets_the_kind_it_needs_with_gpus_shm_and_the_results_volume(scaling):
    out, _ = scaling
    kinds = {"_ddp_ws32x4": "PyTorchJob", "_fsdp2_ws16x2": "PyTorchJob", "_zero3_ws32x4": "PyTorchJob",
             "_horovod_ws32x4": "MPIJob", "_plain_ws1": "Job"}
    for fragment, kind in kinds.items():
        config, job = manifest_of(out, fragment)
        assert (config["kind"], job["kind"]) == ("ConfigMap", kind), fragment
        text = yaml.safe_dump(job)
        assert "image: parbench:latest" in text and "claimName: parbench-results" in text
        assert "medium: Memory" in text and "mountPath: /dev/shm" in text
    config, job = manifest_of(out, "_zero3_ws32x4")
    master, worker = (job["spec"]["pytorchReplicaSpecs"][role] for role in ("Master", "Worker"))
    assert (master["replicas"], worker["replicas"], job["spec"]["nprocPerNode"]) == (1, 3, "8")
    for replica in (master, worker):
        container = replica["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"] == {GPU_RESOURCE: "8"} and replica["restartPolicy"] == "Never"
    # DeepSpeed's hostfile lists the pods in node rank order: the Master is 0, Worker i is i + 1.
    assert [line.split()[0].rsplit("-", 2)[1:] for line in config["data"]["hostfile"].splitlines()] == [
        ["master", "0"], ["worker", "0"], ["worker", "1"], ["worker", "2"]]
    _, job = manifest_of(out, "_horovod_ws32x4")
    launcher, worker = (job["spec"]["mpiReplicaSpecs"][role] for role in ("Launcher", "Worker"))
    assert (launcher["replicas"], worker["replicas"], job["spec"]["slotsPerWorker"]) == (1, 4, 8)
    assert "limits" not in launcher["template"]["spec"]["containers"][0]["resources"]


def launch_line(replica_or_trainer: dict) -> str:
    command = replica_or_trainer.get("command") or replica_or_trainer["template"]["spec"]["containers"][0]["command"]
    return next(line for line in command[2].splitlines() if line.startswith("launch=("))


def test_each_node_runs_its_launcher_with_the_operators_rendezvous_and_node_rank(scaling):
    out, _ = scaling
    _, job = manifest_of(out, "_ddp_ws32x4")
    master, worker = (launch_line(job["spec"]["pytorchReplicaSpecs"][role]) for role in ("Master", "Worker"))
    for line in (master, worker):
        assert line.startswith("launch=(torchrun --nnodes=4 --nproc-per-node=8 ")
        assert '--rdzv-endpoint="$MASTER_ADDR":"$MASTER_PORT"' in line and '--local-addr="$POD_IP"' in line
        assert "--spec /parbench/launch/spec.json --out /parbench/results/scaling-cells/" in line
    assert "is_host=true" in master and "is_host=false" in worker
    _, job = manifest_of(out, "_zero2_ws32x4")
    worker = launch_line(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    assert '--node_rank="$PET_NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT"' in worker
    _, job = manifest_of(out, "_horovod_ws32x4")
    script = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"][2]
    assert 'export PARBENCH_HOSTS="$(sed "s/ slots=/:/" /etc/mpi/hostfile | paste -sd, -)"' in script
    assert 'launch=(horovodrun -np 32 -H "$PARBENCH_HOSTS" --gloo ' in script
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] == [
        "sleep", "infinity"]


# ---- planted errors: each caught by the check that should catch it ---------------------------------------------


def caught(documents_: list[dict], check: str, where: str) -> list[str]:
    return [str(p) for p in check_documents(documents_) if p.check == check and where in p.where]


def test_replicas_one_is_caught_by_the_kubeflow_models(scaling):
    planted = manifest_of(scaling[0], "_ddp_ws32x4")
    planted[1]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
    assert caught(planted, KUBEFLOW, "Worker.replicas")


def test_a_misspelt_replica_field_is_caught_by_the_kubeflow_models(scaling):
    planted = manifest_of(scaling[0], "_horovod_ws32x4")
    planted[1]["spec"]["mpiReplicaSpecs"]["Worker"]["restartPolicyy"] = "Never"
    assert caught(planted, KUBEFLOW, "Worker.restartPolicyy")


def test_an_unknown_field_in_a_pod_spec_is_caught_by_the_kubernetes_schema(scaling):
    planted = manifest_of(scaling[0], "_ddp_ws32x4")
    planted[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["hostNetwrk"] = True
    assert caught(planted, KUBERNETES, "Master pod")
    planted = manifest_of(scaling[0], "_plain_ws1")      # a batch Job: validated whole
    planted[1]["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    assert caught(planted, KUBERNETES, "spec.template.spec.containers.0")


def test_a_gpu_count_that_does_not_match_the_plan_is_caught_by_the_plan_check(scaling):
    planted = manifest_of(scaling[0], "_zero3_ws32x4")
    planted[1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"][
        "limits"][GPU_RESOURCE] = "4"
    assert caught(planted, PLAN, "Worker.template.spec.containers[0].resources.limits")
    assert not caught(planted, KUBEFLOW, "") and not caught(planted, KUBERNETES, "")   # no schema can know


def test_replicas_that_do_not_add_up_to_the_cells_nodes_are_caught_by_the_plan_check(scaling):
    planted = manifest_of(scaling[0], "_horovod_ws32x4")
    planted[1]["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 3
    planted[1]["spec"]["slotsPerWorker"] = 4
    assert caught(planted, PLAN, "Worker.replicas") and caught(planted, PLAN, "slotsPerWorker")


def deadline_of(job: dict) -> int | None:
    spec = job["spec"]
    return spec["runPolicy"].get("activeDeadlineSeconds") if "runPolicy" in spec else spec.get("activeDeadlineSeconds")


def test_every_job_has_a_deadline_of_the_launchs_limit_plus_the_start_up_allowance(scaling, trainjobs):
    kinds = set()
    for path in [*scaling[0].glob("*.yaml"), *launches(trainjobs)]:
        _, job = documents(path)
        kinds.add(job["kind"])
        scripts = [k8s_check._script(container) for _, template in k8s_check._templates(job)
                   for container in template["spec"]["containers"]]
        assert any("\ntimeout --kill-after=30 900 " in script for script in scripts)   # run's default --timeout
        assert deadline_of(job) == 900 + START_UP_S, path.name
    assert kinds == {"Job", "PyTorchJob", "MPIJob", "TrainJob"}


@pytest.mark.parametrize("fragment", ["_plain_ws1", "_ddp_ws32x4", "_horovod_ws32x4"])
def test_a_missing_or_short_deadline_is_caught_by_the_plan_check(scaling, fragment):
    planted = manifest_of(scaling[0], fragment)
    policy = planted[1]["spec"].get("runPolicy", planted[1]["spec"])
    del policy["activeDeadlineSeconds"]
    assert caught(planted, PLAN, "activeDeadlineSeconds")
    policy["activeDeadlineSeconds"] = 900     # the launch's own limit, without the kill after it
    assert caught(planted, PLAN, "activeDeadlineSeconds")


def test_the_cached_schema_validator_judges_as_kubernetes_validate_does(scaling):
    import kubernetes_validate

    _, job = manifest_of(scaling[0], "_ddp_ws32x4")
    template = copy.deepcopy(job["spec"]["pytorchReplicaSpecs"]["Master"]["template"])
    template["spec"]["containers"][0]["resources"]["limits"] = ["8"]
    wrapped = k8s_check._pod_template("planted", template)
    with pytest.raises(kubernetes_validate.ValidationError) as library:
        kubernetes_validate.validate(wrapped, k8s_check.KUBERNETES_VERSION, strict=True)
    [ours] = k8s_check.kubernetes_problems(job | {"spec": {"pytorchReplicaSpecs": {"Master": {"template": template}}}})
    assert ours.message == library.value.message and ours.where.endswith(".".join(map(str, library.value.path)))


# ---- the TrainJob variant, and CPU cells -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainjobs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("k8s") / "trainjob"
    assert main([*SCALING, "--workload", "gpt2-small", "--strategy", "plain,ddp,zero2,horovod", "--k8s-job", "trainjob",
                 "--out", str(out)]) == 0
    return out


def test_trainjob_makes_torchrun_cells_trainjobs_and_keeps_the_other_kinds(trainjobs):
    kinds = {path.name.split("_")[1]: documents(path)[1]["kind"] for path in launches(trainjobs)}
    assert kinds == {"plain": "Job", "ddp": "TrainJob", "zero2": "PyTorchJob", "horovod": "MPIJob"}
    assert not [str(p) for path in trainjobs.glob("*.yaml") for p in check_manifest(path)]
    _, job = manifest_of(trainjobs, "_ddp_ws32x4")
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["resourcesPerNode"]["limits"]) == (
        4, 8, {GPU_RESOURCE: "8"})
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "parbench-torch-distributed"}
    assert '--rdzv-endpoint="$PET_MASTER_ADDR":"$PET_MASTER_PORT"' in launch_line(trainer)


def test_trainjobs_run_on_parbenchs_runtime_which_never_restarts_a_node_written_once_beside_them(trainjobs):
    assert sorted(trainjobs.iterdir()) == sorted([*launches(trainjobs), trainjobs / RUNTIME])
    [runtime] = documents(trainjobs / RUNTIME)
    assert (runtime["kind"], runtime["metadata"]["name"]) == ("ClusterTrainingRuntime", "parbench-torch-distributed")
    [node] = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node" and node["template"]["spec"]["backoffLimit"] == 0
    assert node["template"]["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert node["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert check_manifest(trainjobs / RUNTIME) == []


def test_the_runtime_does_not_make_the_same_dry_run_again_refused_and_is_written_only_for_trainjobs(tmp_path):
    out = tmp_path / "k8s"
    smoke = ["run", "--matrix", "smoke", "--device", "cpu", "--nnodes", "2", "--dry-run", "--placement", "k8s",
             "--repeats", "1", "--out", str(out)]
    assert main([*smoke, "--k8s-job", "trainjob"]) == 0 and (out / RUNTIME).exists()
    assert main([*smoke, "--k8s-job", "trainjob"]) == 0      # the same plan again, runtime and all
    assert main([*smoke, "--k8s-job", "trainjob", "--strategy", "plain"]) == 2    # no TrainJob: the runtime is stale
    assert main([*smoke[:-1], str(tmp_path / "other"), "--strategy", "ddp"]) == 0
    assert not (tmp_path / "other" / RUNTIME).exists()       # PyTorchJobs need no runtime


@pytest.mark.parametrize("plant, check, where", [
    (lambda job: job["template"]["spec"].pop("backoffLimit"), PLAN, "template.spec.backoffLimit"),
    (lambda job: job["template"]["spec"]["template"]["spec"].update(restartPolicy="OnFailure"), PLAN,
     "restartPolicy"),
    (lambda job: job["template"]["spec"].update(backofLimit=0), TRAINER, "backofLimit"),
    (lambda job: job["template"]["spec"]["template"]["spec"].update(hostNetwrk=True), KUBERNETES, "replicated job"),
])
def test_an_error_planted_in_the_runtime_is_caught(trainjobs, plant, check, where):
    planted = documents(trainjobs / RUNTIME)
    plant(planted[0]["spec"]["template"]["spec"]["replicatedJobs"][0])
    assert caught(planted, check, where)


def test_a_trainjob_on_trainers_own_runtime_is_caught_by_the_plan_check(trainjobs):
    planted = manifest_of(trainjobs, "_ddp_ws32x4")
    planted[1]["spec"]["runtimeRef"]["name"] = "torch-distributed"
    assert caught(planted, PLAN, "spec.runtimeRef")


def test_each_trainjob_node_tells_torchrun_whether_it_hosts_the_rendezvous_from_its_node_rank(trainjobs):
    _, job = manifest_of(trainjobs, "_ddp_ws32x4")
    assert '--rdzv-conf=is_host="$IS_HOST"' in launch_line(job["spec"]["trainer"])
    assert 'IS_HOST=$([ "$PET_NODE_RANK" = 0 ] && echo true || echo false)' in job["spec"]["trainer"]["command"][2]


@pytest.mark.launch
def test_a_trainjob_nodes_script_says_is_host_true_on_node_0_alone(trainjobs):
    _, job = manifest_of(trainjobs, "_ddp_ws32x4")
    prelude = job["spec"]["trainer"]["command"][2].split("\nlaunch=(", 1)[0]   # what it sets before the launcher
    for rank, is_host in (("0", "true"), ("1", "false"), ("3", "false")):
        ran = subprocess.run(["bash", "-c", prelude + '\necho "$IS_HOST"'], env={"PET_NODE_RANK": rank},
                             capture_output=True, text=True)
        assert ran.stdout == f"{is_host}\n", rank


def test_a_torchrun_pod_that_leaves_is_host_to_torchrun_is_caught_by_the_plan_check(scaling, trainjobs):
    planted = manifest_of(trainjobs, "_ddp_ws32x4")
    command = planted[1]["spec"]["trainer"]["command"]
    command[2] = command[2].replace(' --rdzv-conf=is_host="$IS_HOST"', "")
    assert caught(planted, PLAN, "command")
    planted = manifest_of(scaling[0], "_ddp_ws32x4")
    command = planted[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    command[2] = command[2].replace("is_host=true", "is_host=false")
    assert caught(planted, PLAN, "Master.template.spec.containers[0].command")


def test_a_trainjob_without_a_deadline_is_caught_by_the_plan_check(trainjobs):
    planted = manifest_of(trainjobs, "_ddp_ws32x4")
    del planted[1]["spec"]["activeDeadlineSeconds"]
    assert caught(planted, PLAN, "spec.activeDeadlineSeconds")


def test_a_trainjob_of_a_wrong_type_is_caught_by_the_trainer_models(trainjobs):
    planted = manifest_of(trainjobs, "_ddp_ws32x4")
    planted[1]["spec"]["trainer"]["numNodes"] = "4"
    assert caught(planted, TRAINER, "numNodes")


def test_an_unknown_field_in_a_trainjob_is_caught_by_the_trainer_models_and_in_its_pod_by_the_schema(trainjobs):
    planted = manifest_of(trainjobs, "_ddp_ws32x4")
    planted[1]["spec"]["trainer"]["numNode"] = 4
    assert caught(planted, TRAINER, "spec.trainer.numNode")
    planted = manifest_of(trainjobs, "_ddp_ws32x4")
    patch = planted[1]["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    patch["template"]["spec"]["template"]["spec"]["volumes"][2]["emptyDir"]["sizelimit"] = "16Gi"
    assert caught(planted, KUBERNETES, "node pod")


def test_cpu_cells_ask_for_cores_and_no_gpu(tmp_path):
    out = tmp_path / "cpu"
    assert main(["run", "--matrix", "scaling", "--workload", "gpt-tiny", "--dry-run", "--device", "cpu",
                 "--cpus-per-node", "4", "--nnodes", "2", "--placement", "k8s", "--out", str(out)]) == 0
    manifests = sorted(out.glob("*.yaml"))
    assert manifests and not [str(p) for path in manifests for p in check_manifest(path)]
    assert not [path.name for path in manifests if GPU_RESOURCE in path.read_text()]
    _, job = manifest_of(out, "_ddp_ws8x2")
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "4"}}
    planted = manifest_of(out, "_ddp_ws8x2")
    planted[1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"][
        "limits"] = {GPU_RESOURCE: "4"}
    assert caught(planted, PLAN, "Worker")


def test_this_hosts_interfaces_hcas_and_paths_are_not_forwarded_to_pods(tmp_path, monkeypatch):
    host = {"NCCL_SOCKET_IFNAME": "enp5s0", "GLOO_SOCKET_IFNAME": "enp5s0", "NCCL_IB_HCA": "mlx5_0",
            "HOROVOD_GLOO_IFACE": "enp5s0", "TORCH_HOME": "/home/me/.cache/torch", "TORCH_EXTENSIONS_DIR": "ext",
            "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p", "NCCL_DEBUG": "INFO", "NCCL_ALGO": "Ring"}
    for name, value in host.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "k8s"
    assert main(["run", "--matrix", "smoke", "--device", "cpu", "--dry-run", "--placement", "k8s", "--repeats", "1",
                 "--out", str(out)]) == 0
    for path in out.glob("*.yaml"):
        _, job = documents(path)
        container = k8s_check._templates(job)[0][1]["spec"]["containers"][0]
        env = {item["name"]: item.get("value") for item in container["env"]}
        assert {name: env.get(name) for name in host if name in env} == {"NCCL_DEBUG": "INFO", "NCCL_ALGO": "Ring"}


def test_job_names_are_dns_labels_with_room_for_the_operators_suffixes(scaling):
    for path in scaling[0].glob("*horovod_ws32x4*"):
        name = documents(path)[1]["metadata"]["name"]
        assert len(name) <= NAME_LIMIT and len(f"{name}-launcher") <= 63 and name[0].isalpha()


# ---- refusals --------------------------------------------------------------------------------------------------


def one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("parbench: error: ")
    return lines[0]


def test_without_dry_run_the_placement_refuses_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = one_line(capsys, ["run", "--matrix", "smoke", "--device", "cpu", "--placement", "k8s",
                             "--out", str(tmp_path / "k8s")])
    assert "--dry-run --out DIR" in line and "kubectl" in line and "docs/clusters.md" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("extra, fragment", [
    (["--slurm"], "--placement k8s excludes --slurm"),
    (["--emulate-link", "100mbit"], "--placement k8s excludes --emulate-link"),
    (["--remote-shell", "ssh {host}"], "--placement k8s excludes --remote-shell"),
    (["--k8s-namespace", "Team_A"], "--k8s-namespace 'Team_A' is not a namespace name"),
    (["--k8s-shm", "lots"], "--k8s-shm 'lots' is not a quantity"),
])
def test_contradicting_or_bad_flags_are_refused_in_one_line(tmp_path, capsys, extra, fragment):
    line = one_line(capsys, ["run", "--matrix", "smoke", "--device", "cpu", "--dry-run", "--placement", "k8s",
                             "--out", str(tmp_path / "k8s"), *extra])
    assert fragment in line and not (tmp_path / "k8s").exists()


def test_k8s_flags_without_the_placement_and_a_dry_run_without_a_folder_are_refused(tmp_path, capsys):
    smoke = ["run", "--matrix", "smoke", "--device", "cpu", "--dry-run"]
    assert "the --k8s-* flags need --placement k8s" in one_line(capsys, [*smoke, "--k8s-image", "x"])
    assert "needs --out DIR" in one_line(capsys, [*smoke, "--placement", "k8s"])
    (tmp_path / "file").write_text("")
    assert "is a file, not a folder" in one_line(capsys, [*smoke, "--placement", "k8s", "--out",
                                                          str(tmp_path / "file")])


def test_manifests_an_earlier_dry_run_left_are_refused_not_mixed_in(tmp_path, capsys):
    out = tmp_path / "k8s"
    smoke = ["run", "--matrix", "smoke", "--device", "cpu", "--dry-run", "--placement", "k8s", "--out", str(out)]
    assert main([*smoke, "--repeats", "1"]) == 0
    assert main([*smoke, "--repeats", "1"]) == 0          # the same plan again: the same files, rewritten
    capsys.readouterr()
    assert "holds 1 manifest(s) this plan does not write" in one_line(capsys, [*smoke, "--strategy", "plain",
                                                                                 "--repeats", "1"])


# ---- what a pod does, run here ------------------------------------------------------------------------------


def cpu_spec(**fields) -> RunSpec:
    return RunSpec(workload="gpt-tiny", strategy="plain", world_size=1, global_batch=4, micro_batch=4,
                   warmup_steps=1, timed_steps=1, device=DeviceKind.CPU, **fields)


def run_script(tmp_path: Path, launch: list[str], spec: RunSpec, timeout_s: float,
               **options) -> subprocess.CompletedProcess:
    """A node-0 pod's script, run under bash here: the ConfigMap's spec.json and the claim are folders in
    tmp_path, `python` the interpreter running the tests, imports from this checkout, and the MPI operator's
    /etc/mpi/ is tmp_path/mpi/. `options`: node_script's."""
    spec_file = tmp_path / "launch" / "spec.json"
    spec_file.parent.mkdir()
    spec_file.write_text(json.dumps(spec.to_dict()))
    cell = tmp_path / "results" / "run-cells" / "cell-0123456789ab-r0"
    script = node_script(cell=PurePosixPath(cell), node="0", launch=launch, variables=POD_VARIABLES, repeat=0,
                         timeout_s=timeout_s, placement="k8s", spec_file=PurePosixPath(spec_file), **options)
    script = script.replace("/etc/mpi/", f"{tmp_path}/mpi/")
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                   "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.launch
def test_a_pods_script_runs_its_cell_and_records_the_row_on_the_claim(tmp_path):
    spec = cpu_spec()
    cell = tmp_path / "results" / "run-cells" / "cell-0123456789ab-r0"
    launch = ["python", "-m", "harness.rank.worker", "--spec", str(tmp_path / "launch" / "spec.json"),
              "--out", str(cell)]
    ran = run_script(tmp_path, launch, spec, timeout_s=240)
    assert ran.returncode == 0, ran.stderr[-2000:]
    [row] = read_results([cell / ROW_FILE])
    assert row.status is Status.OK and row.spec == spec and row.environment["placement"] == "k8s"
    assert row.launch_command == launch and row.measurements
    # log.txt's first line is the command as `resume` reads it back (harness.runner: shlex of "$ ...").
    first = (cell / "log.txt").read_text().splitlines()[0]
    assert first.startswith("$ ") and shlex.split(first[2:]) == launch


@pytest.mark.launch
def test_a_pods_launch_that_outlives_its_limit_is_recorded_as_a_timeout(tmp_path):
    cell = tmp_path / "results" / "run-cells" / "cell-0123456789ab-r0"
    ran = run_script(tmp_path, ["sleep", "60"], cpu_spec(), timeout_s=1)
    assert ran.returncode == 124
    [row] = read_results([cell / ROW_FILE])
    assert row.status is Status.TIMEOUT and "no result within 1 s" in row.message


# The MPI operator's kubexec.sh (`kubectl exec POD -- /bin/sh -c "$*"`), here: it runs the line in this
# machine's sh with PARBENCH_POD naming the pod (a PARBENCH_ variable: rows record it), logs each call, and
# makes the Workers named in $LATE answer only from their second try, those in $DOWN never.
KUBEXEC = """#!/bin/sh
pod=$1
shift
echo "$pod" >> "$(dirname "$0")/calls"
tries=$(grep -cx "$pod" "$(dirname "$0")/calls")
case " $DOWN " in *" $pod "*) exit 1 ;; esac
case " $LATE " in *" $pod "*) [ "$tries" -ge 2 ] || exit 1 ;; esac
PARBENCH_POD=$pod exec /bin/sh -c "$*"
"""


def mpi_operator(tmp_path: Path) -> Path:
    """What the operator mounts at /etc/mpi/ on a Launcher: two Workers' hostfile and kubexec.sh."""
    mpi = tmp_path / "mpi"
    mpi.mkdir()
    (mpi / "hostfile").write_text("job-worker-0 slots=1\njob-worker-1 slots=1\n")
    (mpi / "kubexec.sh").write_text(KUBEXEC)
    (mpi / "kubexec.sh").chmod(0o755)
    return mpi


@pytest.mark.launch
def test_an_mpijob_launcher_waits_for_its_workers_and_records_the_row_on_the_first(tmp_path, monkeypatch):
    mpi = mpi_operator(tmp_path)
    monkeypatch.setenv("LATE", "job-worker-1")
    ran = run_script(tmp_path, ["sh", "-c", "exit 3"], cpu_spec(), timeout_s=60,
                     prelude=[*wait_for_workers(), FIRST_WORKER], record_through=RECORD_ON_WORKER,
                     workdir=PurePosixPath(ROOT))
    assert ran.returncode == 3, ran.stderr[-2000:]
    # Each Worker answered before the launch (job-worker-1 at its second try), then the row was taken on worker 0.
    assert (mpi / "calls").read_text().split() == ["job-worker-0", "job-worker-1", "job-worker-1", "job-worker-0"]
    [row] = read_results([tmp_path / "results" / "run-cells" / "cell-0123456789ab-r0" / ROW_FILE])
    assert row.environment["env"]["PARBENCH_POD"] == "job-worker-0" and row.launch_command == ["sh", "-c", "exit 3"]
    assert row.status is Status.FAILED


@pytest.mark.launch
def test_an_mpijob_launcher_whose_worker_never_answers_stops_in_one_line(tmp_path, monkeypatch):
    mpi_operator(tmp_path)
    monkeypatch.setenv("DOWN", "job-worker-1")
    ran = run_script(tmp_path, ["sh", "-c", f"echo started > {tmp_path}/started"], cpu_spec(), timeout_s=60,
                     prelude=wait_for_workers(limit_s=1))
    assert ran.returncode == 1 and not (tmp_path / "started").exists()
    assert ran.stderr.strip().splitlines()[-1] == ("parbench: Worker job-worker-1 did not answer "
                                                   f"{tmp_path}/mpi/kubexec.sh within 1 s; horovodrun was not started")


def test_the_horovod_manifests_launcher_waits_for_the_workers_and_records_on_the_first(scaling):
    _, job = manifest_of(scaling[0], "_horovod_ws32x4")
    script = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"][2]
    before, after = script.split("\nlaunch=(", 1)
    assert 'until timeout 30 /etc/mpi/kubexec.sh "$host" true >/dev/null 2>&1; do' in before
    assert "first_worker=$(head -n 1 /etc/mpi/hostfile | cut -d' ' -f1)" in before
    assert """/etc/mpi/kubexec.sh "$first_worker" 'cd /parbench && '"${record[*]@Q}" \\\n""" in after


@pytest.mark.parametrize("old, new", [
    ("until timeout 30", "until true || timeout 30"),                             # no wait
    ('/etc/mpi/kubexec.sh "$first_worker" \'cd /parbench && \'"${record[*]@Q}"', '"${record[@]}"'),   # recorded here
])
def test_an_mpijob_launcher_that_does_not_wait_or_records_on_itself_is_caught_by_the_plan_check(scaling, old, new):
    planted = manifest_of(scaling[0], "_horovod_ws32x4")
    command = planted[1]["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert old in command[2]
    command[2] = command[2].replace(old, new)
    assert caught(planted, PLAN, "Launcher.template.spec.containers[0].command")


def test_a_launch_whose_rank_reported_an_error_is_recorded_failed_with_its_message(tmp_path, monkeypatch):
    monkeypatch.setattr("harness.launch.record_launch.capture_environment", lambda freeze_dir: {"host": "pod"})
    cell = tmp_path / "run-cells" / "cell-0123456789ab-r1"
    cell.mkdir(parents=True)
    (cell / "spec.json").write_text(json.dumps(cpu_spec().to_dict()))
    (cell / "rank0.error.json").write_text(json.dumps({"status": "failed", "message": "boom in step 3"}))
    row = launch_row(cell, repeat=1, exit_status=1, wall_s=5.0, timeout_s=900, placement="k8s", command=["python"])
    assert (row.status, row.message, row.repeat, row.environment) == (Status.FAILED, "boom in step 3", 1,
                                                                      {"host": "pod", "placement": "k8s"})


def test_the_docs_pod_that_reads_the_results_claim_passes_the_kubernetes_schema():
    from doc_blocks import code_block

    pod = yaml.safe_load(code_block("docs/clusters.md", "results-reader.yaml"))
    assert k8s_check.kubernetes_problems(pod) == []
    volume, mount = pod["spec"]["volumes"][0], pod["spec"]["containers"][0]["volumeMounts"][0]
    assert (volume["persistentVolumeClaim"]["claimName"], mount["mountPath"]) == ("parbench-results",
                                                                                  str(RESULTS_MOUNT))
