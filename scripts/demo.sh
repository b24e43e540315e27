#!/usr/bin/env bash
# The main job on the embedded default: make the tiny official-layout checkpoint, run it, prove parity.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
export MKL_DEBUG_CPU_TYPE="${MKL_DEBUG_CPU_TYPE:-5}"
exec glm52 demo "$@"
