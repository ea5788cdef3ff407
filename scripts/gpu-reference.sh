#!/usr/bin/env bash
# The GPU reference set (`--matrix reference`, harness/matrix.py) on one GPU, in one command from the repository root,
# with no network: installs what the machine lacks from a folder of carried wheels and sdists, runs the cells, and
# writes rows, logs, pip freeze and the report into one folder, inside a time budget (9 minutes of command time by
# default: a lent GPU's session).
#
#   scripts/gpu-reference.sh --fetch-wheels .whl     # here, where PyPI is reachable: fill the folder to carry
#   scripts/gpu-reference.sh --wheels .whl --out results/reference/h100/$(git rev-parse --short HEAD)   # there
#   PYTHON=.venv/bin/python scripts/gpu-reference.sh --dry-run    # anywhere: the plan; installs and launches nothing
#   PYTHON=.venv/bin/python scripts/gpu-reference.sh --device cpu  # a rehearsal of the same steps on a CPU
#
# Where the time goes (one H200 at a3663fd, results/reference/h200/a3663fd): a GPT-2 small launch takes 15-40 s,
# ResNet-50 12-29 s, DeepSpeed's the longest; Horovod's NCCL build 118 s on 16 cores. So Horovod builds, and
# DeepSpeed's CPU Adam (ZeRO-Offload's optimizer) compiles, in the background while the first cells run (each row
# records the host's load average); every strategy but Horovod runs in the matrix's order (harness.launch_order:
# every parity key's two plain launches first, then DDP, FSDP2, ZeRO-1/2/3, fp16, compile, Llama, ResNet, offload,
# two ranks) within what is left of the budget less RESERVE_HOROVOD_S and RESERVE_REPORT_S; then Horovod's two
# cells. `harness run --budget` starts no launch it cannot finish: the cells it did not reach are rows `skipped`,
# saying so, and the report lists them. tests/test_reference_order.py replays the order at a3663fd's launch times.
# Horovod's and DeepSpeed's builds follow ../../docs/setup.md ("The lent GPU machine").
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
BUDGET_S=540
RESERVE_HOROVOD_S=50
RESERVE_REPORT_S=40
DEEPSPEED_VERSION=0.19.8
HOROVOD_VERSION=0.28.1
# What the GPU machine (Python 3.12, torch 2.11 with CUDA 13.0, pandas, scipy, pyarrow, matplotlib, psutil, tqdm,
# pyyaml, ninja) lacks: DeepSpeed's own needs, and Horovod's build's (../../docs/setup.md).
CARRIED_WHEELS=(hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions cffi pycparser cloudpickle)
wheels=.whl
out=""
dry_run=0
fetch=""
device=cuda

usage() {
    echo "usage: scripts/gpu-reference.sh [--wheels DIR] [--out DIR] [--budget SECONDS] [--device cuda|cpu]" \
         "[--dry-run] | --fetch-wheels DIR" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) [ $# -ge 2 ] || usage; wheels=$2; shift 2 ;;
        --out) [ $# -ge 2 ] || usage; out=$2; shift 2 ;;
        --budget) [ $# -ge 2 ] || usage; BUDGET_S=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --device) [ $# -ge 2 ] || usage; device=$2; shift 2 ;;
        --fetch-wheels) [ $# -ge 2 ] || usage; fetch=$2; shift 2 ;;
        *) echo "gpu-reference: unknown argument '$1'" >&2; usage ;;
    esac
done
case "$BUDGET_S" in ''|*[!0-9]*) echo "gpu-reference: --budget must be whole seconds, got '$BUDGET_S'" >&2; exit 2 ;; esac
case "$device" in cuda|cpu) ;; *) echo "gpu-reference: --device must be cuda or cpu, got '$device'" >&2; exit 2 ;; esac
if [ "$BUDGET_S" -lt $((RESERVE_HOROVOD_S + RESERVE_REPORT_S + 60)) ]; then
    echo "gpu-reference: --budget $BUDGET_S leaves no time for cells (at least $((RESERVE_HOROVOD_S + RESERVE_REPORT_S + 60)) s)" >&2
    exit 2
fi

if [ -n "$fetch" ]; then
    # Binary wheels for the GPU machine's Python 3.12 on x86-64, and the two sdists it builds itself.
    mkdir -p "$fetch"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$fetch" "${CARRIED_WHEELS[@]}"
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$fetch" "deepspeed==$DEEPSPEED_VERSION" \
        "horovod==$HOROVOD_VERSION"
    du -sh "$fetch"
    exit 0
fi

# A harness run of the reference matrix into the rows file, with these extra arguments.
harness_run() {
    local machine=(--device cuda --gpus-per-node 1)
    [ "$device" = cuda ] || machine=(--device cpu)
    "$PY" -m harness run --matrix reference "${machine[@]}" --allow-failed-cells --timeout 240 "$@"
}
NOT_HOROVOD=plain,bare,ddp,fsdp2,zero1,zero2,zero3

if [ "$dry_run" = 1 ]; then
    cat <<EOF
gpu-reference dry run: budget $BUDGET_S s of command time; nothing is installed or launched.
1. install from $wheels (PIP_NO_INDEX): DeepSpeed $DEEPSPEED_VERSION's sdist with ${CARRIED_WHEELS[*]}, where not importable
2. in the background: Horovod $HOROVOD_VERSION with NCCL (scripts/install-horovod.sh, PARBENCH_HOROVOD_GPU=1), and
   DeepSpeed's CPU Adam op (CPUAdamBuilder().load()), TORCH_CUDA_ARCH_LIST set to the GPU's capability
3. $PY -m harness run --matrix reference --strategy $NOT_HOROVOD --budget <left - $RESERVE_HOROVOD_S - $RESERVE_REPORT_S>
4. once Horovod is built: --strategy horovod --budget <left - $RESERVE_REPORT_S>
5. $PY -m harness report OUT/rows.jsonl --out OUT/report; pip freeze; the machine's description
The cells, as the harness plans them for one GPU:
EOF
    # The cells and their inputs' layout; `harness run --dry-run` alone prints every launch's commands too.
    harness_run --dry-run | grep -E '^parbench dry run|/ws[0-9]+/|^  inputs: |^on this machine'
    exit 0
fi

started=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - started))); }
stage() { echo "== gpu-reference +$(( $(date +%s) - started )) s: $*"; }

out=${out:-results/gpu-reference-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

stage "machine"
"$PY" - "$device" <<'EOF' > "$out/machine.txt" || { cat "$out/machine.txt"; exit 1; }
import platform, subprocess, sys, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None)
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        raise SystemExit("gpu-reference: no CUDA device is visible; the reference set is for a GPU (--dry-run plans "
                         "it, --device cpu rehearses it)")
    print("device", torch.cuda.get_device_name(), "capability %d.%d" % torch.cuda.get_device_capability())
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit",
                          "--format=csv"], capture_output=True, text=True).stdout.strip())
EOF
cat "$out/machine.txt"
echo "git $(git rev-parse HEAD 2>/dev/null || echo unknown) dirty=$([ -z "$(git status --porcelain 2>/dev/null)" ] && echo no || echo yes)" \
    | tee -a "$out/machine.txt"
if [ "$device" = cuda ]; then
    # DeepSpeed's op builder cannot parse torch's default arch list on Hopper ("9.0a"): name the GPU's own.
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}
    export TORCH_CUDA_ARCH_LIST
fi

stage "install (wheels from $wheels)"
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$wheels"
"$PY" -c 'import pandas, psutil, tqdm, matplotlib, scipy, pyarrow, yaml' \
    || { echo "gpu-reference: the harness's own dependencies (pyproject.toml) are missing here; carry them in $wheels" >&2; exit 1; }
if ! "$PY" -c 'import deepspeed' 2>/dev/null; then
    "$PY" -m pip install -q --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"
fi
"$PY" -c 'import deepspeed; print("deepspeed", deepspeed.__version__)'
horovod_pid=""
if ! "$PY" -c 'import horovod.torch' 2>/dev/null; then
    (PYTHON="$PY" PARBENCH_HOROVOD_GPU=$([ "$device" = cuda ] && echo 1 || echo 0) nice -n 5 \
        scripts/install-horovod.sh > "$out/horovod-install.log" 2>&1;
     echo "horovod install exit $? after $(( $(date +%s) - started )) s" >> "$out/horovod-install.log") &
    horovod_pid=$!
fi
# ZeRO-Offload's optimizer compiles once per machine (seconds to a minute); the offload cells come last.
("$PY" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' > "$out/cpu-adam-build.log" 2>&1;
 echo "cpu_adam build exit $? after $(( $(date +%s) - started )) s" >> "$out/cpu-adam-build.log") &

status=0
stage "cells: every strategy but Horovod, $(left) s left"
harness_run --strategy "$NOT_HOROVOD" --out "$out/rows.jsonl" \
    --budget "$(( $(left) - RESERVE_HOROVOD_S - RESERVE_REPORT_S ))" || status=$?

if [ -n "$horovod_pid" ]; then
    stage "waiting for Horovod's build"
    wait "$horovod_pid" || true
    tail -n 3 "$out/horovod-install.log"
fi
stage "cells: Horovod, $(left) s left"
if [ "$(left)" -gt $((RESERVE_REPORT_S + 30)) ]; then
    harness_run --strategy horovod --out "$out/rows.jsonl" --budget "$(( $(left) - RESERVE_REPORT_S ))" || status=$?
else
    echo "gpu-reference: no time left for Horovod's cells"
fi

stage "report"
"$PY" -m harness report "$out/rows.jsonl" --out "$out/report" > "$out/report.log" 2>&1 || status=$?
tail -n 5 "$out/report.log"
"$PY" -m pip freeze > "$out/pip-freeze.txt"
stage "done, exit $status; rows, logs and the report in $out"
exit "$status"
