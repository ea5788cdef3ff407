#!/usr/bin/env bash
# Build the reproduction image and run it, as a new user's first build would, on a machine with no image
# registry: the check behind "Docker-based GPU reproduction" (make docker-check; .ci/run's Docker tier).
#
#   scripts/docker-check.sh              (root; about 12 minutes the first time, docs/setup.md)
#   scripts/docker-check.sh --if-changed (.ci/run: nothing where the image's inputs are as at the last pass)
#
# 1. Installs Debian's docker.io and debootstrap where missing and starts a private dockerd (its own socket,
#    data under $PARBENCH_DOCKER_STATE) that leaves the host's firewall and forwarding alone (other tests
#    use network namespaces): no bridge, so builds use --network host and runs --network none.
# 2. Bootstraps a Debian bookworm base (no registry to pull one from) holding the host's CA bundle, which
#    pip inside the build needs (PIP_CERT), and imports it once.
# 3. Builds the Dockerfile on that base (Python 3.11; no CUDA toolkit in it, so Horovod builds on Gloo) and
#    checks torch's CUDA against a planted CUDA 12.8 base (scripts/check_torch_cuda.py must refuse it).
# 4. Runs the smoke matrix (plain, DDP) in the image without a network under a host name nothing resolves,
#    and a Horovod + ZeRO-2 cell at 2 ranks (that name given in /etc/hosts: Horovod's Gloo needs it), and
#    fails unless every row is ok.
# 5. Where this machine has a CUDA toolkit, mounts it into the image, builds Horovod's NCCL wheel there
#    and checks horovod.torch.nccl_built(), unless what that build reads (NCCL_INPUTS: the Dockerfile, the
#    dependencies, the install scripts) is as at the commit in .ci/docker-nccl-passed.
# It stops the daemon by its pid afterwards and leaves no container, daemon or mount behind. Where it passed
# on a commit whose image inputs (IMAGE_INPUTS: every path the Dockerfile copies, and the Dockerfile and
# .dockerignore) are committed as they are, it records that commit in .ci/docker-check-passed (and in
# .ci/docker-nccl-passed where it built the NCCL wheel), which --if-changed compares with HEAD.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
state=${PARBENCH_DOCKER_STATE:-/var/lib/parbench-docker}
toolkit=${PARBENCH_CUDA_TOOLKIT:-/usr/local/cuda}
image=parbench:check
base=parbench-base:bookworm
# What the image is built from: the Dockerfile, .dockerignore and every path it copies (the COPY lines). A test
# (tests/test_suite_and_docker.py) holds this list to the Dockerfile's COPY sources.
IMAGE_INPUTS=(Dockerfile .dockerignore pyproject.toml README.md scripts harness workloads suite)
# What Horovod's NCCL build in the image reads: torch's and the dependencies' versions, and the install scripts.
NCCL_INPUTS=(Dockerfile pyproject.toml scripts/install.sh scripts/install-horovod.sh scripts/pip-install.sh
             scripts/check_torch_cuda.py)
IMAGE_PASSED=.ci/docker-check-passed
NCCL_PASSED=.ci/docker-nccl-passed
say() { echo "docker-check: $*" >&2; }

unchanged_since() {   # unchanged_since RECORD PATHS...: the paths are committed as at the commit RECORD names
    local record=$1 passed
    shift
    passed=$(cat "$record" 2>/dev/null || true)
    [ -n "$passed" ] && git cat-file -e "$passed^{commit}" 2>/dev/null && git diff --quiet "$passed" HEAD -- "$@" \
        && [ -z "$(git status --porcelain -- "$@")" ]
}

if [ "${1:-}" = --if-changed ]; then
    if unchanged_since "$IMAGE_PASSED" "${IMAGE_INPUTS[@]}"; then
        say "the image's inputs (${IMAGE_INPUTS[*]}) are as at $(cut -c1-12 "$IMAGE_PASSED"), where this check passed; not rebuilt"
        exit 0
    fi
    say "the image's inputs changed since $(cut -c1-12 "$IMAGE_PASSED" 2>/dev/null || echo "no recorded pass"): building it"
elif [ -n "${1:-}" ]; then
    say "unknown option $1: expected none or --if-changed"; exit 2
fi

[ "$(id -u)" = 0 ] || { say "needs root (it starts dockerd and debootstraps a base)"; exit 2; }
start=$(date +%s)
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    say "installing docker.io and debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        docker.io debootstrap >/dev/null
fi
docker_cli=$(command -v docker)

run=$(mktemp -d /tmp/parbench-docker.XXXXXX)   # socket, pid, exec root: short paths (sockets allow 108 bytes)
mkdir -p "$state"
dockerd_pid=""
cleanup() {
    local status=$?
    if [ -n "$dockerd_pid" ] && kill -0 "$dockerd_pid" 2>/dev/null; then
        docker ps -aq | xargs -r "$docker_cli" -H "unix://$run/sock" rm -f >/dev/null 2>&1 || true
        kill "$dockerd_pid"
        for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$dockerd_pid" 2>/dev/null && kill -9 "$dockerd_pid"
    fi
    # Whatever the daemon left mounted under its data or exec root (it unmounts all when it stops cleanly).
    grep -E " ($state|$run)" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "$run"
    exit "$status"
}
trap cleanup EXIT
docker() { "$docker_cli" -H "unix://$run/sock" "$@"; }

dockerd --data-root "$state/root" --exec-root "$run/exec" --pidfile "$run/pid" -H "unix://$run/sock" \
    --iptables=false --ip-forward=false --ip-masq=false --bridge=none >"$run/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
docker info >/dev/null 2>&1 || { say "dockerd did not start: $(tail -n 3 "$run/dockerd.log" | tr '\n' ' ')"; exit 1; }

if ! docker image inspect "$base" >/dev/null 2>&1; then
    say "bootstrapping $base (debootstrap --variant=minbase bookworm, about a minute)"
    rootfs="$state/rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$run/debootstrap.log" 2>&1 \
        || { say "debootstrap failed: $(tail -n 3 "$run/debootstrap.log" | tr '\n' ' ')"; exit 1; }
    # The CA certificates this host trusts (update-ca-certificates' extra ones and the bundle it makes):
    # without them pip in the build fails with CERTIFICATE_VERIFY_FAILED behind this network's proxy.
    mkdir -p "$rootfs/usr/local/share/ca-certificates" "$rootfs/etc/ssl/certs"
    cp -r /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/"
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    tar -C "$rootfs" -c . | docker import --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" - "$base" >/dev/null
    rm -rf "$rootfs"
fi

say "building $image on $base"
build_start=$(date +%s)
DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE_IMAGE=$base" --build-arg PYTHON=3.11 \
    -t "$image" . >"$run/build.log" 2>&1 \
    || { say "the build failed: $(tail -n 5 "$run/build.log" | tr '\n' ' ')"; exit 1; }
build_s=$(( $(date +%s) - build_start ))
size=$(docker image inspect -f '{{.Size}}' "$image")
say "built in ${build_s} s; image $(( size / 1000000 )) MB"

# A CUDA 12.8 base (NVIDIA's images say CUDA_VERSION=12.8.1) under the image's CUDA 13.0 torch: refused.
if docker run --rm --network none -e CUDA_VERSION=12.8.1 --entrypoint python "$image" \
        scripts/check_torch_cuda.py >"$run/planted.log" 2>&1; then
    say "check_torch_cuda.py accepted a planted CUDA 12.8 base: $(cat "$run/planted.log")"; exit 1
fi
say "planted CUDA 12.8 base refused: $(tail -n 1 "$run/planted.log")"

# The cells, as a user runs the image: no network, a host name no resolver knows, results on a volume.
results=$(mktemp -d "$run/results.XXXXXX")
in_image() {   # [docker run options --] harness run options
    local options=()
    if [[ " $* " == *" -- "* ]]; then while [ "$1" != -- ]; do options+=("$1"); shift; done; shift; fi
    docker run --rm --network none --hostname parbench-check --shm-size 2g -v "$results:/parbench/results" \
        "${options[@]}" "$image" run --device cpu --timeout 300 "$@"
}
cells_start=$(date +%s)
in_image --matrix smoke --out results/smoke.jsonl >"$run/smoke.log" 2>&1 \
    || { say "the smoke matrix failed in the image: $(tail -n 5 "$run/smoke.log" | tr '\n' ' ')"; exit 1; }
# Horovod's Gloo start-up needs the host's own name to resolve (it stops in one line without it).
in_image --add-host parbench-check:127.0.0.1 -- --matrix smoke --workload gpt-tiny --strategy horovod,zero2 --world-sizes 2 --out results/hvd-zero.jsonl \
    >"$run/hvd-zero.log" 2>&1 \
    || { say "Horovod + ZeRO-2 failed in the image: $(tail -n 5 "$run/hvd-zero.log" | tr '\n' ' ')"; exit 1; }
cells_s=$(( $(date +%s) - cells_start ))
python3 - "$results" <<'EOF'
import json, pathlib, sys
rows = [json.loads(line) for path in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl"))
        for line in path.read_text().splitlines() if line.strip()]
cells = [row for row in rows if row.get("kind", "cell") == "cell"]
bad = [f"{row['spec']['strategy']} x{row['spec']['world_size']}: {row['status']}" for row in cells
       if row["status"] != "ok"]
strategies = sorted({row["spec"]["strategy"] for row in cells})
if bad or set(strategies) != {"plain", "ddp", "horovod", "zero2"}:
    sys.exit(f"docker-check: rows not ok in the image: {bad or strategies}")
print(f"docker-check: {len(cells)} cells ok in the image ({', '.join(strategies)})", file=sys.stderr)
EOF
say "cells in the image took ${cells_s} s"

nccl="no CUDA toolkit at $toolkit: Horovod's NCCL build not checked"
nccl_built=""
if [ -x "$toolkit/bin/nvcc" ] && unchanged_since "$NCCL_PASSED" "${NCCL_INPUTS[@]}"; then
    nccl="Horovod's NCCL build not repeated: what it reads (${NCCL_INPUTS[*]}) is as at $(cut -c1-12 "$NCCL_PASSED"), where it passed"
elif [ -x "$toolkit/bin/nvcc" ]; then
    real=$(readlink -f "$toolkit")
    say "building Horovod's NCCL wheel in the image against $real (a few minutes)"
    nccl_start=$(date +%s)
    docker run --rm --network host -v "$real:/usr/local/cuda:ro" -e PARBENCH_HOROVOD_GPU=1 --entrypoint /bin/bash \
        "$image" -c 'python scripts/check_torch_cuda.py && scripts/install-horovod.sh && python -c "
import horovod.torch as hvd
assert hvd.nccl_built() and hvd.cuda_built(), (hvd.nccl_built(), hvd.cuda_built())
print(\"nccl_built\", hvd.nccl_built(), \"cuda_built\", hvd.cuda_built())"' >"$run/nccl.log" 2>&1 \
        || { say "Horovod's NCCL build failed: $(tail -n 5 "$run/nccl.log" | tr '\n' ' ')"; exit 1; }
    nccl="Horovod's NCCL wheel built in $(( $(date +%s) - nccl_start )) s: $(tail -n 1 "$run/nccl.log")"
    nccl_built=yes
fi
say "$nccl"

total=$(( $(date +%s) - start ))
say "passed in ${total} s (build ${build_s} s, image $(( size / 1000000 )) MB)"
if [ -z "$(git status --porcelain -- "${IMAGE_INPUTS[@]}")" ] && git rev-parse -q --verify HEAD >/dev/null; then
    git rev-parse HEAD >"$IMAGE_PASSED"
    [ -z "$nccl_built" ] || git rev-parse HEAD >"$NCCL_PASSED"
    say "recorded $(cat "$IMAGE_PASSED") in $IMAGE_PASSED${nccl_built:+ and $NCCL_PASSED} (commit it)"
else
    say "the image's inputs have uncommitted changes: nothing recorded"
fi
