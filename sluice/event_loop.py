"""The asyncio event loop of a process's main coroutine: uvloop when it is installed (a cheaper
loop per event), else asyncio's own."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def running_loop_name() -> str:
    """"uvloop" or "asyncio": the loop this coroutine runs on."""
    return ("uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop")
            else "asyncio")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if not hasattr(uvloop, "run"):  # uvloop < 0.18
        return asyncio.run(main)
    return uvloop.run(main)
