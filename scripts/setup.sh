#!/usr/bin/env bash
# Creates (once) the virtual environment that scripts/sluice.sh and scripts/test.sh use.
# Sourced, not run: sets PY to the environment's python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLUICE_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Re-install when the dependencies change.
stamp="$VENV/.sluice-setup-$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "sluice: setting up $VENV (once)" >&2
  if ! "$PY" -c "import torch" 2>/dev/null; then
    # The CPU build: a bare 'pip install torch' would pull gigabytes of CUDA packages.
    "$PY" -m pip install -q "torch==2.13.0" \
      || "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu \
      || "$PY" -m pip install -q torch
  fi
  "$PY" -m pip install -q -e "$ROOT[test]"
  rm -f "$VENV"/.sluice-setup-*
  touch "$stamp"
fi
export PY
