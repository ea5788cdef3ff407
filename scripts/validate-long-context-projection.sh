#!/usr/bin/env bash
# Ulysses' all-to-alls' projection validated on an emulated cluster (docs/clusters.md, "Ulysses' all-to-alls on the
# emulated cluster"): for each link rate, the collective benchmark across two emulated nodes (all_to_all among them)
# and gpt-tiny-long's Ulysses cells beside the plain loop at world sizes 1, 2 and 4 (the sequence over every rank),
# each cell launched REPEATS times (default 2), after the host's own benchmark (what the ranks of one node use); then
# `project --validate` predicts each multi-rank cell from its strategy's cell at the other size, judged on its median
# launch. Needs root; about 4 minutes a rate on the 2-core VM.
#   scripts/validate-long-context-projection.sh results/validation-long-context 50mbit 100mbit 200mbit
set -euo pipefail
out=${1:?usage: $0 OUT_DIR RATE...}; shift
python=${PYTHON:-.venv/bin/python}
repeats=${REPEATS:-2}
mkdir -p "$out"
# The ranks of one emulated node talk over its loopback: the host's own benchmark prices what stays inside a node.
"$python" -m harness comm --world-size 2 --device cpu --collectives all_reduce,all_gather,reduce_scatter,all_to_all \
    --max-bytes 2M --warmup 2 --iters 10 --out "$out/comm.jsonl"
for rate in "$@"; do
    "$python" -m harness comm --world-size 2 --emulate-link "$rate" \
        --collectives all_reduce,all_gather,reduce_scatter,all_to_all --max-bytes 2M --warmup 2 --iters 10 \
        --out "$out/comm.jsonl"
    "$python" -m harness run --matrix long-context --workload gpt-tiny-long --precision fp32 \
        --strategy plain,ulysses --world-sizes 1,2,4 --repeats "$repeats" --emulate-link "$rate" \
        --out "$out/cells.jsonl" --allow-failed-cells   # a failed cell is a row the validation reports
done
"$python" -m harness project --validate "$out/cells.jsonl" --comm "$out/comm.jsonl"
