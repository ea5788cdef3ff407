"""Everything about the machine and software a row needs to be reproduced, captured once per run.

    python -c "import json, harness.environment as e; print(json.dumps(e.capture_environment(), indent=1))"

Versions come from package metadata (importing DeepSpeed just for its version takes seconds). The
installed distributions are listed in `pip freeze` format from the same metadata (a `pip freeze`
subprocess costs seconds per run on a small machine), hashed into the row and stored beside the results
file. Horovod's build flags need its extension loaded, so Horovod's own worker reports them
(`horovod_build_flags`, called where `horovod.torch` is already imported).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RECORDED_ENV_PATTERN = re.compile(r"^(NCCL_|HOROVOD_|OMP_NUM_THREADS$|CUDA_VISIBLE_DEVICES$|MKL_NUM_THREADS$|"
                                  r"TORCH_DISTRIBUTED_|GLOO_|PARBENCH_)")


def capture_environment(freeze_dir: Path | None = None) -> dict[str, Any]:
    freeze = pip_freeze()
    freeze_hash = hashlib.sha256(freeze.encode()).hexdigest()[:16]
    if freeze_dir is not None:
        freeze_dir.mkdir(parents=True, exist_ok=True)
        (freeze_dir / f"pip-freeze-{freeze_hash}.txt").write_text(freeze)
    git_sha, git_dirty = git_state()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": _nccl_version(),
        "deepspeed": _version("deepspeed"),
        "horovod": _version("horovod"),
        "pip_freeze_sha256": freeze_hash,
        "git_sha": git_sha,
        "git_dirty": git_dirty,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        **host_type(),
        "gpu_driver": gpu_driver(),
        "env": {k: v for k, v in sorted(os.environ.items()) if RECORDED_ENV_PATTERN.match(k)},
    }


def host_type() -> dict[str, Any]:
    """The hardware a cell's identity includes (harness.derive.identity): CPU model and cores, GPU names."""
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "gpus": gpu_names()}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (RuntimeError, AttributeError):
        return None


def horovod_build_flags(hvd: Any) -> dict[str, bool]:
    """Which controllers and collectives the imported `horovod.torch` module was built with."""
    return {name: bool(getattr(hvd, name)())
            for name in ("gloo_built", "mpi_built", "nccl_built", "cuda_built", "rocm_built")}


def pip_freeze() -> str:
    """The installed distributions as `pip freeze` lists them (name==version, sorted by name)."""
    seen: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={dist.version}"
    return "".join(line + "\n" for _, line in sorted(seen.items()))


def git_state() -> tuple[str | None, bool | None]:
    """(commit SHA, whether tracked files differ from it) of the parbench checkout, if it is one."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                                capture_output=True, text=True, timeout=10)
        return sha.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        return None, None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpu_names() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def gpu_driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None
