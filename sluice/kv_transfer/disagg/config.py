"""The settings of prefill/decode disaggregation, from `kv_transfer_config`:

    {"kv_connector": "PDConnector", "kv_role": "kv_producer" | "kv_consumer",
     "kv_connector_extra_config": {"transfer_backend": "auto" | "shm" | "mooncake" | "fake",
                                   "bootstrap_port": 8998, ...}}

(or `sluice serve --disaggregation-mode prefill|decode --disaggregation-bootstrap-port N
--disaggregation-transfer-backend auto|shm|mooncake|fake`, which builds the same). Every key of the
extra config is a field of PDConfig; unknown keys and bad values are errors naming them.
"""

from __future__ import annotations

import dataclasses
import socket
import uuid
from dataclasses import dataclass, fields

from sluice.config import KVTransferConfig

# auto: shm with a prefill on this host, else mooncake (transfer.choose_backend).
BACKENDS = ("auto", "shm", "mooncake", "fake")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default
# Transfers per Mooncake batch: TCP batches above the per-peer queue limit fail.
MAX_BATCH_DESCRIPTORS = 1024


@dataclass(frozen=True)
class PDConfig:
    role: str  # "prefill" | "decode"
    engine_id: str
    transfer_backend: str = "auto"
    # The address this instance binds its sockets to and tells its peers.
    host: str = "127.0.0.1"
    # Prefill: its bootstrap server's port (0: a free one, logged).
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    # Decode: probe each prefill it has rooms with every interval; after `heartbeat_misses`
    # failed probes in a row, every unfinished room of that prefill fails. A lost prefill is
    # noticed within heartbeat_bound_s.
    heartbeat_interval_s: float = 2.5
    heartbeat_misses: int = 2
    heartbeat_timeout_s: float = 1.0
    # Decode: longest wait for a prefill's route (its bootstrap server answering 503 or not at
    # all), and for a room's final status once its transfer request is sent.
    bootstrap_timeout_s: float = 60.0
    waiting_timeout_s: float = 120.0
    # Prefill: longest hold of a finished request's blocks for a decode that never asks.
    send_lease_s: float = 120.0
    # Prefill ranks: how long registering with the bootstrap server is retried.
    register_timeout_s: float = 120.0
    max_batch_descriptors: int = MAX_BATCH_DESCRIPTORS
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    # Prefill: write each layer's blocks of a step as soon as the layer's KV is stored (the
    # transfer overlaps the rest of the forward; the step ends once its writes have landed),
    # rather than the whole prompt after it is done. The status still goes out only when every
    # block of every layer is there. On by default: benchmarks/journal/2026-12-02-pd-layerwise.md.
    layerwise: bool = True
    # Prefill, layer-wise: hold a new request (it waits, others go ahead) until every rank of
    # this instance has its decode's ask for the room, for at most this long, so its first
    # step's layers already stream (SGLang's bootstrap queue); then it computes anyway and its
    # blocks go in the room's whole write. 0: compute at once.
    bootstrap_wait_s: float = 1.0
    # Only prompts with at least this many tokens past their prefix-cache hit are held; shorter
    # ones compute at once, and an ask that comes while they compute still joins their layer
    # writes. 0: hold every prompt. On one H200 (8B, MPS) holding cost more than it saved at
    # 1k tokens and saved more than it cost at 8k under load:
    # benchmarks/journal/2026-12-03-pd-ask-window-hold-ab-h200.md.
    bootstrap_wait_min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"PDConnector role must be prefill or decode, got {self.role!r}")
        if self.transfer_backend not in BACKENDS:
            raise ValueError(f"PDConnector transfer_backend must be one of {BACKENDS}, "
                             f"got {self.transfer_backend!r}")
        port = self.bootstrap_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"PDConnector bootstrap_port must be in [0, 65535], got {port!r}")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "bootstrap_timeout_s",
                     "waiting_timeout_s", "send_lease_s", "register_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"PDConnector {name} must be a number > 0, got {value!r}")
        wait = self.bootstrap_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 60:
            raise ValueError(f"PDConnector bootstrap_wait_s must be a number in [0, 60], got "
                             f"{wait!r}")
        least = self.bootstrap_wait_min_tokens
        if isinstance(least, bool) or not isinstance(least, int) or least < 0:
            raise ValueError(f"PDConnector bootstrap_wait_min_tokens must be an integer >= 0, "
                             f"got {least!r}")
        for name in ("heartbeat_misses", "max_batch_descriptors"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PDConnector {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"PDConnector layerwise must be true or false, got "
                             f"{self.layerwise!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"PDConnector host must be a host name, got {self.host!r}")

    @property
    def heartbeat_bound_s(self) -> float:
        """The longest a lost prefill goes unnoticed (misses in a row, plus the probe that was
        just about to start, plus its timeout)."""
        return (self.heartbeat_misses + 1) * self.heartbeat_interval_s + self.heartbeat_timeout_s

    @property
    def lease_s(self) -> float:
        """What decode grants a prefill to finish writing a room: its own waiting timeout
        less a margin for the request's flight, so the prefill stops writing before decode
        gives up on the room and frees its blocks."""
        return max(self.waiting_timeout_s - min(2.0, self.waiting_timeout_s / 4), 0.001)

    @classmethod
    def from_kv_transfer_config(cls, config: KVTransferConfig) -> PDConfig:
        roles = {"kv_producer": "prefill", "kv_consumer": "decode"}
        if config.kv_role not in roles:
            raise ValueError(f"PDConnector: kv_role must be kv_producer (a prefill instance) "
                             f"or kv_consumer (a decode instance), got {config.kv_role!r}")
        extra = dict(config.kv_connector_extra_config)
        known = {f.name for f in fields(cls)} - {"role", "engine_id"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"PDConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"allowed: {sorted(known)}")
        engine_id = config.engine_id or f"{roles[config.kv_role]}-{uuid.uuid4().hex[:12]}"
        return cls(role=roles[config.kv_role], engine_id=engine_id, **extra)

    def replace(self, **changes: object) -> PDConfig:
        return dataclasses.replace(self, **changes)


def with_bootstrap_port_chosen(config: KVTransferConfig) -> KVTransferConfig:
    """A prefill's config with bootstrap_port 0 made a free port now: the bootstrap server (in
    the scheduler half) and the ranks that register with it (the worker halves, maybe other
    processes) must agree on it before either starts."""
    extra = config.kv_connector_extra_config
    if config.kv_role != "kv_producer" or extra.get("bootstrap_port", 1) != 0:
        return config
    with socket.socket() as probe:
        probe.bind((extra.get("host", "127.0.0.1"), 0))
        port = probe.getsockname()[1]
    return dataclasses.replace(config, kv_connector_extra_config={**extra,
                                                                  "bootstrap_port": port})
