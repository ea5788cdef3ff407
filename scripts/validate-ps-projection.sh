#!/usr/bin/env bash
# The parameter server against DDP on an emulated cluster (docs/clusters.md, "The parameter server on the
# emulated cluster"): for each link rate, the collective benchmark across two emulated nodes, then the
# parameter-server matrix on gpt-tiny (the plain loop; DDP and ps colocated at 2 and 4 workers; ps with 1 and 2
# dedicated servers and ps-async with 1, beside 2 and 4 workers) on 6 emulated nodes, so that every rank has a
# node and a shaped link of its own and a dedicated server's link carries its W workers' messages. Each cell is
# launched REPEATS times (default 2); then `project --validate` predicts each synchronous multi-rank cell from
# its strategy's other one (ps-async is measured, not predicted). Needs root; ~25 min for three rates here.
#   scripts/validate-ps-projection.sh results/validation-ps 50mbit 200mbit 1gbit
set -euo pipefail
out=${1:?usage: $0 OUT_DIR RATE...}; shift
python=${PYTHON:-.venv/bin/python}
repeats=${REPEATS:-2}
collectives=all_reduce,all_gather,reduce_scatter,broadcast   # broadcast between 2 ranks prices a message
mkdir -p "$out"
for rate in "$@"; do
    # On the same 6 nodes as the cells (two of them used), so that the rows calibrate the cells' own network.
    "$python" -m harness comm --world-size 2 --emulate-link "$rate" --emulate-nodes 6 --collectives "$collectives" \
        --max-bytes 2M --warmup 2 --iters 10 --out "$out/comm.jsonl"
    "$python" -m harness run --matrix parameter-server --strategy plain,ddp,ps,ps-async --emulate-link "$rate" \
        --emulate-nodes 6 --timed-steps 8 --repeats "$repeats" --out "$out/cells.jsonl" \
        --allow-failed-cells   # a failed cell is a row the validation reports
done
"$python" -m harness project --validate "$out/cells.jsonl" --comm "$out/comm.jsonl"
