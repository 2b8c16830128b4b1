"""Real pool servers for the pool tests: one `redis-server`, one `mooncake_master` (with a
segment owner and a standalone real client, `mooncake_client`, for its dummy clients) and one
`sluice pool-server` (the shared host tier) per test session on free loopback ports (tests that
kill or fill a server start their own), stopped and reaped at the end. A server whose binaries
are missing skips its tests with the reason, except under CI=true, where it fails them."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from sluice.kv_transfer.pool import PoolBackend, create_backend
from sluice.testing import servers

# tiered: the session's shm pool in front of its redis-server. mooncake-dummy: a Mooncake dummy
# client of the session's real client (`mooncake_client`), which shares memory with it.
BACKENDS = ("local", "redis", "mooncake", "mooncake-dummy", "shm", "tiered")
# A test client's own share of the Mooncake pool: room for every test's values.
MOONCAKE_SEGMENT = 256 << 20
# The session's shared host tier: 64 KiB slots (the largest test value), room for every test's.
SHM_POOL_CAPACITY = 512 << 20
SHM_SLOT_BYTES = 64 << 10


def require(kind: str) -> None:
    """Skip (fail under CI) when the servers of backend `kind` cannot run here."""
    reason = {"local": None, "redis": servers.redis_missing,
              "mooncake": servers.mooncake_missing, "mooncake-dummy": mooncake_dummy_missing,
              "shm": shm_pool_missing,
              "tiered": lambda: shm_pool_missing() or servers.redis_missing()}[kind]
    reason = reason() if reason else None
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the {kind} pool tests: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[servers.RedisServer]:
    require("redis")
    with servers.start_redis() as server:
        yield server


def mooncake_dummy_missing() -> str | None:
    if servers.mooncake_client_path() is None:
        return "mooncake_client not found (it ships in the mooncake-transfer-engine wheels)"
    return servers.mooncake_missing()


def shm_pool_missing() -> str | None:
    from sluice.kv_transfer.disagg.shm import shm_unavailable

    return shm_unavailable()


@pytest.fixture(scope="session")
def shm_pool() -> Iterator[servers.ShmPoolServer]:
    require("shm")
    with servers.start_shm_pool(capacity_bytes=SHM_POOL_CAPACITY,
                                slot_bytes=SHM_SLOT_BYTES) as server:
        yield server


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[servers.MooncakeMaster]:
    require("mooncake")
    with servers.start_mooncake_master() as server:
        yield server


@pytest.fixture(scope="session")
def mooncake_segment_owner(mooncake_master: servers.MooncakeMaster
                           ) -> Iterator[servers.ServerProcess]:
    """A process owning pool memory on the session's master, for engine instances that own
    none (tests may kill it: they restart it before they end)."""
    with servers.start_mooncake_segment_owner(mooncake_master.address,
                                              MOONCAKE_SEGMENT) as owner:
        yield owner


@pytest.fixture(scope="session")
def mooncake_real_client(mooncake_master: servers.MooncakeMaster
                         ) -> Iterator[servers.MooncakeRealClient]:
    """The session's standalone real client, owning pool memory on the session's master, for
    dummy clients (tests may kill it: they restart it before they end)."""
    require("mooncake-dummy")
    with servers.start_mooncake_real_client(mooncake_master.address,
                                            MOONCAKE_SEGMENT) as real_client:
        yield real_client


def url_and_options(kind: str, request: pytest.FixtureRequest) -> tuple[str, dict]:
    """The URL and options of a backend of `kind` on the session's server."""
    if kind == "local":
        return "local", {}
    if kind == "redis":
        return request.getfixturevalue("redis_server").url, {}
    if kind == "shm":
        return request.getfixturevalue("shm_pool").url, {}
    if kind == "tiered":
        return (request.getfixturevalue("shm_pool").url,
                {"remote_url": request.getfixturevalue("redis_server").url})
    master = request.getfixturevalue("mooncake_master")
    if kind == "mooncake-dummy":
        real_client = request.getfixturevalue("mooncake_real_client")
        return master.url, {"client": "dummy", "real_client": real_client.address,
                            "admin_port": master.admin_port}
    return master.url, {"global_segment_size": MOONCAKE_SEGMENT,
                        "admin_port": master.admin_port}


def staging_buffer(num_bytes: int) -> torch.Tensor:
    # Pinned where CUDA is there, as the engine's staging buffer would be.
    pin = torch.cuda.is_available()
    return torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=pin)


def payloads(n: int, size: int, seed: int = 0) -> np.ndarray:
    """n random payloads of `size` bytes: [n, size] uint8."""
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    require(request.param)
    return request.param


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own: tests share the session's servers."""
    return f"test-{uuid.uuid4().hex[:12]}/"


class Staged:
    """A backend with a registered staging buffer (a torch tensor, as in the engine), and
    helpers to fill and read its slots. Slots are touched through a numpy view: torch's
    intra-op threads make a 64 KiB slice copy cost ~20 ms on a busy 2-core machine."""

    def __init__(self, backend: PoolBackend, buffer: torch.Tensor) -> None:
        self.backend = backend
        self.buffer = buffer
        self.bytes = buffer.numpy()
        backend.register_buffer(buffer.data_ptr(), buffer.numel())

    def write(self, offset: int, payload: np.ndarray) -> None:
        self.bytes[offset:offset + payload.size] = payload

    def read(self, offset: int, size: int) -> np.ndarray:
        return self.bytes[offset:offset + size].copy()


@pytest.fixture(scope="session", params=BACKENDS)
def staged(request: pytest.FixtureRequest) -> Iterator[Staged]:
    """One client per backend for the session (closing a Mooncake client takes ~2 s)."""
    require(request.param)
    url, options = url_and_options(request.param, request)
    backend = create_backend(url, timeout_s=5.0, **options)
    try:
        yield Staged(backend, staging_buffer(64 << 20))
    finally:
        backend.close()
