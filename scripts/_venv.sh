# Sourced by the README commands: create or reuse ./.venv and install the project into it.
# Installs only when setup.py changed since the last install (a stamp file remembers).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GLM52_VENV:-$ROOT/.venv}"
EXTRAS="${GLM52_EXTRAS:-cpu,test,plot}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.glm52-installed-$(sha256sum "$ROOT/setup.py" | cut -c1-16)-${EXTRAS//,/_}"
if [ ! -f "$STAMP" ]; then
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # A GPU user who already has paddlepaddle-gpu keeps it: the cpu extra is skipped then.
  if python -c "import paddle" >/dev/null 2>&1 && ! python -c "import paddle,sys; sys.exit(paddle.is_compiled_with_cuda())"; then
    EXTRAS="${EXTRAS//cpu,/}"
  fi
  python -m pip install -q -e "$ROOT[$EXTRAS]"
  touch "$STAMP"
fi
cd "$ROOT"
