"""torch.profiler windows on the workers (`LLM.start_profile` / `stop_profile`, vLLM's names).

Each rank profiles its own process, so the kernels of every tensor-parallel rank, its
all-reduces among them, are seen, and sends back a summary of the window rather than a trace:
its steps, the GPU kernels (total device time and calls) and the host ops (self CPU time),
largest first. The summary is a msgspec struct: it crosses the executor's sockets as is.
"""

from __future__ import annotations

from typing import Any

import msgspec

TOP_KERNELS = 40
TOP_HOST_OPS = 20


class KernelTime(msgspec.Struct, frozen=True):
    name: str
    calls: int
    device_ms: float  # over the whole window


class HostOpTime(msgspec.Struct, frozen=True):
    name: str
    calls: int
    host_ms: float  # self CPU time over the whole window


class ProfileSummary(msgspec.Struct, frozen=True):
    rank: int
    steps: int  # steps this rank launched in the window
    device_ms: float  # all device activity (kernels, copies) over the window
    kernels: list[KernelTime]
    host_ops: list[HostOpTime]

    def per_step(self, name_contains: str) -> float:
        """Device ms per step of the kernels whose name contains `name_contains` (e.g.
        "AllReduce" for NCCL's), over the window's steps."""
        total = sum(k.device_ms for k in self.kernels if name_contains in k.name)
        return total / max(self.steps, 1)


class StepProfiler:
    """One window at a time: start(), a step count per launch while active, stop()."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps = 0
        self._profiler: Any = None

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        if self.active:
            raise RuntimeError(f"rank {self.rank}: a profile is already running")
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.steps = 0
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()

    def count_step(self) -> None:
        if self.active:
            self.steps += 1

    def stop(self) -> ProfileSummary:
        if not self.active:
            raise RuntimeError(f"rank {self.rank}: no profile is running (start_profile first)")
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the window's queued kernels, finished and recorded
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        events = profiler.key_averages()
        kernels = sorted((e for e in events if e.device_time_total > 0),
                         key=lambda e: -e.device_time_total)
        host_ops = sorted(events, key=lambda e: -e.self_cpu_time_total)
        return ProfileSummary(
            rank=self.rank, steps=self.steps,
            device_ms=round(sum(e.self_device_time_total for e in events) / 1000, 4),
            kernels=[KernelTime(e.key[:120], e.count, round(e.device_time_total / 1000, 4))
                     for e in kernels[:TOP_KERNELS]],
            host_ops=[HostOpTime(e.key[:120], e.count, round(e.self_cpu_time_total / 1000, 4))
                      for e in host_ops[:TOP_HOST_OPS]],
        )
