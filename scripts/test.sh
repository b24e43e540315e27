#!/usr/bin/env bash
# The test command: sets up ./.venv (first run installs), lints, then runs the whole suite on CPU.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
export MKL_DEBUG_CPU_TYPE="${MKL_DEBUG_CPU_TYPE:-5}"
ruff check .
ruff format --check .
python -m pytest -q -p no:cacheprovider --durations=30 "$@"
