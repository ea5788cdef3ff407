"""Stop an image build whose torch wheel was built for another CUDA than the base image carries.

    python scripts/check_torch_cuda.py      # after torch is installed, before anything compiles against it

PyPI's torch wheels bring their own CUDA libraries and NCCL (torch 2.13.0 from PyPI is a CUDA 13.0 build), but
whatever compiles against torch in the image (Horovod's NCCL build) uses the base's nvcc and headers: a base
of another CUDA release builds a Horovod that does not match the torch it runs beside. The base's CUDA is
read from nvcc under $CUDA_HOME (default /usr/local/cuda), else nvcc on PATH, else $CUDA_VERSION, which
NVIDIA's CUDA images set. A base without CUDA passes: there Horovod builds on Gloo and torch's own CUDA
libraries are all a GPU run uses. Exit 1 with one line on a mismatch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def release(text: str) -> str | None:
    """'13.0' from nvcc's 'Cuda compilation tools, release 13.0, V13.0.88' or from '13.0.1'."""
    found = re.search(r"release (\d+)\.(\d+)", text) or re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)*\s*", text)
    return f"{found.group(1)}.{found.group(2)}" if found else None


def base_cuda() -> tuple[str | None, str]:
    """(major.minor or None, where it was read)."""
    home = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    for nvcc in (home / "bin" / "nvcc", shutil.which("nvcc")):
        if nvcc and Path(nvcc).exists():
            done = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
            version = release(done.stdout)
            if version:
                return version, f"{nvcc} --version"
    if os.environ.get("CUDA_VERSION"):
        return release(os.environ["CUDA_VERSION"]), f"CUDA_VERSION={os.environ['CUDA_VERSION']}"
    return None, "no nvcc and no CUDA_VERSION"


def main() -> int:
    import torch

    wheel = release(torch.version.cuda or "")
    base, source = base_cuda()
    if wheel and base and wheel != base:
        print(f"check_torch_cuda: torch {torch.__version__} is built for CUDA {wheel} but the base image carries "
              f"CUDA {base} ({source}); choose a base of CUDA {wheel} (--build-arg BASE_IMAGE=...) or the torch "
              f"wheel of CUDA {base}", file=sys.stderr)
        return 1
    if base is None:
        print(f"check_torch_cuda: torch {torch.__version__} (CUDA {wheel or 'none'}); the base has no CUDA toolkit "
              f"({source}): Horovod builds on Gloo")
    else:
        print(f"check_torch_cuda: torch {torch.__version__} and the base agree on CUDA {base} ({source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
