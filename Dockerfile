# GPU reproduction image: the CUDA build of PyTorch, DeepSpeed, and Horovod built with NCCL where the base
# carries a CUDA toolkit, installed by the same scripts a fresh machine runs (scripts/install.sh,
# scripts/install-horovod.sh).
#
#   docker build -t parbench .
#   docker run --rm --gpus all --ipc=host -v "$PWD/results:/parbench/results" parbench run --matrix full
#
# BASE_IMAGE must carry the CUDA release the torch wheel was built for (torch 2.13.0 from PyPI: CUDA 13.0);
# scripts/check_torch_cuda.py stops the build in one line where they differ. PYTHON is the base's Python
# (Ubuntu 24.04's 3.12). scripts/docker-check.sh builds this on a local Debian base without CUDA
# (--build-arg BASE_IMAGE=... --build-arg PYTHON=3.11), where Horovod builds on Gloo.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}
ARG PYTHON=3.12
# auto: NCCL where torch is a CUDA build and nvcc is here, else Gloo; 1: NCCL or stop; 0: Gloo.
ARG PARBENCH_HOROVOD_GPU=auto
ARG PARBENCH_TORCH_VERSION=2.13.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python for the venv, a toolchain and CMake for Horovod's build, git so rows record their commit.
RUN apt-get update \
    && apt-get install -y --no-install-recommends "python${PYTHON}=${PYTHON}.*" "python${PYTHON}-venv=${PYTHON}.*" \
       "python${PYTHON}-dev=${PYTHON}.*" build-essential=12.* cmake=3.* git=1:2.* \
    && rm -rf /var/lib/apt/lists/*

# No download cache in the image's layers, pip's or uv's (scripts/pip-install.sh).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    UV_NO_CACHE=1 \
    PARBENCH_HOROVOD_GPU=${PARBENCH_HOROVOD_GPU} \
    PARBENCH_WHEEL_CACHE=/tmp/parbench-wheels
RUN "python${PYTHON}" -m venv /opt/venv

WORKDIR /parbench
# torch first, in a layer of its own (several GB), then the check that it matches the base's CUDA, before
# anything compiles against it.
COPY scripts/check_torch_cuda.py scripts/
RUN pip install --no-cache-dir "torch==${PARBENCH_TORCH_VERSION}" && python scripts/check_torch_cuda.py

# The dependencies (DeepSpeed, Horovod built from source, the dev tools) in a layer before the code, so that a change
# to harness/, workloads/, suite/ or README.md rebuilds from the COPY below alone (seconds, where the layers are cached).
COPY pyproject.toml ./
COPY scripts/ scripts/
RUN PYTHON=/opt/venv/bin/python PARBENCH_INSTALL=dependencies scripts/install.sh && rm -rf /tmp/parbench-wheels

# README.md after that layer: pyproject.toml names it as the project's readme, which only the project's build reads.
COPY README.md ./
COPY harness/ harness/
COPY workloads/ workloads/
COPY suite/ suite/
RUN PYTHON=/opt/venv/bin/python PARBENCH_INSTALL=project PARBENCH_EDITABLE=0 scripts/install.sh

ENTRYPOINT ["python", "-m", "harness"]
CMD ["list"]
