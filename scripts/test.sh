#!/usr/bin/env bash
# The test command: sets up ./.venv (first run installs), lints, then runs the whole suite on CPU.
# With pytest-xdist installed the suite runs in three processes (GLM52_TEST_WORKERS=N to change,
# 1 for one process): each test file (or group of files sharing a launch) stays in one of them.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
export MKL_DEBUG_CPU_TYPE="${MKL_DEBUG_CPU_TYPE:-5}"
ruff check .
ruff format --check .
# Bytecode once for the package and the tests: each of the suite's ~500 Python processes (launched
# workers, launchers, CLI runs) then reads it, also where PYTHONDONTWRITEBYTECODE is set (docs/testing.md).
python -m compileall -q paddleformers_glm tests
workers="${GLM52_TEST_WORKERS:-3}"
parallel=()
if [ "$workers" != 1 ] && python -c "import xdist" >/dev/null 2>&1; then
  parallel=(-n "$workers" --dist loadfile)
fi
python -m pytest -q -p no:cacheprovider --durations=30 "${parallel[@]}" "$@"
