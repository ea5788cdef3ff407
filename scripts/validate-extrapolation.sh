#!/usr/bin/env bash
# The projection's extrapolation check (docs/clusters.md, "Extrapolation"): on an emulated cluster of NODES
# (default 8) nodes, for each link rate, the collective benchmark between two nodes and every data-parallel
# strategy on gpt-tiny at world sizes 1, 2 and 8 (one rank per node), each cell launched REPEATS times
# (default 3); then `project --validate` predicts the 8-rank cells from those at <= 2 ranks (--design larger)
# and each rate's cells from the other rate's (--design across-settings). Run it from a clean checkout of a
# commit whose model is frozen, so that every row records git_dirty false: it refuses otherwise. Needs root;
# about 30 min a rate on a 2-core machine.
#   scripts/validate-extrapolation.sh results/reference/extrapolation 400mbit 100mbit
set -euo pipefail
out=${1:?usage: $0 OUT_DIR RATE...}; shift
[ "$#" -ge 1 ] || { echo "$0: give at least one link rate, e.g. 400mbit" >&2; exit 2; }
python=${PYTHON:-.venv/bin/python}
repeats=${REPEATS:-3}
nodes=${NODES:-8}
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "$0: the checkout has uncommitted changes; the held-out rows must come from a clean commit" >&2
    exit 2
fi
mkdir -p "$out"
git rev-parse HEAD > "$out/commit"
for rate in "$@"; do
    "$python" -m harness comm --world-size 2 --emulate-link "$rate" --emulate-nodes "$nodes" \
        --collectives all_reduce,all_gather,reduce_scatter --max-bytes 2M --warmup 2 --iters 10 --out "$out/comm.jsonl"
    "$python" -m harness run --matrix full --precision fp32 --workload gpt-tiny --strategy plain,ddp,horovod,zero1,zero2,zero3,fsdp2 \
        --world-sizes 1,2,"$nodes" --repeats "$repeats" --emulate-link "$rate" --emulate-nodes "$nodes" \
        --out "$out/cells.jsonl" --allow-failed-cells   # a failed cell is a row the validation reports
done
"$python" -m harness project --validate --design larger "$out/cells.jsonl" --comm "$out/comm.jsonl"
if [ "$#" -ge 2 ]; then
    "$python" -m harness project --validate --design across-settings "$out/cells.jsonl" --comm "$out/comm.jsonl"
fi
