"""scripts/setup.sh, which scripts/sluice.sh and scripts/test.sh source: two set-ups started
together (the README's two commands on a fresh clone) build the environment once, one after the
other, never both at once. A stub `python3` on PATH stands in for Python and pip (it logs what
it is asked and sleeps through an "install"), so the test takes seconds, not a torch install."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]

STUB = """#!/usr/bin/env bash
# python3 / the venv's python, as far as scripts/setup.sh uses them.
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  echo "venv $PPID" >> "$STUB_LOG"; mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0
fi
if [ "$1" = "-c" ]; then exit 0; fi  # "import torch": present
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "install-start" >> "$STUB_LOG"; sleep 1; echo "install-end" >> "$STUB_LOG"; exit 0
fi
exit 1
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_two_setups_at_once_build_the_environment_once(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "stub.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "SLUICE_VENV": str(tmp_path / "venv"), "STUB_LOG": str(log)}
    command = ["bash", "-c", f'source "{ROOT}/scripts/setup.sh" && echo "PY=$PY"']
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=60) for proc in procs]
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr
        assert stdout.strip() == f"PY={tmp_path / 'venv' / 'bin' / 'python'}"
    # One venv, one set of installs (the package, then the trained models': SmolLM2, Gemma 3),
    # and nothing in between; the second found it done.
    assert [line.split()[0] for line in log.read_text().splitlines()] == [
        "venv", *["install-start", "install-end"] * 3]
    assert sum("setting up" in stderr for _, stderr in outputs) == 1
    assert len(list((tmp_path / "venv").glob(".sluice-setup-*"))) == 1
    # Set up already: no lock, no install.
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and len(log.read_text().splitlines()) == 7
