"""The same-host PD backend (`shm`): the decode rank hands its cache over once, the prefill rank
maps it once per peer and copies its blocks straight in, one memory copy per coalesced run, no
socket for the bytes.

    decode rank                                   prefill rank (same host)
      SharedKVArena.allocate: the cache in one    ShmBackend.attach(session, export): open
      memfd segment (every layer)                   /proc/<pid>/fd/<fd>, check inode and size,
      TransferRequest.export = ShmExport ───────▶   mmap it (once per peer)
                                                  ShmBackend.write: copy_ each descriptor into
                                                    the mapping; return when done; then the
                                                    status goes out (never before the data)

Which side exports: the decode's, because the decode owns the blocks being written (it frees
them on success, failure and timeout, as with Mooncake, whose writes also land in the decode's
registered memory), and the prefill needs no change to when it may free its own blocks. The
decode reading from an exported prefill cache would need the prefill's blocks held until the
decode says it copied them: one more message per room.

CPU caches: the decode allocates its cache in a memfd (`os.memfd_create`), so the segment has
no name: nothing is ever left under /dev/shm, whatever kills the decode. Its memory is freed by
the kernel with the last mapping: the decode's own (at its exit) and the prefills' (each closes
a peer's mapping when it finds the decode gone: `sweep`, about once a second, and before every
write). Peers reach the segment as /proc/<decode pid>/fd/<fd>, which needs the same pid
namespace and user: `host_id` covers the host (boot id) and the pid namespace, so two
containers on one machine with separate namespaces count as two hosts (auto then picks
mooncake).

GPU caches: CUDA IPC. The decode exports each layer's storage once (`_share_cuda_()`, its
fields sent as typed bytes), the prefill opens each once and copies device to device on a side
stream, then waits on one event per write (a room's target). scripts/gpu_check.py's `pd_shm`
setting is the check (it passed on an H200 on 2026-12-02). The decode's GPU may be another GPU
of the host than the prefill's: the export names it by UUID, the prefill opens it under its own
index for that GPU (so the prefill process must see both: CUDA_VISIBLE_DEVICES) and its copies
go device to device over peer access (torch's copy_ between devices; not yet run on two GPUs).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.kv_transfer.disagg.descriptors import batches
from sluice.kv_transfer.disagg.messages import CacheExport, CudaIpcExport, CudaIpcLayer, ShmExport
from sluice.kv_transfer.disagg.transfer import TransferBackend, _Regions

logger = logging.getLogger("sluice")

_ALIGN = 4096  # each layer's tensor starts on a page
_SWEEP_INTERVAL_S = 1.0


def host_id() -> str:
    """What two processes must share for this backend: the machine (its boot id, and host name
    for the reader) and the pid namespace (/proc/<pid> of the peer must be the peer)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}/pidns:{pid_ns}"


def shm_unavailable() -> str | None:
    """Why this process cannot use the shm backend, or None."""
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is missing (Linux 3.17+ is needed)"
    if not host_id():
        return "/proc (boot id, pid namespace) cannot be read"
    return None


def process_start(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot), None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces but ends at the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def create_memfd(name: str, nbytes: int) -> int:
    """A new anonymous shared-memory file of `nbytes` bytes, every page allocated now (a file
    short of memory would otherwise fail a write later with SIGBUS, and the first write of each
    page would pay its fault); OSError if the memory is not there."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


def map_peer_memfd(pid: int, fd: int, inode: int, nbytes: int, *,
                    populate: bool = False) -> mmap.mmap:
    """Map the memfd segment that process `pid` holds open as `fd` (read-write, shared),
    checked by inode and size: OSError if it cannot be opened, ValueError if it is another
    file. The mapping holds the segment alive after the peer exits (until it is closed).
    `populate`: fill the page table now (MAP_POPULATE), not at each page's first touch."""
    path = f"/proc/{pid}/fd/{fd}"
    handle = os.open(path, os.O_RDWR)
    try:
        stat = os.fstat(handle)
        if stat.st_ino != inode or stat.st_size != nbytes:
            raise ValueError(f"{path} is not the exported segment (another inode or size)")
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(handle, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(handle)  # the mapping holds the file


@dataclass(slots=True)
class _Segment:
    fd: int
    mapping: mmap.mmap
    flat: Any  # uint8 tensor over the whole mapping


class SharedKVArena:
    """A decode rank's KV cache in one memfd segment (the connector's kv_cache_allocator).
    GPU caches are allocated as usual: they are shared by CUDA IPC."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.segment: _Segment | None = None

    def allocate(self, layer_names: Sequence[str], shape: tuple[int, ...], dtype: Any,
                 device: Any) -> dict[str, Any]:
        import torch

        if torch.device(device).type != "cpu":
            return {name: torch.zeros(shape, dtype=dtype, device=device) for name in layer_names}
        assert self.segment is None, "one cache per arena"
        problem = shm_unavailable()
        if problem is not None:
            raise ValueError(f"PD transfer_backend shm: {problem}")
        layer_bytes = torch.empty((), dtype=dtype).element_size()
        for size in shape:
            layer_bytes *= size
        stride = -(-layer_bytes // _ALIGN) * _ALIGN
        total = max(stride * len(layer_names), _ALIGN)
        try:
            fd = create_memfd(self.name, total)
            try:
                mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:
            raise ValueError(f"PD transfer_backend shm: cannot place a KV cache of {total} "
                             f"bytes in shared memory: {exc}") from None
        flat = torch.frombuffer(mapping, dtype=torch.uint8)  # zeros: a fresh file
        self.segment = _Segment(fd, mapping, flat)
        return {name: flat[i * stride:i * stride + layer_bytes].view(dtype).view(shape)
                for i, name in enumerate(layer_names)}

    def contains(self, tensor: Any) -> bool:
        if self.segment is None:
            return False
        start = self.segment.flat.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        return start <= tensor.data_ptr() and tensor.data_ptr() + nbytes <= start + len(
            self.segment.mapping)

    def export(self) -> ShmExport:
        segment = self.segment
        assert segment is not None
        pid = os.getpid()
        return ShmExport(host_id=host_id(), pid=pid, pid_start=process_start(pid) or 0,
                         fd=segment.fd, inode=os.fstat(segment.fd).st_ino,
                         nbytes=len(segment.mapping), base_address=segment.flat.data_ptr())

    def close(self) -> None:
        """No new peer can open the segment; the memory goes with the last mapping (this
        process's tensors and the peers' mappings)."""
        if self.segment is not None and self.segment.fd >= 0:
            os.close(self.segment.fd)
            self.segment.fd = -1


@dataclass(slots=True)
class _Peer:
    """One decode rank's cache, mapped here."""

    export: CacheExport
    regions: _Regions
    mapping: mmap.mmap | None = None  # CPU
    storages: list[Any] = field(default_factory=list)  # GPU: the opened IPC storages


def cuda_uuid(index: int) -> str:
    import torch

    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def local_cuda_index(uuid: str, index: int, visible: Sequence[str]) -> int:
    """This process's index of the GPU the peer calls `index` and names `uuid` (`visible`:
    the UUIDs of this process's GPUs, by index); ValueError naming it when not visible. An
    export without a UUID (an older peer) keeps the peer's index."""
    if not uuid:
        return index
    if uuid in visible:
        return list(visible).index(uuid)
    raise ValueError(f"the decode's cache is on GPU {uuid} (its cuda:{index}), which this "
                     f"prefill process does not see (its GPUs: {list(visible)}): run both "
                     "instances with both GPUs in CUDA_VISIBLE_DEVICES and pick each one's GPU "
                     "with --device cuda:N")


def export_cuda(tensors: Sequence[Any]) -> CudaIpcExport:
    """Each layer's CUDA storage as IPC fields."""
    layers = []
    for tensor in tensors:
        (device, handle, storage_nbytes, storage_offset, ref_handle, ref_offset, event_handle,
         event_sync) = tensor.untyped_storage()._share_cuda_()
        layers.append(CudaIpcLayer(
            address=tensor.data_ptr(), nbytes=tensor.numel() * tensor.element_size(),
            tensor_offset=tensor.storage_offset() * tensor.element_size(), device=device,
            handle=bytes(handle), storage_nbytes=storage_nbytes, storage_offset=storage_offset,
            ref_counter_handle=bytes(ref_handle), ref_counter_offset=ref_offset,
            event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync),
            device_uuid=cuda_uuid(device)))
    pid = os.getpid()
    return CudaIpcExport(host_id=host_id(), pid=pid, pid_start=process_start(pid) or 0,
                         layers=layers)


def mps_daemon_running(proc: str = "/proc") -> bool:
    """Whether an MPS control daemon or server (`nvidia-cuda-mps-control`, `-server`; /proc's
    comm keeps 15 characters of either) runs in this pid namespace, which this backend's peers
    share."""
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "comm")) as f:
                if f.read().startswith("nvidia-cuda-mps"):
                    return True
        except OSError:
            continue
    return False


def warn_if_time_sliced(own_device: int | None, peer_devices: Sequence[int],
                        proc: str = "/proc") -> bool:
    """Warn (and return True) when the decode's cache is on this prefill's own GPU and no MPS
    daemon runs: the two processes then time-slice the GPU instead of sharing it (at 8B on an
    H200 the mean TTFT was 1.9x colocated's, against 1.1-1.4x under MPS)."""
    if own_device is None or own_device not in peer_devices or mps_daemon_running(proc):
        return False
    logger.warning("PD shm: the decode's KV cache is on this prefill's GPU (cuda:%d) and no MPS "
                   "daemon runs: the two processes time-slice the GPU (at 8B the mean TTFT was "
                   "1.9x colocated's); start `nvidia-cuda-mps-control -d` before both instances",
                   own_device)
    return True


def copy_batch(dst_regions: _Regions, src_regions: _Regions, src: list[int], dst: list[int],
               lengths: list[int], non_blocking: bool = False) -> None:
    """Copy each descriptor's bytes, src[i] (in `src_regions`) to dst[i] (in `dst_regions`),
    in one native call (torch._foreach_copy_ over the descriptors' views). The engine's thread
    holds the GIL between its own native calls, so a call that releases it (ctypes.memmove, a
    CUDA copy_) waits up to the switch interval (5 ms) to get it back: one such wait per
    descriptor made a 64-descriptor write of 1.3 ms take 60 ms beside a busy Python thread,
    where one call for the batch waits once (benchmarks/tools/pd_shm_write_gil.py)."""
    import torch

    dsts = [dst_regions.slice(d, n) for d, n in zip(dst, lengths)]
    srcs = [src_regions.slice(s, n) for s, n in zip(src, lengths)]
    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


class ShmBackend(TransferBackend):
    """The `shm` TransferBackend (transfer.py's interface; see the module docstring)."""

    name = "shm"

    def __init__(self, max_batch: int, arena: SharedKVArena | None = None) -> None:
        problem = shm_unavailable()
        if problem is not None:
            raise ValueError(f"PD transfer_backend shm: {problem}")
        super().__init__(max_batch)
        self.arena = arena
        self.host_id = host_id()
        self.session = f"shm://{self.host_id}/{os.getpid()}/{id(self):x}"
        self._local = _Regions()
        self._export: CacheExport | None = None
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()  # the peers: writes and sweeps
        self._local_device: int | None = None  # this rank's GPU (CUDA caches)
        self._warned_time_sliced = False
        self._last_sweep = 0.0
        self._stream: Any = None
        self.copies = 0  # memory copies made (one per descriptor), for tests and stats

    # ---- the exporting (decode) side -----------------------------------------------------------

    def register(self, tensors: list[Any]) -> None:
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise ValueError("only contiguous tensors can be registered")
            self._local.add(tensor)
        if tensors[0].is_cuda:
            self._local_device = tensors[0].device.index
            self._export = None  # exported on first use: only a decode rank needs it
        elif self.arena is not None and all(self.arena.contains(t) for t in tensors):
            self._export = self.arena.export()

    def export(self, tensors: Sequence[Any]) -> CacheExport:
        """What a decode rank sends in its asks: its cache, for a peer to map."""
        if self._export is None:
            if not tensors[0].is_cuda:
                raise ValueError("PD transfer_backend shm: this decode rank's KV cache is not "
                                 "in shared memory (it must be allocated through the "
                                 "PDConnector's kv_cache_allocator)")
            self._export = export_cuda(tensors)
        return self._export

    # ---- the writing (prefill) side ------------------------------------------------------------

    def attach(self, peer: str, export: CacheExport | None) -> str | None:
        """Map the peer's cache unless it already is; None, or why it cannot be."""
        with self._lock:
            if peer in self._peers:
                return None
            if export is None:
                return f"the decode endpoint {peer} sent no shared cache to map"
            if export.host_id != self.host_id:
                return (f"transfer_backend shm needs the prefill and decode on one host (and "
                        f"pid namespace): the decode is on {export.host_id!r}, this prefill on "
                        f"{self.host_id!r}; set --disaggregation-transfer-backend to auto or "
                        "mooncake")
            if process_start(export.pid) != export.pid_start:
                return f"the decode process {export.pid} is gone"
            try:
                self._peers[peer] = (self._map_shm(export) if isinstance(export, ShmExport)
                                     else self._open_cuda(export))
            except (OSError, ValueError, RuntimeError) as exc:
                return f"cannot map the decode's cache ({peer}): {type(exc).__name__}: {exc}"
            logger.info("PD shm: mapped the cache of decode process %d (%s)", export.pid,
                        type(export).__name__)
            return None

    def _map_shm(self, export: ShmExport) -> _Peer:
        import torch

        mapping = map_peer_memfd(export.pid, export.fd, export.inode, export.nbytes)
        regions = _Regions()
        regions.add(torch.frombuffer(mapping, dtype=torch.uint8), start=export.base_address)
        return _Peer(export, regions, mapping=mapping)

    def _open_cuda(self, export: CudaIpcExport) -> _Peer:
        import torch

        torch.cuda._lazy_init()
        visible = [cuda_uuid(i) for i in range(torch.cuda.device_count())]
        regions = _Regions()
        storages = []
        devices = [local_cuda_index(layer.device_uuid, layer.device, visible)
                   for layer in export.layers]
        if not self._warned_time_sliced:
            self._warned_time_sliced = warn_if_time_sliced(self._local_device, devices)
        for layer, device in zip(export.layers, devices):
            storage = torch.UntypedStorage._new_shared_cuda(
                device, layer.handle, layer.storage_nbytes, layer.storage_offset,
                layer.ref_counter_handle, layer.ref_counter_offset, layer.event_handle,
                layer.event_sync_required)
            flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
            flat.set_(storage, 0, (layer.storage_nbytes,), (1,))
            storages.append(storage)
            regions.add(flat[layer.tensor_offset:layer.tensor_offset + layer.nbytes],
                        start=layer.address)
        return _Peer(export, regions, storages=storages)

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int],
              should_stop: Callable[[], bool] | None = None) -> str | None:
        with self._lock:
            mapped = self._peers.get(peer)
            if mapped is None:
                return f"the decode endpoint {peer} is not mapped here"
            if process_start(mapped.export.pid) != mapped.export.pid_start:
                self._close(peer)
                return f"the decode process {mapped.export.pid} is gone"
            gpu = isinstance(mapped.export, CudaIpcExport)
            try:
                for start, end in batches(len(src), self.max_batch):
                    if should_stop is not None and should_stop():
                        return "stopped between batches"
                    if gpu:
                        self._copy_gpu(mapped, src[start:end], dst[start:end],
                                       lengths[start:end])
                    else:
                        copy_batch(mapped.regions, self._local, src[start:end],
                                   dst[start:end], lengths[start:end])
                    self.copies += end - start
            except ValueError as exc:
                return str(exc)
        return None

    def _copy_gpu(self, mapped: _Peer, src: list[int], dst: list[int],
                  lengths: list[int]) -> None:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream()
        with torch.cuda.stream(self._stream):
            copy_batch(mapped.regions, self._local, src, dst, lengths, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        done.synchronize()  # the status must not overtake the data

    def probe(self, peer: str) -> bool:
        with self._lock:
            mapped = self._peers.get(peer)
            return mapped is not None and process_start(
                mapped.export.pid) == mapped.export.pid_start

    def sweep(self, now: float | None = None) -> None:
        """Close the mappings of decode processes that are gone (about once a second)."""
        now = time.monotonic() if now is None else now
        if now - self._last_sweep < _SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        # Called from the control thread: never wait behind a write (it checks its own peer).
        if not self._lock.acquire(blocking=False):
            return
        try:
            for peer, mapped in list(self._peers.items()):
                if process_start(mapped.export.pid) != mapped.export.pid_start:
                    logger.info("PD shm: decode process %d is gone; closing its mapping",
                                mapped.export.pid)
                    self._close(peer)
        finally:
            self._lock.release()

    def num_mapped(self) -> int:
        with self._lock:
            return len(self._peers)

    def _close(self, peer: str) -> None:
        mapped = self._peers.pop(peer)
        mapped.regions = _Regions()  # drop the tensors over the mapping first
        mapped.storages.clear()
        if mapped.mapping is not None:
            try:
                mapped.mapping.close()
            except BufferError:  # a view still alive (a failed copy's traceback): at exit then
                logger.warning("PD shm: the mapping of decode process %d stays until exit",
                               mapped.export.pid)

    def close(self) -> None:
        with self._lock:
            for peer in list(self._peers):
                self._close(peer)
        if self.arena is not None:
            self.arena.close()
