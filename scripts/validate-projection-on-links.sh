#!/usr/bin/env bash
# What the projection's validations on an emulated cluster share (scripts/validate-moe-projection.sh,
# scripts/validate-long-context-projection.sh): the host's own collective benchmark (what the ranks of one node
# use); then for each link rate the benchmark across two emulated nodes and the given `harness run` cells on them,
# each launched REPEATS times (default 2); then `project --validate` predicts each multi-rank cell from its
# strategy's cell at the other size, judged on its median launch. Needs root.
#   scripts/validate-projection-on-links.sh OUT_DIR "HARNESS RUN ARGUMENTS" RATE...
set -euo pipefail
out=${1:?usage: $0 OUT_DIR "HARNESS RUN ARGUMENTS" RATE...}
read -r -a cells <<< "${2:?usage: $0 OUT_DIR \"HARNESS RUN ARGUMENTS\" RATE...}"
shift 2
python=${PYTHON:-.venv/bin/python}
repeats=${REPEATS:-2}
collectives=all_reduce,all_gather,reduce_scatter,all_to_all
mkdir -p "$out"
"$python" -m harness comm --world-size 2 --device cpu --collectives "$collectives" --max-bytes 2M --warmup 2 \
    --iters 10 --out "$out/comm.jsonl"
for rate in "$@"; do
    "$python" -m harness comm --world-size 2 --emulate-link "$rate" --collectives "$collectives" --max-bytes 2M \
        --warmup 2 --iters 10 --out "$out/comm.jsonl"
    "$python" -m harness run "${cells[@]}" --repeats "$repeats" --emulate-link "$rate" --out "$out/cells.jsonl" \
        --allow-failed-cells   # a failed cell is a row the validation reports
done
"$python" -m harness project --validate "$out/cells.jsonl" --comm "$out/comm.jsonl"
