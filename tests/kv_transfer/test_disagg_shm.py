"""The same-host PD backend (shm.py) without an engine: the decode's cache in a memfd segment,
a prefill's backend mapping it and copying coalesced block runs into it, the cache exports as
typed wire fields, the pair's backend choice (auto), and a decode process that dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

from sluice.channel import Encoder, WireError
from sluice.kv_transfer.disagg.descriptors import CacheLayout, block_runs, build_descriptors
from sluice.kv_transfer.disagg.messages import (
    CudaIpcExport,
    CudaIpcLayer,
    ShmExport,
    TransferRequest,
    control_decoder,
)
from sluice.kv_transfer.disagg.shm import (
    SharedKVArena,
    ShmBackend,
    host_id,
    mps_daemon_running,
    warn_if_time_sliced,
)
from sluice.kv_transfer.disagg.transfer import choose_backend

SHAPE = (2, 16, 4, 2, 4)  # [2, num_blocks, block_size, heads, dim]; 128 bytes a half block


def _layout(caches: dict[str, torch.Tensor]) -> CacheLayout:
    first = next(iter(caches.values()))
    return CacheLayout(tuple(t.data_ptr() for t in caches.values()), first.shape[1],
                       first.shape[2], first.shape[3], first.shape[4] * first.element_size())


def _pair() -> tuple[SharedKVArena, dict[str, torch.Tensor], ShmBackend,
                     dict[str, torch.Tensor], ShmBackend]:
    arena = SharedKVArena("test-shm")
    d_caches = arena.allocate(["l0", "l1"], SHAPE, torch.float32, torch.device("cpu"))
    decode = ShmBackend(max_batch=1024, arena=arena)
    decode.register(list(d_caches.values()))
    generator = torch.Generator().manual_seed(0)
    p_caches = {name: torch.randn(SHAPE, generator=generator) for name in ("l0", "l1")}
    prefill = ShmBackend(max_batch=3)
    prefill.register(list(p_caches.values()))
    return arena, d_caches, decode, p_caches, prefill


def test_a_write_is_one_copy_per_block_run_layer_and_half_into_the_decodes_segment() -> None:
    arena, d_caches, decode, p_caches, prefill = _pair()
    try:
        export = decode.export(list(d_caches.values()))
        assert isinstance(export, ShmExport) and export.pid == os.getpid()
        # The segment has no name: nothing of it under /dev/shm.
        assert os.readlink(f"/proc/self/fd/{export.fd}").startswith("/memfd:test-shm")
        assert prefill.attach(decode.session, export) is None
        assert prefill.attach(decode.session, export) is None  # mapped once
        assert prefill.num_mapped() == 1
        src_blocks, dst_blocks = [5, 6, 7, 12, 13], [9, 10, 11, 2, 3]
        runs = block_runs(src_blocks, dst_blocks)
        assert runs == [(5, 9, 3), (12, 2, 2)]
        src, dst, lengths = build_descriptors(_layout(p_caches), _layout(d_caches), runs)
        # 2 runs x 2 layers x K and V, in batches of 3 (max_batch)
        assert prefill.write(decode.session, src, dst, lengths) is None
        assert prefill.copies == 8
        assert lengths == [3 * 128, 2 * 128] * 4  # per layer and half: each run
        for name in d_caches:
            assert torch.equal(d_caches[name][:, dst_blocks], p_caches[name][:, src_blocks])
            untouched = [b for b in range(16) if b not in dst_blocks]
            assert not d_caches[name][:, untouched].any()
        # A descriptor outside the segment is refused, not written.
        error = prefill.write(decode.session, [src[0]], [export.base_address + export.nbytes],
                              [128])
        assert error is not None and "not within" in error
        stop = prefill.write(decode.session, src, dst, lengths, should_stop=lambda: True)
        assert stop == "stopped between batches"
    finally:
        prefill.close()
        decode.close()
    assert prefill.num_mapped() == 0


def test_cache_exports_travel_as_typed_fields_and_bytes() -> None:
    shm = ShmExport(host_id=host_id(), pid=12, pid_start=34, fd=5, inode=99, nbytes=1 << 30,
                    base_address=0x7F00_0000_0000)
    handle = bytes(range(64))  # a cudaIpcMemHandle_t: any bytes, NULs included
    cuda = CudaIpcExport(host_id="h", pid=1, pid_start=2, layers=[CudaIpcLayer(
        address=0x7000, nbytes=4096, tensor_offset=0, device=0, handle=handle,
        storage_nbytes=8192, storage_offset=512, ref_counter_handle=b"ref\x00",
        ref_counter_offset=8,
        event_handle=b"\x01" * 64, event_sync_required=True)])
    decoder = control_decoder()
    base = dict(room=1, decode_rank=0, tp_size=1, status_address="tcp://127.0.0.1:1",
                session="s", backend="shm", block_size=8, kv_dtype="float32", head_dim=4,
                num_kv_heads=2, model_num_kv_heads=2, layer_addresses=[1, 2], num_blocks=16,
                first_block=0, block_ids=[3], num_prompt_tokens=5, lease_s=10.0)
    for export in (shm, cuda, None):
        frame = Encoder().encode(TransferRequest(**base, export=export))
        assert decoder.decode(frame).export == export
        assert b"\x80\x04" not in frame  # msgpack, not pickle (protocol 4 header)
    got = decoder.decode(Encoder().encode(TransferRequest(**base, export=cuda))).export
    assert got.layers[0].handle == handle and isinstance(got.layers[0].handle, bytes)
    # A handle that is not bytes, or an export of an unknown kind, is a malformed frame.
    raw = msgspec.msgpack.decode(Encoder().encode(TransferRequest(**base, export=cuda)))
    raw["export"]["layers"][0]["handle"] = 17
    with pytest.raises(WireError, match="malformed"):
        decoder.decode(msgspec.msgpack.encode(raw))
    raw["export"] = {"type": "pickle", "data": b"x"}
    with pytest.raises(WireError, match="malformed"):
        decoder.decode(msgspec.msgpack.encode(raw))


def test_auto_pairs_over_shm_on_one_host_and_mooncake_across_hosts() -> None:
    both = ["shm", "mooncake"]
    assert choose_backend("auto", both, "h1", "auto", both, "h1") == ("shm", None)
    assert choose_backend("auto", both, "h1", "auto", both, "h2") == ("mooncake", None)
    assert choose_backend("auto", both, "h1", "mooncake", ["mooncake"], "h1") == ("mooncake",
                                                                                 None)
    assert choose_backend("auto", both, "h1", "shm", ["shm"], "h1") == ("shm", None)
    assert choose_backend("fake", ["fake"], "h1", "fake", ["fake"], "h1") == ("fake", None)
    name, problem = choose_backend("shm", ["shm"], "h1", "shm", ["shm"], "h2")
    assert name is None and "needs the prefill and decode on one host" in problem
    assert "--disaggregation-transfer-backend" in problem
    # auto without Mooncake installed has only shm: another host cannot be served.
    name, problem = choose_backend("auto", ["shm"], "h1", "auto", both, "h2")
    assert name is None and "one host" in problem
    name, problem = choose_backend("fake", ["fake"], "h1", "auto", both, "h1")
    assert name is None and "no backend in common" in problem


def test_attach_refuses_a_decode_on_another_host_naming_the_setting() -> None:
    arena, d_caches, decode, _, prefill = _pair()
    try:
        export = msgspec.structs.replace(decode.export(list(d_caches.values())),
                                         host_id="elsewhere/boot/pidns:1")
        error = prefill.attach(decode.session, export)
        assert "on one host" in error and "--disaggregation-transfer-backend" in error
        assert prefill.num_mapped() == 0
        error = prefill.attach("shm://nobody", None)
        assert "sent no shared cache" in error
    finally:
        prefill.close()
        decode.close()


_DECODE = """
import sys, time, msgspec, torch
from sluice.kv_transfer.disagg.shm import SharedKVArena, ShmBackend
arena = SharedKVArena("test-shm-child")
caches = arena.allocate(["l0"], (2, 16, 4, 2, 4), torch.float32, torch.device("cpu"))
backend = ShmBackend(1024, arena)
backend.register(list(caches.values()))
sys.stdout.buffer.write(msgspec.json.encode(backend.export(list(caches.values()))) + b"\\n")
sys.stdout.flush()
time.sleep(600)
"""


def test_a_decode_process_that_dies_has_its_mapping_closed_and_leaves_nothing(
        tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    child = subprocess.Popen([sys.executable, "-c", _DECODE], stdout=subprocess.PIPE, env=env)
    prefill = ShmBackend(max_batch=1024)
    try:
        export = msgspec.json.decode(child.stdout.readline(), type=ShmExport)
        p_cache = torch.ones(SHAPE)
        prefill.register([p_cache])
        assert prefill.attach("child", export) is None
        assert prefill.write("child", [p_cache.data_ptr()], [export.base_address], [128]) is None
        mapped = [line for line in Path("/proc/self/maps").read_text().splitlines()
                  if "memfd:test-shm-child" in line]
        assert len(mapped) == 1
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        prefill.sweep(time.monotonic() + 10)
        assert prefill.num_mapped() == 0
        assert not any("memfd:test-shm-child" in line
                       for line in Path("/proc/self/maps").read_text().splitlines())
        error = prefill.write("child", [p_cache.data_ptr()], [export.base_address], [128])
        assert error is not None and "not mapped" in error
        assert not [p for p in os.listdir("/dev/shm") if "test-shm" in p]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        prefill.close()


def test_shm_between_two_hosts_fails_the_room_naming_the_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.kv_transfer.test_disagg_transfer import pd_pair

    # The prefill registers as if on another machine.
    monkeypatch.setattr("sluice.kv_transfer.disagg.sender.host_id", lambda: "other/boot/pidns:1")
    with pd_pair("shm") as pair:
        pair.decode.receiver(61).init("d", pair.server.address, [4], 0, 3)
        pair.prefill.sender(61).send("p", [1], 3, first_token=3, first_logprobs=None)
        [received] = pair.wait(pair.decode)
        assert not received.ok and received.failed_block_ids == [4]
        assert "transfer_backend shm needs the prefill and decode on one host" in received.error
        assert "--disaggregation-transfer-backend" in received.error
        [sent] = pair.wait(pair.prefill)  # told by the decode: its blocks freed too
        assert not sent.ok


def test_a_decode_gpu_is_found_by_uuid_under_this_process_index() -> None:
    """Two GPUs of one host with other CUDA_VISIBLE_DEVICES per instance: the decode's cuda:0
    is the prefill's cuda:1; a GPU the prefill does not see is an error naming it."""
    from sluice.kv_transfer.disagg.shm import local_cuda_index

    visible = ["GPU-aaaa", "GPU-bbbb"]
    assert local_cuda_index("GPU-bbbb", 0, visible) == 1
    assert local_cuda_index("GPU-aaaa", 3, visible) == 0
    assert local_cuda_index("", 2, visible) == 2  # an export from before UUIDs
    with pytest.raises(ValueError, match=r"GPU-cccc \(its cuda:0\).*CUDA_VISIBLE_DEVICES"):
        local_cuda_index("GPU-cccc", 0, visible)


def fake_proc(root: Path, comms: dict[int, str]) -> str:
    for pid, comm in comms.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "comm").write_text(comm + "\n")
    (root / "self").mkdir()  # (not a pid: skipped)
    return str(root)


def test_one_gpu_shared_without_mps_is_warned_about(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Over CUDA IPC with the decode's cache on the prefill's own GPU, the prefill warns once
    when no MPS daemon runs in its pid namespace (the two processes would time-slice the GPU);
    not with one running (/proc's comm of nvidia-cuda-mps-control, cut at 15 characters), nor
    for the decode on another GPU."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    without = fake_proc(tmp_path / "a", {1: "bash", 42: "python3"})
    with_mps = fake_proc(tmp_path / "b", {1: "bash", 77: "nvidia-cuda-mps"})
    assert not mps_daemon_running(without) and mps_daemon_running(with_mps)
    assert not mps_daemon_running(str(tmp_path / "missing"))
    with caplog.at_level("WARNING", logger="sluice"):
        assert warn_if_time_sliced(0, [0, 0], proc=without)
    assert "no MPS daemon runs" in caplog.text and "nvidia-cuda-mps-control -d" in caplog.text
    assert not warn_if_time_sliced(0, [0, 0], proc=with_mps)
    assert not warn_if_time_sliced(0, [1, 1], proc=without)  # another GPU: peer access
    assert not warn_if_time_sliced(None, [0], proc=without)  # a CPU cache
