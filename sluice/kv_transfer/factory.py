"""Connector names -> implementations.

`kv_transfer_config.kv_connector` names a connector class: one built into sluice (below), or
one in `kv_connector_module_path` (a module path, for connectors written outside sluice and
for tests). A connector class holds its two halves as `Scheduler` and `Worker`
(KVConnectorScheduler and KVConnectorWorker subclasses); the scheduler half's `metadata_type`
is the struct of its per-step plan.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

from sluice.config import EngineConfig, KVTransferConfig
from sluice.core.kv_connector import KVCacheSpec, KVConnectorScheduler

if TYPE_CHECKING:
    from sluice.worker.kv_connector import KVConnectorWorker
    from sluice.worker.worker import ConnectorFactory

# name -> module that defines a class of that name
_BUILTIN_CONNECTORS: dict[str, str] = {
    "KVPoolConnector": "sluice.kv_transfer.pool.connector",
    "OffloadingConnector": "sluice.kv_transfer.offloading",
    "PDConnector": "sluice.kv_transfer.disagg.connector",
}


def connector_names() -> list[str]:
    return sorted(_BUILTIN_CONNECTORS)


def resolve_connector(config: KVTransferConfig) -> type:
    name = config.kv_connector
    module_path = config.kv_connector_module_path or _BUILTIN_CONNECTORS.get(name)
    if module_path is None:
        raise ValueError(f"kv_transfer_config.kv_connector {name!r} is not a known connector "
                         f"(known: {connector_names()}); a connector of your own needs "
                         "kv_connector_module_path")
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ValueError(f"kv_transfer_config.kv_connector_module_path {module_path!r} cannot "
                         f"be imported: {exc}") from None
    connector = getattr(module, name, None)
    if connector is None or not hasattr(connector, "Scheduler") or not hasattr(connector,
                                                                               "Worker"):
        raise ValueError(f"module {module_path!r} has no connector class {name!r} (a class "
                         "with Scheduler and Worker halves)")
    return connector


def create_scheduler_connector(config: KVTransferConfig,
                               kv_cache_spec: KVCacheSpec) -> KVConnectorScheduler:
    return resolve_connector(config).Scheduler(config, kv_cache_spec)


def create_worker_connector(config: KVTransferConfig,
                            kv_cache_spec: KVCacheSpec) -> KVConnectorWorker:
    return resolve_connector(config).Worker(config, kv_cache_spec)


def metadata_type(config: KVTransferConfig | None) -> type:
    """The struct type of the connector's per-step plan (NoneType without a connector)."""
    if config is None:
        return type(None)
    return resolve_connector(config).Scheduler.metadata_type


def worker_connector_factory(config: EngineConfig) -> ConnectorFactory | None:
    if config.kv_transfer_config is None:
        return None
    resolve_connector(config.kv_transfer_config)  # fail now, with the name, if it is unknown
    return functools.partial(create_worker_connector, config.kv_transfer_config)
