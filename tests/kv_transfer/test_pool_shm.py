"""The shared host tier's own rules, against a real `sluice pool-server` and real client
processes: a value being read is never evicted under its reader, a client killed mid-put leaves
nothing visible, a client killed mid-get gives its pins back, eviction is least recently used, a
value larger than a slot is refused, and the threads of one client move values at once, each on
a connection of its own. (The backend contract every backend meets is test_pool_backends.py,
run on this one too.)"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from sluice.kv_transfer.pool import PoolTimeout, PoolUnavailable, create_backend, value_size
from sluice.kv_transfer.pool.framing import TRAILER_SIZE
from sluice.kv_transfer.pool.shm_store import ShmPoolBackend
from sluice.testing import servers
from tests.kv_transfer.conftest import Staged, require, staging_buffer
from tests.kv_transfer.conftest import payloads as make_payloads

pytestmark = pytest.mark.serial

SLOT_BYTES = 64 << 10
SIZE = SLOT_BYTES - TRAILER_SIZE  # a payload whose value fills a slot
SLOT = value_size(SIZE)

# A client speaking the raw protocol that stops half way through a call and waits to be killed:
# "put" reserves a slot and writes half a value into it; "get" takes a pin on a value.
HALF_DONE_CLIENT = """
import socket, sys, time
from sluice.channel import Encoder, MessageDecoder
from sluice.kv_transfer.disagg.shm import map_peer_memfd
from sluice.kv_transfer.pool.shm_server import (LENGTH, GetBegin, Hello, PutBegin, Reply,
                                                 send_frame)
port, op, key, size = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
sock = socket.create_connection(("127.0.0.1", port))
encoder, decoder = Encoder(), MessageDecoder(Reply, "reply", "test")
def ask(message):
    send_frame(sock, encoder, message)
    (length,) = LENGTH.unpack(sock.recv(4, socket.MSG_WAITALL))
    return decoder.decode(sock.recv(length, socket.MSG_WAITALL))
welcome = ask(Hello())
if op == "put":
    (slot,) = ask(PutBegin(keys=[key], sizes=[size])).slots
    assert slot >= 0, slot
    arena = map_peer_memfd(welcome.pid, welcome.fd, welcome.inode, welcome.nbytes)
    start = slot * welcome.slot_bytes
    arena[start:start + size // 2] = b"\\x5a" * (size // 2)
else:
    (slot,) = ask(GetBegin(keys=[key], max_sizes=[size])).slots
    assert slot >= 0, slot
print("holding", flush=True)
time.sleep(120)
"""


@pytest.fixture
def small_pool() -> servers.ShmPoolServer:
    """A pool server of 4 slots."""
    require("shm")
    with servers.start_shm_pool(capacity_bytes=4 * SLOT_BYTES, slot_bytes=SLOT_BYTES) as server:
        yield server


def half_done_client(server: servers.ShmPoolServer, op: str, key: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HALF_DONE_CLIENT, str(server.port), op, key,
                             str(SLOT)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding", proc.communicate(timeout=30)
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


def put(staged: Staged, keys: list[str], data: np.ndarray) -> list[bool]:
    for i in range(len(keys)):
        staged.write(i * SLOT, data[i])
    return staged.backend.batch_put(keys, [i * SLOT for i in range(len(keys))],
                                    [data.shape[1]] * len(keys))


def get(staged: Staged, keys: list[str]) -> tuple[list[bool], list[np.ndarray]]:
    base = 8 * SLOT
    staged.bytes[base:base + len(keys) * SLOT] = 0
    ok = staged.backend.batch_get(keys, [base + i * SLOT for i in range(len(keys))],
                                  [SIZE] * len(keys))
    return ok, [staged.read(base + i * SLOT, SIZE) for i in range(len(keys))]


def wait_for(condition, what: str, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_eviction_is_least_recently_used(small_pool: servers.ShmPoolServer) -> None:
    with create_backend(small_pool.url) as backend:
        staged = Staged(backend, staging_buffer(16 * SLOT))
        data = make_payloads(5, SIZE, seed=1)
        keys = [f"k{i}" for i in range(5)]
        assert put(staged, keys[:4], data[:4]) == [True] * 4
        assert get(staged, ["k0"])[0] == [True]  # k0 is now the most recently used
        assert put(staged, keys[4:], data[4:]) == [True]
        assert backend.batch_exists(keys) == [True, False, True, True, True]
        ok, got = get(staged, ["k0", "k4"])
        assert ok == [True, True]
        assert np.array_equal(got[0], data[0]) and np.array_equal(got[1], data[4])
        assert backend.stats().num_evicted == 1


def test_a_value_being_read_is_never_evicted_and_a_killed_reader_gives_its_pin_back(
        small_pool: servers.ShmPoolServer) -> None:
    with create_backend(small_pool.url) as backend:
        staged = Staged(backend, staging_buffer(16 * SLOT))
        data = make_payloads(12, SIZE, seed=2)
        assert put(staged, ["read"], data[:1]) == [True]
        reader = half_done_client(small_pool, "get", "read")
        try:
            # Three times the store's room while "read" is pinned: everything else goes.
            for i in range(1, 12):
                assert put(staged, [f"other{i}"], data[i:i + 1]) == [True]
            assert backend.batch_exists(["read"]) == [True]
            assert backend.stats().num_pinned == 1
            ok, got = get(staged, ["read"])
            assert ok == [True] and np.array_equal(got[0], data[0])
        finally:
            kill(reader)
        wait_for(lambda: backend.stats().num_pinned == 0, "the killed reader's pin stayed")
        for i in range(4):  # unpinned, it is evicted like any other value
            put(staged, [f"later{i}"], data[i:i + 1])
        assert backend.batch_exists(["read"]) == [False]


def test_a_client_killed_mid_put_leaves_nothing_visible(
        small_pool: servers.ShmPoolServer) -> None:
    with create_backend(small_pool.url) as backend:
        staged = Staged(backend, staging_buffer(16 * SLOT))
        writer = half_done_client(small_pool, "put", "torn")
        try:
            assert backend.batch_exists(["torn"]) == [False]
            assert backend.stats().num_reserved == 1
        finally:
            kill(writer)
        wait_for(lambda: backend.stats().num_reserved == 0, "the killed writer's slot stayed")
        assert backend.batch_exists(["torn"]) == [False]
        assert get(staged, ["torn"])[0] == [False]
        # Its slot is free again (4 values fit) and the key can be stored whole.
        data = make_payloads(4, SIZE, seed=3)
        assert put(staged, ["torn", "a", "b", "c"], data) == [True] * 4
        ok, got = get(staged, ["torn"])
        assert ok == [True] and np.array_equal(got[0], data[0])
        assert backend.stats().num_evicted == 0


def test_a_value_larger_than_a_slot_is_refused(small_pool: servers.ShmPoolServer) -> None:
    with create_backend(small_pool.url) as backend:
        assert isinstance(backend, ShmPoolBackend) and backend.max_value_size == SLOT_BYTES
        staged = Staged(backend, staging_buffer(16 * SLOT))
        data = make_payloads(1, SIZE + 1, seed=4)
        assert put(staged, ["big"], data) == [False]
        assert backend.batch_exists(["big"]) == [False]
        assert backend.stats().num_refused == 1


@pytest.mark.parametrize("args, message", [
    (["--capacity-bytes", "100", "--slot-bytes", "4096"], "holds no slot"),
    (["--capacity-bytes", "0"], "capacity_bytes must be a positive"),
    (["--capacity-bytes", "1048576", "--port", "70000"], "port must be in"),
    (["--capacity-bytes", "8388608", "--port", "TAKEN"], "cannot listen on 127.0.0.1:"),
])
def test_server_arguments_are_validated(args: list[str], message: str,
                                       small_pool: servers.ShmPoolServer) -> None:
    args = [arg.replace("TAKEN", str(small_pool.port)) for arg in args]
    argv = [sys.executable, "-m", "sluice", "pool-server", "--port", "0", *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def test_an_engine_whose_blocks_do_not_fit_a_slot_is_a_clear_error(qwen3_dir: str) -> None:
    from sluice import LLM

    require("shm")
    with servers.start_shm_pool(capacity_bytes=1 << 20, slot_bytes=4096) as server:
        config = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"backend": "shm", "url": server.url,
                                                "staging_bytes": 1 << 20}}
        # A block of the test model: 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes.
        with pytest.raises(ValueError, match=r"at most 4096 bytes; a KV block of this model is "
                                             r"8208 .*--slot-bytes >= 8208"):
            LLM(model=qwen3_dir, dtype="float32", block_size=16, max_model_len=64,
                kv_transfer_config=config)


def test_threads_of_one_client_move_values_at_once_each_on_its_own_connection(
        small_pool: servers.ShmPoolServer) -> None:
    """A worker's load and save threads share one backend: each gets its connection, and
    values moved at the same time all arrive whole."""
    with create_backend(small_pool.url) as backend:
        staged = Staged(backend, staging_buffer(16 * SLOT))
        data = make_payloads(4, SIZE, seed=5)
        errors: list[BaseException] = []

        def mover(index: int) -> None:
            try:
                base = 2 * index * SLOT  # this thread's two slots of the staging buffer
                key = f"thread{index}"
                staged.write(base, data[index])
                for _ in range(50):
                    assert backend.batch_put([key], [base], [SIZE]) == [True]
                    staged.bytes[base + SLOT:base + 2 * SLOT] = 0
                    assert backend.batch_get([key], [base + SLOT], [SIZE]) == [True]
                    assert np.array_equal(staged.read(base + SLOT, SIZE), data[index])
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=mover, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert backend.stats().num_connections == 4 + 1  # the four threads', this thread's
        assert backend.stats().num_pinned == 0 and backend.stats().num_reserved == 0


# ---- the shared host tier in front of Redis (tiered.py) ----

TIER_TIMEOUT_S = 1.0


def test_a_tier_down_leaves_the_other_serving_and_far_hits_are_promoted_near() -> None:
    require("tiered")
    with servers.start_shm_pool(capacity_bytes=8 * SLOT_BYTES, slot_bytes=SLOT_BYTES) as near, \
            servers.start_redis() as far:
        backend = create_backend(near.url, remote_url=far.url, timeout_s=TIER_TIMEOUT_S)
        staged = Staged(backend, staging_buffer(16 * SLOT))
        keys = ["k0", "k1", "k2"]
        data = make_payloads(3, SIZE, seed=6)

        def all_read() -> None:
            ok, got = get(staged, keys)
            assert ok == [True] * 3
            assert all(np.array_equal(got[i], data[i]) for i in range(3))

        assert put(staged, keys, data) == [True] * 3
        assert backend.near.count_keys() == backend.far.count_keys() == 3
        near.kill()  # the far tier answers alone, within the bound
        start = time.monotonic()
        all_read()
        assert backend.batch_exists(keys + ["other"]) == [True, True, True, False]
        assert time.monotonic() - start < 2 * TIER_TIMEOUT_S
        near.restart()  # back empty: the far tier's values are read and put near again
        all_read()
        assert backend.near.count_keys() == 3
        far.kill()  # the near tier answers alone
        all_read()
        assert put(staged, ["k3"], data[:1]) == [True]
        assert backend.near.count_keys() == 4
        near.kill()  # both down: the calls fail fast, naming the far tier
        for call in (lambda: backend.batch_exists(keys), lambda: get(staged, keys),
                     lambda: put(staged, keys, data)):
            start = time.monotonic()
            with pytest.raises(PoolUnavailable, match=f"redis pool at {far.address}"):
                call()
            assert time.monotonic() - start < TIER_TIMEOUT_S + 0.5
        backend.close()


def test_a_tiered_put_sends_far_sealed_values_of_keys_the_near_tier_already_held() -> None:
    """The near tier seals each slot in its copy's task, also the slots of keys it holds (not
    copied): the far put stores every slot as it is, so an unsealed one would be stored bad."""
    require("tiered")
    with servers.start_shm_pool(capacity_bytes=8 * SLOT_BYTES, slot_bytes=SLOT_BYTES) as near, \
            servers.start_redis() as far:
        backend = create_backend(near.url, remote_url=far.url, timeout_s=TIER_TIMEOUT_S)
        staged = Staged(backend, staging_buffer(16 * SLOT))
        data = make_payloads(2, SIZE, seed=7)
        staged.write(0, data[0])
        assert backend.near.batch_put(["k0"], [0], [SIZE]) == [True]  # near only
        staged.bytes[SIZE:SLOT] = 0  # its trailer gone from the staging slot
        assert put(staged, ["k0", "k1"], data) == [True, True]
        assert backend.far.count_keys() == 2
        ok = backend.far.batch_get(["k0", "k1"], [8 * SLOT, 9 * SLOT], [SIZE, SIZE])
        assert ok == [True, True] and backend.far.rejections() == {}
        assert np.array_equal(staged.read(8 * SLOT, SIZE), data[0])
        assert np.array_equal(staged.read(9 * SLOT, SIZE), data[1])
        backend.close()


def test_tiered_settings_are_validated() -> None:
    from tests.kv_transfer.test_pool_connector import settings

    pool = settings(backend="shm", url="shm://127.0.0.1:7070",
                    remote_url="redis://10.0.0.5:6379", remote_options={"password": "x"})
    assert pool.backend_options == {"remote_url": "redis://10.0.0.5:6379",
                                    "remote_options": {"password": "x"}}
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys "
                                         r"\['remote_url'\]"):
        settings(backend="redis", url="redis://127.0.0.1:6379", remote_url="redis://h:1")
    with pytest.raises(ValueError, match="remote_url must be a redis or mooncake address, got "
                                         "'shm://h:1'"):
        settings(backend="shm", url="shm://127.0.0.1:7070", remote_url="shm://h:1")
    with pytest.raises(ValueError, match="remote_options must be a dict .* got 5"):
        settings(backend="shm", url="shm://127.0.0.1:7070", remote_url="redis://h:1",
                 remote_options=5)
    with pytest.raises(ValueError, match="the far tier is a redis or mooncake pool"):
        create_backend("shm://127.0.0.1:1", remote_url="shm://127.0.0.1:2")
    with pytest.raises(ValueError, match="remote_options without remote_url"):
        create_backend("shm://127.0.0.1:1", remote_options={})


def test_a_stalled_mooncake_far_tier_keeps_the_slots_of_its_late_call_out_of_use() -> None:
    """Mooncake's native call goes on after its timeout (`busy`): the tiered backend raises
    that timeout even though the near tier answered, and refuses calls until it ends."""
    require("shm")
    require("mooncake")
    with servers.start_shm_pool(capacity_bytes=8 * SLOT_BYTES, slot_bytes=SLOT_BYTES) as near, \
            servers.start_mooncake_master() as master:
        backend = create_backend(near.url, remote_url=master.url, timeout_s=2 * TIER_TIMEOUT_S,
                                 remote_options={"global_segment_size": 32 << 20})
        try:
            staged = Staged(backend, staging_buffer(16 * SLOT))
            data = make_payloads(2, SIZE, seed=7)
            assert put(staged, ["a", "b"], data) == [True, True]
            master.pause()
            try:
                start = time.monotonic()
                with pytest.raises(PoolTimeout):
                    put(staged, ["c", "d"], data)  # the near tier takes them; the far times out
                assert time.monotonic() - start < 2 * TIER_TIMEOUT_S + 0.5
                assert backend.busy
                with pytest.raises(PoolUnavailable, match="far tier .* still runs"):
                    get(staged, ["a"])
            finally:
                master.resume()
            assert backend.wait_idle(15.0)
            ok, got = get(staged, ["a", "b", "c", "d"])
            assert ok == [True] * 4 and np.array_equal(got[2], data[0])
        finally:
            backend.close()
