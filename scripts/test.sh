#!/usr/bin/env bash
# Runs the test suite (CPU only), setting up its environment on first use.
# With no arguments: the tests marked `parallel` (tests/conftest.py) on SLUICE_TEST_WORKERS
# pytest-xdist workers (2), then the rest one at a time; the exit status is non-zero when
# either part failed. With arguments: one pytest run of exactly those.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
# The tests start a few hundred Python processes (servers, engine cores, ranks, commands): with
# bytecode caching off (PYTHONDONTWRITEBYTECODE, set on some machines) each compiles sluice again,
# and each pytest process rewrites every test module's asserts again (collection 26 -> 17 s).
unset PYTHONDONTWRITEBYTECODE
"$PY" -m ruff check sluice tests scripts
if [ $# -gt 0 ]; then
  exec "$PY" -m pytest -p no:cacheprovider "$@"
fi
status=0
"$PY" -m pytest -p no:cacheprovider -m parallel -n "${SLUICE_TEST_WORKERS:-2}" \
  --dist loadgroup || status=$?
"$PY" -m pytest -p no:cacheprovider -m "not parallel" || status=$?
exit "$status"
