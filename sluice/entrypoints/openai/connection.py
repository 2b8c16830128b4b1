"""What the API server and the router share of HTTP serving, without the engine: binding the
listening socket, and running a non-streaming handler until its client goes away. Importing it
imports no PyTorch, so the router (which runs no model) starts in a fraction of the time."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) before the model loads, so a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off only on sockets whose
    # proto says TCP, and accepted sockets copy the listener's. With Nagle on, a response's
    # second small write on a kept-alive connection waited for the client's delayed ACK: +40 ms
    # to the first token of every request after a connection's first (measured on loopback).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run a non-streaming handler's work; if the client goes away first, cancel it (which
    aborts its requests in the engine), wait for it to wind down, and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled
        watcher.cancel()
        task.cancel()
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        # cancel() only asks: the task is done once its cleanup (the abort) has run.
        await asyncio.wait((task,))
        return None
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
