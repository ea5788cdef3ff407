"""The image build's own checks, run here without a container engine: torch's CUDA against the base's
(scripts/check_torch_cuda.py), Horovod's NCCL build asked for without nvcc (scripts/install-horovod.sh), and what
the install scripts ask uv for (scripts/pip-install.sh, shared with `make setup`). scripts/docker-check.sh builds and
runs the image itself (its own CI tier)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.launch     # each check runs as the build runs it, in a process of its own


def fake_torch(folder: Path, version: str, cuda: str | None) -> Path:
    """A stand-in `torch` package that reports `version` built for `cuda`, as PyPI's wheels do (2.13.0 from
    PyPI: CUDA 13.0), first on the path of the checks below."""
    package = folder / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n"
                                         f"class version:\n    cuda = {cuda!r}\n")
    return folder


def run_check(tmp_path: Path, cuda: str | None, **env: str) -> subprocess.CompletedProcess:
    path = fake_torch(tmp_path / "site", "2.13.0", cuda)
    bare = tmp_path / "bin"                     # a PATH with python and no nvcc
    bare.mkdir(exist_ok=True)
    (bare / "python").symlink_to(sys.executable)
    environment = {"PATH": str(bare), "PYTHONPATH": str(path), "CUDA_HOME": str(tmp_path / "no-cuda"), **env}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_torch_cuda.py")], capture_output=True,
                          text=True, env=environment)


def test_a_cu130_wheel_on_a_cuda_12_8_base_stops_the_build_in_one_line(tmp_path):
    # NVIDIA's 12.8.1 images say CUDA_VERSION=12.8.1; PyPI's torch 2.13.0 says CUDA 13.0.
    done = run_check(tmp_path, "13.0", CUDA_VERSION="12.8.1")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "built for CUDA 13.0" in lines[0] and "carries CUDA 12.8" in lines[0], done.stderr


def test_the_same_release_passes_and_so_does_a_base_without_cuda(tmp_path):
    agree = run_check(tmp_path, "13.0", CUDA_VERSION="13.0.1")
    assert agree.returncode == 0 and "agree on CUDA 13.0" in agree.stdout, agree.stderr
    bare = run_check(tmp_path / "bare", "13.0")
    assert bare.returncode == 0 and "Horovod builds on Gloo" in bare.stdout, bare.stderr


def test_nvcc_under_cuda_home_is_read_before_cuda_version(tmp_path):
    toolkit = tmp_path / "cuda-12.8"
    (toolkit / "bin").mkdir(parents=True)
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    done = run_check(tmp_path, "13.0", CUDA_HOME=str(toolkit), CUDA_VERSION="13.0.1")
    assert done.returncode == 1 and "carries CUDA 12.8" in done.stderr and "nvcc --version" in done.stderr


def test_horovods_gpu_build_without_nvcc_stops_in_one_line_before_building(tmp_path):
    path = fake_torch(tmp_path / "site", "2.13.0", "13.0")
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("python", "dirname", "readlink", "ls", "mktemp"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        (bare / tool).symlink_to(found or sys.executable)
    environment = {"PATH": str(bare), "PYTHONPATH": str(path), "CUDA_HOME": str(tmp_path / "no-cuda"),
                   "PYTHON": sys.executable, "PARBENCH_HOROVOD_GPU": "1", "PARBENCH_WHEEL_CACHE": str(tmp_path / "c"),
                   "HOME": str(tmp_path)}
    done = subprocess.run(["/bin/bash", str(ROOT / "scripts" / "install-horovod.sh")], capture_output=True, text=True,
                          env=environment, timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "PARBENCH_HOROVOD_GPU=1 needs a CUDA toolkit's nvcc" in lines[0], done.stderr
    assert not (tmp_path / "c").exists()       # stopped before any build began


def test_a_wrong_horovod_gpu_setting_names_what_is_allowed(tmp_path):
    environment = {**os.environ, "PYTHONPATH": str(fake_torch(tmp_path / "site", "2.13.0", None)),
                   "PYTHON": sys.executable, "PARBENCH_HOROVOD_GPU": "yes", "PARBENCH_WHEEL_CACHE": str(tmp_path / "c")}
    done = subprocess.run(["/bin/bash", str(ROOT / "scripts" / "install-horovod.sh")], capture_output=True, text=True,
                          env=environment, timeout=60)
    assert done.returncode == 2 and "must be auto, 1 or 0, got 'yes'" in done.stderr


FAKE_PYTHON = """#!/bin/bash
# Records each call; uv is missing until pip installs it; pip is configured with two find-links folders.
echo "$*" >>"$(dirname "$0")/calls"
case "$*" in
    "-m uv --version") [ -e "$(dirname "$0")/uv-installed" ] ;;
    "-m pip install -q uv=="*) touch "$(dirname "$0")/uv-installed" ;;
    "-m pip config get global.find-links") echo "/wheels/a /wheels/b" ;;
esac
"""


def pip_install_calls(tmp_path, environment: dict[str, str], *packages: str) -> list[str]:
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    script = f'PY={python}; source {ROOT / "scripts" / "pip-install.sh"}; pip_install "$@"'
    done = subprocess.run(["/bin/bash", "-c", script, "pip_install", *packages], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **environment}, timeout=30)
    assert done.returncode == 0, done.stderr
    return (tmp_path / "calls").read_text().splitlines()


def test_packages_go_through_uv_compiled_with_pips_find_links(tmp_path):
    """uv is put in first, at its pin; the install byte-compiles (an interpreter under PYTHONDONTWRITEBYTECODE would
    otherwise compile torch at every start) and looks in the folders pip is configured with (the development
    machines' torch wheel), which uv does not read itself."""
    calls = pip_install_calls(tmp_path, {}, "torch==2.13.0")
    python = tmp_path / "python"
    assert calls == ["-m uv --version", "-m pip install -q uv==0.13.9", "-m pip config get global.find-links",
                     f"-m uv pip install -q --python {python} --compile-bytecode --system-certs "
                     "--find-links /wheels/a --find-links /wheels/b torch==2.13.0"]


def test_pips_find_links_variable_wins_and_an_installed_uv_is_kept(tmp_path):
    (tmp_path / "uv-installed").touch()
    calls = pip_install_calls(tmp_path, {"PIP_FIND_LINKS": "/here"}, "-e", ".[dev]")
    assert calls == ["-m uv --version",
                     f"-m uv pip install -q --python {tmp_path / 'python'} --compile-bytecode --system-certs "
                     "--find-links /here -e .[dev]"]
