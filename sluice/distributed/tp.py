"""The tensor-parallel group: this rank's place among the ranks and the two collectives the
model needs (all-reduce, all-gather), over torch.distributed: gloo on the CPU, NCCL on CUDA.

Lifecycle: the multiprocess executor hosts a TCPStore on a free loopback port (the OS picks it:
no port is hard-coded and none is probed and released) and sends each worker the port with its
rank (executor.messages.Startup); each worker process calls `init_tp_group`, which joins the
store, creates the process group with a timeout (a collective whose peer is gone fails within
it rather than blocking for ever) and runs one all-reduce, so the group is connected (and NCCL's
communicator exists before any CUDA graph captures a collective); `destroy_tp_group` at exit.

Only the layers' objects hold the group (a TPGroup passed down when the model is built); a
model built with SINGLE_RANK, the default, never calls torch.distributed at all, so one GPU
runs exactly the code it ran before tensor parallelism existed.

The head layout at TP = N (which ranks hold which query and key/value heads) and its checks
are in sluice.distributed.head_split.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# How long a collective (or the group's set-up) may wait for its peers before it fails. Ranks
# run the same steps in lock step, so a collective waits only for the slowest rank's share of a
# step: this bounds a hang when a peer is alive but stuck. A dead peer fails the collective at
# once on gloo; the executor notices dead ranks within 100 ms and stops the others.
TP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TPGroup:
    """rank in [0, size); `group`: the torch.distributed process group (None at size 1).
    `expert_parallel` (--enable-expert-parallel): the mixture-of-experts layers partition
    whole experts over these ranks instead of slicing every expert (sluice.model.moe; vLLM's
    expert parallelism at data-parallel size 1, where the expert group is the TP group)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    expert_parallel: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank gets the same bits. Returns x."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] from every rank -> [..., size * n], rank order along the last dim."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's even share of `total` rows; ValueError naming both
        numbers when size does not divide it."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size ({self.size}) must divide {what} ({total})")
        size = total // self.size
        return self.rank * size, size


SINGLE_RANK = TPGroup()


def host_store(world_size: int, timeout_s: float = TP_TIMEOUT_S) -> dist.TCPStore:
    """The executor's rendezvous: a TCPStore on 127.0.0.1 at a port the OS picks (`.port`)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_tp_group(rank: int, size: int, store_port: int, device: torch.device,
                  timeout_s: float = TP_TIMEOUT_S, expert_parallel: bool = False) -> TPGroup:
    """Join the executor's store on `store_port` and create this process's group (NCCL for a
    CUDA device, else gloo); one all-reduce checks every rank is there."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    if device.type == "cuda":
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size,
                                timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                                timeout=timeout)
    group = TPGroup(rank=rank, size=size, group=dist.group.WORLD,
                    expert_parallel=expert_parallel)
    ready = torch.ones(1, device=device)
    group.all_reduce(ready)
    if int(ready.item()) != size:
        raise RuntimeError(f"tensor-parallel rank {rank}: the group's first all-reduce summed "
                           f"{ready.item()} ranks, expected {size}")
    return group


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
