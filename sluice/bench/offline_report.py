"""What the offline benchmarks share when they time the device. Their JSON records:
sluice.bench.record."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a timer read after it has seen all the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
