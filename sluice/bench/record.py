"""One benchmark run as one JSON record: what ran, where, when, and what it measured.

Every benchmark that writes JSON writes this layout (schema `sluice.bench/1`, described in
benchmarks/README.md):

    {"schema": "sluice.bench/1",
     "bench": "throughput",                      # which benchmark wrote it
     "command": ["sluice", "bench", "throughput", "--output", "t.json"],
     "date": "2026-12-01T09:30:00+00:00",        # UTC, when the record was written
     "git": "6ac36908a7c6" | "6ac36908a7c6-dirty" | null,
     "sluice_version": "0.1.0",
     "machine": {"hostname": ..., "platform": ..., "python": ..., "cpus": 16,
                 "device": "cuda:0" | "cpu" | null, "gpu": "NVIDIA H200" | null,
                 "num_gpus": 1, "torch": "2.11.0+cu130", "cuda": "13.0", ...},
     "results": {...}}                           # the benchmark's own figures and parameters

The envelope is the same for every benchmark; `results` is each one's own (see its module).
Nothing here imports torch: the machine lists torch, CUDA and the GPU only when the benchmark has
imported torch already, so the HTTP load generators stay light.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

SCHEMA = "sluice.bench/1"
# Versions recorded when the benchmark imported them (never imported here).
_PACKAGES = ("torch", "triton", "transformers")


def git_revision(checkout: str | Path | None = None) -> str | None:
    """The commit of the checkout (default: the one holding this sluice), with `-dirty` when
    tracked files differ from it; None where the tree is not a git checkout (a copied tree)."""
    root = Path(checkout) if checkout is not None else Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():  # a folder, or a file in a worktree
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty",
                              "--abbrev=12"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def machine(device: Any = None) -> dict[str, Any]:
    """Where the run ran: the host, and the GPU of `device` (a torch.device or its string)."""
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                            "python": platform.python_version(), "cpus": os.cpu_count(),
                            "device": None if device is None else str(device), "gpu": None}
    on_gpu = device is not None and str(device).startswith("cuda")
    torch = sys.modules.get("torch")
    if torch is not None:
        info["cuda"] = torch.version.cuda
        info["num_gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if on_gpu:
            info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    elif on_gpu:  # a benchmark that drives servers on the GPU without importing torch
        info["gpu"] = _nvidia_smi_gpu()
    for package in _PACKAGES:
        module = sys.modules.get(package)
        if module is not None:
            info[package] = getattr(module, "__version__", None)
    return info


def _nvidia_smi_gpu() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    names = out.stdout.split("\n")
    return (names[0].strip() or None) if out.returncode == 0 else None


def command_line(argv: list[str] | None = None) -> list[str]:
    """The command as typed: `sluice ...` for the CLI, `python -m sluice.x` for a module of this
    package, else `python <script> ...`; argv defaults to sys.argv."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ["python"]
    script = Path(argv[0]).resolve()
    package = Path(__file__).resolve().parents[1]  # .../sluice
    if script.name == "sluice" or script == package / "__main__.py":
        return ["sluice", *argv[1:]]
    if script.is_relative_to(package):
        module = ".".join(script.relative_to(package.parent).with_suffix("").parts)
        return ["python", "-m", module.removesuffix(".__main__"), *argv[1:]]
    return ["python", *argv]


def make_record(bench: str, results: dict[str, Any], *, device: Any = None,
                command: list[str] | None = None) -> dict[str, Any]:
    """A record of schema `SCHEMA` around a benchmark's `results`."""
    import sluice

    if not bench:
        raise ValueError("a record needs the name of its benchmark")
    return {
        "schema": SCHEMA,
        "bench": bench,
        "command": command_line() if command is None else list(command),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_revision(),
        "sluice_version": sluice.__version__,
        "machine": machine(device),
        "results": results,
    }


def write_record(path: str | Path, record: dict[str, Any]) -> None:
    """Write a record made by `make_record` (folders created), indented, one per file."""
    if record.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} record: schema {record.get('schema')!r}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")


def read_results(path: str | Path) -> dict[str, Any]:
    """A record's results; a file written before the schema is returned whole (its own
    layout: benchmarks/README.md lists them)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and data.get("schema") == SCHEMA:
        return data["results"]
    return data


def command_text(record: dict[str, Any]) -> str:
    """The record's command as one shell line."""
    return shlex.join(record["command"])


def describe_machine(info: dict[str, Any]) -> str:
    """One line of the machine, as the benchmarks print it."""
    parts = [info["hostname"], info["gpu"] or f"{info['cpus']} CPUs"]
    parts += [f"{package} {info[package]}" for package in _PACKAGES if info.get(package)]
    return " | ".join(parts)
