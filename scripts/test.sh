#!/usr/bin/env bash
# Runs the test suite (CPU only), setting up its environment on first use.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
"$PY" -m ruff check sluice tests scripts
exec "$PY" -m pytest -p no:cacheprovider "$@"
