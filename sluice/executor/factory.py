"""The executor an engine config asks for (`distributed_executor_backend`)."""

from __future__ import annotations

from sluice.config import EngineConfig
from sluice.executor.base import Executor


def create_executor(config: EngineConfig) -> Executor:
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from sluice.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    if backend == "mp":
        from sluice.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    raise ValueError(f"distributed_executor_backend must be 'uni' or 'mp', got {backend!r}")
