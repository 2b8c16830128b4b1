#!/usr/bin/env bash
# Runs the `sluice` command from this checkout, setting up its environment on first use.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec "$PY" -m sluice "$@"
