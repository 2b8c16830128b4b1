"""What the pool connector is told and what it derives from it: its settings (validated from
`kv_connector_extra_config`), the keys of its values, the layout of one value, and the health of
one backend client (outages noticed, warned about once, retried).

    kv_transfer_config = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"backend": "redis",
                                                        "url": "redis://127.0.0.1:6379"}}

Keys are content-addressed: `sluice/<model tag>/<digest>/tp<rank>-<size>/<chained block hash>`,
where the digest covers the model identity, dtype, block size, the cache and value layouts, the
layer count and head shape, and the tensor-parallel rank and size (the same tokens under any other
of these are other bytes); the tag is the model's name for people reading the store.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sluice.config import KVTransferConfig
from sluice.core.kv_connector import KVCacheSpec
from sluice.kv_transfer.pool import BACKENDS, PoolTimeout, backend_class, parse_url
from sluice.kv_transfer.pool.framing import FORMAT_VERSION, value_size
from sluice.kv_transfer.pool.rates import LOAD_POLICIES

logger = logging.getLogger("sluice")

# One value is one block of every layer of this rank: [num_layers, 2, block_size, heads, dim].
VALUE_LAYOUT = "L.2.bs.h.d"
ON_BACKEND_ERROR = ("fail", "recompute")
LOAD_MODES = ("async", "sync")
# The connector's own keys; the backend's keyword options (global_segment_size, password, ...)
# are accepted beside them and handed to the backend.
_CONNECTOR_KEYS = ("backend", "url", "on_backend_error", "timeout_s", "lookup_timeout_s",
                   "staging_bytes", "retry_interval_s", "model_id", "load_policy",
                   "save_decode_blocks", "load_mode")
# Staging slots start on this boundary (DMA-friendly, and a multiple of every dtype's size).
SLOT_ALIGN = 256
MIN_SLOTS = 4  # two to load into, two to save from


MIN_STAGING_BYTES = 256 << 20


@dataclass(frozen=True)
class PoolSettings:
    backend: str = "local"
    url: str = "local"
    on_backend_error: str = "fail"
    timeout_s: float = 5.0  # each worker call (a chunk of loads, one step's saves)
    lookup_timeout_s: float = 0.25  # the scheduler's existence query: a miss after that
    # Host staging per worker (pinned on CUDA); None: sized from the step (`staging_size`).
    staging_bytes: int | None = None
    retry_interval_s: float = 1.0  # a client that failed is tried again after this
    model_id: str | None = None  # names the model in keys (default: the model as given)
    # Load a hit when loading is expected faster than recomputing it (rates.py), or always, or
    # never.
    load_policy: str = "auto"
    # Save the blocks a request's output fills too (LMCache's save_decode_cache; off: a later
    # prompt that holds them offers them when its lookup finds them missing).
    save_decode_blocks: bool = False
    # "async": a hit loads while the request waits (WAITING_FOR_REMOTE_KVS) and the steps of
    # the others go on; "sync": inside the step of its first new tokens, layer by layer.
    load_mode: str = "async"
    backend_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: KVTransferConfig) -> PoolSettings:
        extra = dict(config.kv_connector_extra_config)
        backend = extra.get("backend", "local")
        if backend not in BACKENDS:
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.backend must be one of "
                             f"{list(BACKENDS)}, got {backend!r}")
        option_names = [p.name for p in inspect.signature(backend_class(backend).__init__)
                        .parameters.values()
                        if p.kind is inspect.Parameter.KEYWORD_ONLY
                        and p.name not in ("timeout_s", "store")]
        if backend == "shm":  # in front of a remote pool (tiered.py)
            option_names += ["remote_url", "remote_options"]
        unknown = sorted(set(extra) - set(_CONNECTOR_KEYS) - set(option_names))
        if unknown:
            raise ValueError(f"KVPoolConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"allowed: {list(_CONNECTOR_KEYS)} and the {backend} backend's "
                             f"options {option_names}")
        url = extra.get("url", "local" if backend == "local" else None)
        if url is None:
            raise ValueError(f"KVPoolConnector: the {backend} backend needs "
                             f"kv_connector_extra_config.url ({_URL_FORMS[backend]})")
        scheme, _ = parse_url(url)  # a ValueError naming a malformed URL
        if scheme != backend:
            raise ValueError(f"KVPoolConnector: url {url!r} is not a {backend} address "
                             f"({_URL_FORMS[backend]})")
        on_error = extra.get("on_backend_error", "fail")
        if on_error not in ON_BACKEND_ERROR:
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.on_backend_error must "
                             f"be one of {list(ON_BACKEND_ERROR)}, got {on_error!r}")
        load_policy = extra.get("load_policy", "auto")
        if load_policy not in LOAD_POLICIES:
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.load_policy must be "
                             f"one of {list(LOAD_POLICIES)}, got {load_policy!r}")
        save_decode = extra.get("save_decode_blocks", False)
        if not isinstance(save_decode, bool):
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.save_decode_blocks "
                             f"must be true or false, got {save_decode!r}")
        load_mode = extra.get("load_mode", "async")
        if load_mode not in LOAD_MODES:
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.load_mode must be one "
                             f"of {list(LOAD_MODES)}, got {load_mode!r}")
        remote_url = extra.get("remote_url")
        if remote_url is not None and parse_url(remote_url)[0] not in ("redis", "mooncake"):
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.remote_url must be a "
                             f"redis or mooncake address, got {remote_url!r}")
        remote_options = extra.get("remote_options")
        if remote_options is not None and (remote_url is None
                                           or not isinstance(remote_options, dict)):
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.remote_options must be "
                             f"a dict of the remote_url backend's options (with remote_url), "
                             f"got {remote_options!r}")
        settings = cls(backend=backend, url=url, on_backend_error=on_error,
                       model_id=extra.get("model_id"), load_policy=load_policy,
                       save_decode_blocks=save_decode, load_mode=load_mode,
                       backend_options={k: v for k, v in extra.items() if k in option_names})
        for name in ("timeout_s", "lookup_timeout_s", "retry_interval_s"):
            value = extra.get(name, getattr(settings, name))
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 < value < 3600):
                raise ValueError(f"KVPoolConnector: kv_connector_extra_config.{name} must be a "
                                 f"number of seconds in (0, 3600), got {value!r}")
            object.__setattr__(settings, name, float(value))
        staging = extra.get("staging_bytes", settings.staging_bytes)
        if staging is not None and (isinstance(staging, bool) or not isinstance(staging, int)
                                    or staging <= 0):
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.staging_bytes must be "
                             f"a positive integer number of bytes, got {staging!r}")
        object.__setattr__(settings, "staging_bytes", staging)
        if settings.model_id is not None and (not isinstance(settings.model_id, str)
                                              or not settings.model_id.strip()):
            raise ValueError(f"KVPoolConnector: kv_connector_extra_config.model_id must be a "
                             f"non-empty string, got {settings.model_id!r}")
        return settings

    def staging_size(self, spec: KVCacheSpec) -> int:
        """`staging_bytes`, or by default room for a step's loads (the load half) and two steps'
        saves (the save half: one step's puts may still be in flight), at least 256 MiB. On an
        H100 a 256 MiB default dropped 70% of an 8,192-token step's saves (Qwen3-0.6B: 0.94 GB
        of KV per such step)."""
        if self.staging_bytes is not None:
            return self.staging_bytes
        per_step = spec.max_tokens_per_step * slot_stride(spec) // spec.block_size
        return max(MIN_STAGING_BYTES, 4 * per_step)

    def num_staging_slots(self, spec: KVCacheSpec) -> int:
        """Slots of the host staging buffer (at least MIN_SLOTS, else a ValueError)."""
        staging = self.staging_size(spec)
        slots = staging // slot_stride(spec)
        if slots < MIN_SLOTS:
            raise ValueError(
                f"KVPoolConnector: kv_connector_extra_config.staging_bytes ({staging})"
                f" holds {slots} KV blocks; it needs at least {MIN_SLOTS} "
                f"({MIN_SLOTS * slot_stride(spec)} bytes: a block of {spec.num_layers} layers "
                f"is {spec.bytes_per_block} bytes)")
        return slots


_URL_FORMS = {"local": "local", "redis": "redis://HOST:PORT[/DB]",
              "mooncake": "mooncake://MASTER_HOST:PORT", "shm": "shm://127.0.0.1:PORT"}


def slot_stride(spec: KVCacheSpec) -> int:
    """Bytes between two staging slots: one value (payload and trailer), aligned."""
    size = value_size(spec.bytes_per_block)
    return -(-size // SLOT_ALIGN) * SLOT_ALIGN


def key_prefix(spec: KVCacheSpec, model_id: str | None = None) -> str:
    """What every key of this rank's values starts with; the chained block hash (hex) follows."""
    model = model_id or spec.model
    # The framing's version too: values of another format are never found under these keys,
    # so a content-addressed put (which keeps a key's value) never leaves them in the way.
    identity = (f"{model}|{spec.dtype}|bs{spec.block_size}|{spec.layout}|{VALUE_LAYOUT}"
                f"|L{spec.num_layers}|h{spec.num_kv_heads}x{spec.head_dim}|f{FORMAT_VERSION}")
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    tag = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/").rsplit("/", 1)[-1])[:48] or "model"
    return f"sluice/{tag}/{digest}/tp{spec.tp_rank}-{spec.tp_size}/"


class BackendHealth:
    """Whether one backend client is usable: the first failure of an outage is logged as a
    warning (never once per request), calls are skipped while down and tried again every
    `retry_interval_s`; the first success after an outage is logged too."""

    def __init__(self, address: str, who: str, retry_interval_s: float,
                 consequence: str) -> None:
        self.address = address
        self.who = who
        self.retry_interval_s = retry_interval_s
        self.consequence = consequence
        self.up = True
        self.num_outages = 0
        self._next_try = 0.0
        self._lock = threading.Lock()

    def should_try(self) -> bool:
        """True while up; while down, True once per retry interval (that call is the probe)."""
        with self._lock:
            if self.up:
                return True
            now = time.monotonic()
            if now < self._next_try:
                return False
            self._next_try = now + self.retry_interval_s
            return True

    def failed(self, exc: BaseException) -> str:
        """Record a failed call; returns the error's kind ("timeout" or "unavailable")."""
        kind = "timeout" if isinstance(exc, PoolTimeout) else "unavailable"
        with self._lock:
            self._next_try = time.monotonic() + self.retry_interval_s
            if not self.up:
                return kind
            self.up = False
            self.num_outages += 1
        logger.warning("KV pool at %s unreachable from the %s (%s): %s; retrying every %.1f s",
                       self.address, self.who, exc, self.consequence, self.retry_interval_s)
        return kind

    def succeeded(self) -> None:
        with self._lock:
            if self.up:
                return
            self.up = True
        logger.info("KV pool at %s reachable again from the %s: using it again", self.address,
                    self.who)

    def mark_down(self) -> None:
        """Down from the start (a client that could not connect): no warning of its own."""
        with self._lock:
            if self.up:
                self.up = False
                self.num_outages += 1
            self._next_try = time.monotonic() + self.retry_interval_s
