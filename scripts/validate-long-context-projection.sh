#!/usr/bin/env bash
# Ulysses' all-to-alls' projection validated on an emulated cluster (docs/clusters.md, "Ulysses' all-to-alls on the
# emulated cluster"): for each link rate, the collective benchmark across two emulated nodes (all_to_all among them)
# and gpt-tiny-long's Ulysses cells beside the plain loop at world sizes 1, 2 and 4 (the sequence over every rank),
# each cell launched REPEATS times (default 2), after the host's own benchmark; then `project --validate`
# (scripts/validate-projection-on-links.sh). Needs root; about 2.5 minutes a rate on the 2-core VM.
#   scripts/validate-long-context-projection.sh results/validation-long-context 50mbit 100mbit 200mbit
set -euo pipefail
out=${1:?usage: $0 OUT_DIR RATE...}; shift
exec "$(dirname "$0")/validate-projection-on-links.sh" "$out" \
    "--matrix long-context --workload gpt-tiny-long --precision fp32 --strategy plain,ulysses --world-sizes 1,2,4" "$@"
