#!/usr/bin/env bash
# The projection's validation of the hybrids on an emulated cluster (docs/clusters.md, "Validating the
# projection of the hybrids"): the collective benchmark between two ranks on this host (what the ranks of one
# emulated node use: its loopback, unshaped) once; then for each link rate the benchmark across two emulated
# nodes, and at 4 ranks (2 a node, on this machine's 2 cores) among all four, in pairs inside each node and in
# pairs across them, all pairs at once (the layouts the 4-rank cells' groups meet); the plain loop and each
# strategy's own machinery at world size 1 (tp, fsdp2-tp and autotp at tp 1, the pipeline at 1 stage), and tp,
# fsdp2-tp, autotp and pipeline x dp on gpt-tiny at world sizes 2 (a rank on each node) and 4 (2 nodes x 2
# ranks: TP inside a node, DP across; pipeline stages across, their replicas inside), each cell launched
# REPEATS times (default 3); then `project --validate` predicts each multi-rank cell from the rest. Needs root;
# about 25 min for three rates here.
#   scripts/validate-hybrid-projection.sh results/validation-hybrid 100mbit 200mbit 1gbit
set -euo pipefail
out=${1:?usage: $0 OUT_DIR RATE...}; shift
python=${PYTHON:-.venv/bin/python}
repeats=${REPEATS:-3}
collectives=all_reduce,all_gather,reduce_scatter,broadcast   # broadcast between 2 ranks prices a send
mkdir -p "$out"
"$python" -m harness comm --world-size 2 --device cpu --collectives "$collectives" --max-bytes 2M --warmup 2 \
    --iters 10 --out "$out/comm.jsonl"
for rate in "$@"; do
    "$python" -m harness comm --world-size 2 --emulate-link "$rate" --collectives "$collectives" \
        --max-bytes 2M --warmup 2 --iters 10 --out "$out/comm.jsonl"
    for groups in "" "--group-size 2" "--group-size 2 --group-layout strided"; do
        # shellcheck disable=SC2086   # $groups is two words or four, or none
        "$python" -m harness comm --world-size 4 $groups --emulate-link "$rate" --collectives "$collectives" \
            --max-bytes 2M --warmup 2 --iters 10 --out "$out/comm.jsonl"
    done
    for cells in "plain,tp,fsdp2-tp,autotp,pipeline 1" "tp,fsdp2-tp,autotp,pipeline 2,4"; do
        read -r strategies sizes <<< "$cells"
        "$python" -m harness run --matrix hybrid --precision fp32 --strategy "$strategies" --world-sizes "$sizes" \
            --timed-steps 10 --repeats "$repeats" --emulate-link "$rate" --out "$out/cells.jsonl" \
            --allow-failed-cells   # a failed cell is a row the validation reports
    done
done
"$python" -m harness project --validate "$out/cells.jsonl" --comm "$out/comm.jsonl"
