#!/usr/bin/env bash
# The all-to-all's projection validated on an emulated cluster (docs/clusters.md, "Validating the projection of the
# all-to-all"): for each link rate, the collective benchmark across two emulated nodes (all_to_all among them) and
# moe-tiny's expert-parallel cells (ep, deepspeed-moe) beside the plain loop at world sizes 1, 2 and 4, each cell
# launched REPEATS times (default 2), after the host's own benchmark; then `project --validate`
# (scripts/validate-projection-on-links.sh). Needs root; about 6 minutes a rate on the 2-core VM.
#   scripts/validate-moe-projection.sh results/validation-moe 50mbit 100mbit 200mbit
set -euo pipefail
out=${1:?usage: $0 OUT_DIR RATE...}; shift
exec "$(dirname "$0")/validate-projection-on-links.sh" "$out" \
    "--matrix moe --precision fp32 --strategy plain,ep,deepspeed-moe --world-sizes 1,2,4" "$@"
