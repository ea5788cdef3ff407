#!/usr/bin/env bash
# Make .venv in the checkout ready: create it if needed and install everything (scripts/install.sh).
# A venv already installed from the current pyproject.toml and scripts is left as it is (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PARBENCH_VENV:-.venv}
stamp="$venv/.parbench-installed"
newest=$(ls -t pyproject.toml scripts/*.sh | head -n 1)
if [ -f "$stamp" ] && [ "$stamp" -nt "$newest" ]; then
    exit 0
fi
[ -x "$venv/bin/python" ] || "${PARBENCH_BASE_PYTHON:-python3}" -m venv "$venv"
PYTHON="$venv/bin/python" scripts/install.sh
touch "$stamp"
