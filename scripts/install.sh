#!/usr/bin/env bash
# Install parbench with DeepSpeed, Horovod and the dev tools into the Python named by $PYTHON.
#
#   PYTHON=.venv/bin/python scripts/install.sh        (what `make setup` does, inside .venv)
#   PYTHON=python3 PARBENCH_EDITABLE=0 scripts/install.sh   (a copy of the project, not a link to it)
#   PYTHON=python3 PARBENCH_INSTALL=dependencies scripts/install.sh   (the Dockerfile: what pyproject.toml needs,
#                                                                      in a layer before the code is copied)
#   PYTHON=python3 PARBENCH_INSTALL=project scripts/install.sh        (then the project alone, on them)
#
# torch is installed only when missing (a GPU image brings its own CUDA build); the version asked for
# then is the CPU build on disk on the development machines. Horovod is built by install-horovod.sh and
# installed before the project, so the `horovod` extra finds it satisfied.
#
# Packages are installed by uv (installed first into $PYTHON by pip, pinned), which unpacks and byte-compiles on every
# core: a fresh .venv took 51 s where pip took 123 s on the 2-core VM (torch alone 19 s against 51), 2026-11-29.
# Bytecode is compiled at install (--compile-bytecode) because an interpreter that may not write it
# (PYTHONDONTWRITEBYTECODE) would otherwise compile torch at every start: `import torch` took 7.5 s there, not 3.5.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
source "$here/scripts/pip-install.sh"

part=${PARBENCH_INSTALL:-all}
case "$part" in
    all|dependencies|project) ;;
    *) echo "install.sh: PARBENCH_INSTALL=$part: expected all, dependencies or project" >&2; exit 2 ;;
esac
EXTRAS=(deepspeed horovod dev)

if [ "$part" != project ]; then
    if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
        pip_install "torch==${PARBENCH_TORCH_VERSION:-2.13.0}"
    fi
    PYTHON="$PY" "$here/scripts/install-horovod.sh"
fi
if [ "$part" = dependencies ]; then
    # pyproject.toml's dependencies and extras, without the project: the code can then change without them
    # being installed again (the Dockerfile's layer cache).
    requirements=$(mktemp)
    "$PY" - "$here/pyproject.toml" "${EXTRAS[@]}" >"$requirements" <<'PYEOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + [r for extra in sys.argv[2:] for r in project["optional-dependencies"][extra]]))
PYEOF
    pip_install -r "$requirements"
    rm -f "$requirements"
    "$PY" -c 'import torch, deepspeed, horovod.torch; print("installed: torch", torch.__version__,
          "deepspeed", deepspeed.__version__, "horovod", horovod.__version__)'
    exit 0
fi
extras=$(IFS=,; echo "${EXTRAS[*]}")
no_deps=()
[ "$part" = project ] && no_deps=(--no-deps)
if [ "${PARBENCH_EDITABLE:-1}" = 1 ]; then
    pip_install "${no_deps[@]}" -e "$here[$extras]"
else
    pip_install "${no_deps[@]}" "$here[$extras]"
fi
"$PY" -c 'import torch, deepspeed, horovod.torch, harness; print("installed: torch", torch.__version__,
      "deepspeed", deepspeed.__version__, "horovod", horovod.__version__)'
