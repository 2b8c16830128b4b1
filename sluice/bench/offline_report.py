"""What every offline benchmark report carries: the command, the machine, the date, JSON out."""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def machine_info(device: torch.device) -> dict[str, Any]:
    import transformers

    return {
        "hostname": socket.gethostname(),
        "gpu": device_name(device),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }


def command_line(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["sluice", *args])


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def sluice_version() -> str:
    import sluice

    return sluice.__version__


def describe_machine(machine: dict[str, Any]) -> str:
    return (f"{machine['hostname']} | {machine['gpu']} | torch {machine['torch']} | "
            f"transformers {machine['transformers']}")


def write_json(path: str, record: dict[str, Any]) -> None:
    out = Path(path)
    if out.parent != Path("."):
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a timer read after it has seen all the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
