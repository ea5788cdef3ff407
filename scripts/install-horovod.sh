#!/usr/bin/env bash
# Build Horovod from its PyPI source with the C++17 fix, cache the wheel outside the checkout, install it.
#
#   PYTHON=.venv/bin/python scripts/install-horovod.sh
#
# Horovod 0.28.1 (its last release) asks CMake for C++14 while torch >= 2.1 headers need C++17; upstream
# fixed CMakeLists.txt after that release, so we apply the same one-line change. The build takes minutes,
# so the wheel is cached under $PARBENCH_WHEEL_CACHE keyed by Horovod, torch, Python and the collective
# backend it was built for; a second install takes seconds.
#
# Backend, PARBENCH_HOROVOD_GPU: `auto` (default) builds NCCL GPU operations when torch is a CUDA build and a
# CUDA toolkit (nvcc) is here to compile them, else Gloo; `1` insists on NCCL and stops in one line without
# nvcc (CMake would fail minutes later, deep in its output); `0` builds Gloo only.
set -euo pipefail

PY=${PYTHON:-python}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
CACHE=${PARBENCH_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/parbench/wheels}

# One interpreter for both (importing torch takes seconds): its version and its CUDA's, "" for a CPU build.
read -r torch_version torch_cuda < <("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "")')
[ -n "$torch_version" ] || { echo "install-horovod: torch does not import in $PY: install it first" >&2; exit 1; }
py_tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
nvcc=""
for candidate in "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" "$(command -v nvcc || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then nvcc=$candidate; break; fi
done
case "${PARBENCH_HOROVOD_GPU:-auto}" in
    auto) gpu=$([ -n "$torch_cuda" ] && [ -n "$nvcc" ] && echo 1 || echo 0)
          if [ -n "$torch_cuda" ] && [ -z "$nvcc" ]; then
              echo "install-horovod: torch is a CUDA $torch_cuda build but no nvcc is here: Horovod builds on Gloo" >&2
          fi ;;
    1) gpu=1
       if [ -z "$nvcc" ]; then
           echo "install-horovod: PARBENCH_HOROVOD_GPU=1 needs a CUDA toolkit's nvcc (looked in \$CUDA_HOME/bin," \
                "/usr/local/cuda/bin and PATH) to build NCCL operations; install one, or say PARBENCH_HOROVOD_GPU=0" >&2
           exit 1
       fi ;;
    0) gpu=0 ;;
    *) echo "install-horovod: PARBENCH_HOROVOD_GPU must be auto, 1 or 0, got '$PARBENCH_HOROVOD_GPU'" >&2; exit 2 ;;
esac
ops=$([ "$gpu" = 1 ] && echo nccl || echo gloo)
key="horovod-${HOROVOD_VERSION}_torch-${torch_version}_${py_tag}_${ops}"
wheel_dir="$CACHE/$key"

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    echo "install-horovod: building $key (several minutes, once)" >&2
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip install -q cffi wheel setuptools
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work"/horovod-*.tar.gz -C "$work"
    src=$(echo "$work"/horovod-"$HOROVOD_VERSION")
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
        || { echo "install-horovod: the C++17 fix did not apply to $src" >&2; exit 1; }

    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
           HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO
    export MAKEFLAGS="-j$(nproc)"
    if [ "$ops" = nccl ]; then
        # CMake 4 rejects the old minimum version in Horovod's bundled gloo; GCC 13 needs the includes
        # that older libstdc++ pulled in transitively.
        nccl=$("$PY" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null \
               || "$PY" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')
        [ -e "$nccl/lib/libnccl.so" ] || ln -s libnccl.so.2 "$nccl/lib/libnccl.so"
        # CMake finds the toolkit by its root, the folder above nvcc's (followed through links); an nvcc on
        # PATH may be a wrapper script elsewhere, whose folder holds no toolkit: then CUDA_HOME must say.
        toolkit=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
        if [ ! -e "$toolkit/include/cuda.h" ]; then
            echo "install-horovod: no CUDA toolkit around $nvcc ($toolkit/include/cuda.h is missing); set CUDA_HOME" \
                 "to the toolkit's root" >&2
            exit 1
        fi
        export CUDAToolkit_ROOT="$toolkit" CUDA_HOME="$toolkit" PATH="$toolkit/bin:$PATH"
        export CMAKE_POLICY_VERSION_MINIMUM=3.5 \
               CXXFLAGS="${CXXFLAGS:-} -include string -include cstdint -include stdexcept -include memory -include limits" \
               HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED \
               HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$nccl/lib"
    fi
    mkdir -p "$wheel_dir.partial"
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$wheel_dir.partial" "$src"
    rm -rf "$wheel_dir" && mv "$wheel_dir.partial" "$wheel_dir"
fi

# --reinstall-package: an installed build of the same version (a Gloo one when NCCL is wanted) would be kept; only
# Horovod is replaced, its dependencies installed as usual.
source "$(dirname "$0")/pip-install.sh"
pip_install --reinstall-package horovod "$wheel_dir"/horovod-*.whl
echo "install-horovod: $("$PY" -c 'import horovod; print("horovod", horovod.__version__)') ($key)" >&2
