#!/usr/bin/env bash
# The projection's validation on an emulated cluster (docs/clusters.md, "Validating the projection"): for each
# link rate, the collective benchmark across two emulated nodes and every data-parallel strategy on gpt-tiny
# at world sizes 1, 2 and 4, each cell launched REPEATS times (default 3: one launch differs from the next by
# about 2%, up to 26% and once 115%, on these shared cores); then `project --validate` predicts each
# multi-rank cell from the rest, judged on its median launch. Needs root; ~55 min for four rates.
#   scripts/validate-projection.sh results/validation 50mbit 100mbit 200mbit 1gbit
set -euo pipefail
out=${1:?usage: $0 OUT_DIR RATE...}; shift
python=${PYTHON:-.venv/bin/python}
repeats=${REPEATS:-3}
mkdir -p "$out"
for rate in "$@"; do
    "$python" -m harness comm --world-size 2 --emulate-link "$rate" --collectives all_reduce,all_gather,reduce_scatter \
        --max-bytes 2M --warmup 2 --iters 10 --out "$out/comm.jsonl"
    "$python" -m harness run --matrix full --precision fp32 --workload gpt-tiny --strategy plain,ddp,horovod,zero1,zero2,zero3,fsdp2 \
        --world-sizes 1,2,4 --repeats "$repeats" --emulate-link "$rate" --out "$out/cells.jsonl" \
        --allow-failed-cells   # a failed cell is a row the validation reports
done
"$python" -m harness project --validate "$out/cells.jsonl" --comm "$out/comm.jsonl"
