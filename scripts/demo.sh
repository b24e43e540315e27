#!/usr/bin/env bash
# The main job on the embedded default: make the tiny official-layout checkpoint, run it, prove parity.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec glm52 demo "$@"
