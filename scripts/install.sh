#!/usr/bin/env bash
# Install parbench with DeepSpeed, Horovod and the dev tools into the Python named by $PYTHON.
#
#   PYTHON=.venv/bin/python scripts/install.sh        (what `make setup` does, inside .venv)
#   PYTHON=python3 PARBENCH_EDITABLE=0 scripts/install.sh   (what the Dockerfile does)
#
# torch is installed only when missing (a GPU image brings its own CUDA build); the version asked for
# then is the CPU build on disk on the development machines. Horovod is built by install-horovod.sh and
# installed before the project, so the `horovod` extra finds it satisfied.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==${PARBENCH_TORCH_VERSION:-2.13.0}"
fi
PYTHON="$PY" "$here/scripts/install-horovod.sh"
if [ "${PARBENCH_EDITABLE:-1}" = 1 ]; then
    "$PY" -m pip install -q -e "$here[deepspeed,horovod,dev]"
else
    "$PY" -m pip install -q "$here[deepspeed,horovod,dev]"
fi
"$PY" -c 'import torch, deepspeed, horovod.torch, harness; print("installed: torch", torch.__version__,
      "deepspeed", deepspeed.__version__, "horovod", horovod.__version__)'
