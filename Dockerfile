# GPU reproduction image: CUDA, the CUDA build of PyTorch, DeepSpeed, and Horovod built with NCCL, installed
# by the same scripts a fresh machine runs (scripts/install.sh, scripts/install-horovod.sh).
#
#   docker build -t parbench .
#   docker run --rm --gpus all --ipc=host -v "$PWD/results:/parbench/results" parbench run --matrix full
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python for the venv, a toolchain and CMake for Horovod's build, git so rows record their commit.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12=3.12.* python3.12-venv=3.12.* \
       python3.12-dev=3.12.* build-essential=12.* cmake=3.* git=1:2.* \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PARBENCH_TORCH_VERSION=2.11.0 \
    PARBENCH_HOROVOD_GPU=1 \
    PARBENCH_WHEEL_CACHE=/tmp/parbench-wheels
RUN python3.12 -m venv /opt/venv

WORKDIR /parbench
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY harness/ harness/
COPY workloads/ workloads/
COPY suite/ suite/

# torch 2.11.0 from PyPI is a CUDA build and brings NCCL (nvidia-nccl), which Horovod links against.
RUN PYTHON=/opt/venv/bin/python PARBENCH_EDITABLE=0 scripts/install.sh && rm -rf /tmp/parbench-wheels

ENTRYPOINT ["python", "-m", "harness"]
CMD ["list"]
