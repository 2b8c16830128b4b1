#!/usr/bin/env bash
# Runs the test suite (CPU only), setting up its environment on first use.
# With no arguments: the tests not marked `serial` (tests/conftest.py) on SLUICE_TEST_WORKERS
# pytest-xdist workers (2) at low priority, and at the same time the `serial` ones one at a
# time; the exit status is non-zero when either part failed. With arguments: one pytest run of exactly those.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
# The tests start a few hundred Python processes (servers, engine cores, ranks, commands): with
# bytecode caching off (PYTHONDONTWRITEBYTECODE, set on some machines) each compiles sluice again,
# and each pytest process rewrites every test module's asserts again (collection 26 -> 17 s).
unset PYTHONDONTWRITEBYTECODE
"$PY" -m ruff check sluice tests scripts benchmarks
if [ $# -gt 0 ]; then
  exec "$PY" -m pytest -p no:cacheprovider "$@"
fi
# Both parts at once: the tests that must not share the machine (time bounds, race windows) at
# normal priority, and the ones that may on xdist workers under `nice -n 19`, which take only the
# CPU the first part leaves idle (it waits on servers, timeouts and heartbeats about 30% of its
# time). The second part's output is printed when both have finished.
status=0
parallel_log="$(mktemp)"
nice -n 19 "$PY" -m pytest -p no:cacheprovider -m "not serial" -n "${SLUICE_TEST_WORKERS:-2}" \
  --dist loadgroup >"$parallel_log" 2>&1 &
parallel_pid=$!
trap 'kill "$parallel_pid" 2>/dev/null || true; rm -f "$parallel_log"' EXIT
echo "sluice: the tests not marked serial run alongside at nice 19; their output follows at the end"
"$PY" -m pytest -p no:cacheprovider -m serial || status=$?
wait "$parallel_pid" || status=$?
echo "sluice: the tests not marked serial:"
cat "$parallel_log"
exit "$status"
