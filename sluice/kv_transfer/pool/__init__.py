"""The storage layer of the global KV pool: backends that keep fixed-size KV block values by
content-addressed key, shared by engine instances.

    backend = create_backend("mooncake://127.0.0.1:50051", global_segment_size=1 << 30)

URLs: `local` / `local://` (in-process), `redis://HOST[:PORT][/DB]` (default port 6379),
`mooncake://MASTER_HOST[:PORT]` (default port 50051), `shm://HOST[:PORT]` (the shared host tier,
`sluice pool-server` on this host; default port 7070). Options are the backend class's keyword
arguments (`timeout_s` for all). The interface is `PoolBackend` (`backend.py`); the value format
with its integrity trailer is `framing.py`.
"""

from __future__ import annotations

import inspect
import urllib.parse
from typing import Any

from sluice.kv_transfer.pool.backend import (
    PoolBackend,
    PoolError,
    PoolTimeout,
    PoolUnavailable,
)
from sluice.kv_transfer.pool.framing import TRAILER_SIZE, value_size
from sluice.kv_transfer.pool.local_store import LocalBackend, LocalStore

__all__ = [
    "BACKENDS", "LocalBackend", "LocalStore", "PoolBackend", "PoolError", "PoolTimeout",
    "PoolUnavailable", "TRAILER_SIZE", "backend_class", "create_backend", "value_size",
]

BACKENDS = ("local", "redis", "mooncake", "shm")
DEFAULT_PORTS = {"redis": 6379, "mooncake": 50051, "shm": 7070}


def backend_class(name: str) -> type[PoolBackend]:
    """The class of backend `name` (imports its client library only when asked for)."""
    if name == "local":
        return LocalBackend
    if name == "redis":
        from sluice.kv_transfer.pool.redis_store import RedisBackend
        return RedisBackend
    if name == "mooncake":
        from sluice.kv_transfer.pool.mooncake_store import MooncakeBackend
        return MooncakeBackend
    if name == "shm":
        from sluice.kv_transfer.pool.shm_store import ShmPoolBackend
        return ShmPoolBackend
    raise ValueError(f"unknown pool backend {name!r}; known: {', '.join(BACKENDS)}")


def parse_url(url: str) -> tuple[str, dict[str, Any]]:
    """`url` -> (backend name, the constructor's address arguments)."""
    if not isinstance(url, str):
        raise ValueError(f"pool URL must be a string, got {url!r}")
    if url in ("local", "local://"):
        return "local", {}
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme
    if scheme not in DEFAULT_PORTS or parsed.query or parsed.fragment or parsed.username:
        raise ValueError(f"bad pool URL {url!r}: expected local, redis://HOST:PORT[/DB], "
                         f"mooncake://MASTER_HOST:PORT or shm://HOST:PORT")
    try:
        port = parsed.port
    except ValueError:
        raise ValueError(f"bad pool URL {url!r}: the port is not a number in [1, 65535]") from None
    if not parsed.hostname:
        raise ValueError(f"bad pool URL {url!r}: no host")
    address: dict[str, Any] = {"host": parsed.hostname,
                               "port": port if port else DEFAULT_PORTS[scheme]}
    path = parsed.path.strip("/")
    if scheme == "redis" and path:
        if not path.isdigit():
            raise ValueError(f"bad pool URL {url!r}: the database must be a number")
        address["db"] = int(path)
    elif path:
        raise ValueError(f"bad pool URL {url!r}: {scheme} takes no path")
    return scheme, address


def create_backend(url: str, **options: Any) -> PoolBackend:
    """Connect to the pool at `url`; raises `PoolUnavailable` / `PoolTimeout` naming the
    address when it cannot be reached, `ValueError` for a bad URL or option. With
    `remote_url` (and `remote_options`, that backend's options), the pool at `url` is a near
    tier in front of the one at `remote_url` (tiered.py); both must answer now."""
    remote_url = options.pop("remote_url", None)
    remote_options = options.pop("remote_options", None)
    if remote_url is not None:
        return _create_tiered(url, remote_url, remote_options, options)
    if remote_options is not None:
        raise ValueError("remote_options without remote_url")
    name, address = parse_url(url)
    cls = backend_class(name)
    accepted = [param.name for param in inspect.signature(cls.__init__).parameters.values()
                if param.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for the {name} pool backend; "
                         f"accepted: {', '.join(accepted)}")
    return cls(**address, **options)


def _create_tiered(url: str, remote_url: str, remote_options: Any,
                   options: dict[str, Any]) -> PoolBackend:
    from sluice.kv_transfer.pool.tiered import TieredBackend

    if parse_url(remote_url)[0] in ("local", "shm"):
        raise ValueError(f"remote_url {remote_url!r}: the far tier is a redis or mooncake pool")
    if remote_options is not None and not isinstance(remote_options, dict):
        raise ValueError(f"remote_options must be a dict of the remote backend's options, got "
                         f"{remote_options!r}")
    timeout_s = options.get("timeout_s", 5.0)
    near = create_backend(url, **options)
    try:
        far = create_backend(remote_url, **{"timeout_s": timeout_s, **(remote_options or {})})
    except BaseException:
        near.close()
        raise
    return TieredBackend(near, far, timeout_s=timeout_s)
