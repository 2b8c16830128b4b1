"""A wake-up for the engine core's busy loop, for threads that make work without a message.

While every request waits on a KV transfer (a decode's receive, a prefill room held for its
decode's ask or finishing its send), the loop waits on its input socket between the steps that
poll the workers. A connector's thread in this process (a PD KV manager that has a room's
status, a decode's ask) calls `notify()`, and the loop steps at once instead of at the end of
its wait: an eventfd polled beside the input socket.

Only the engine core's process makes the fd (`fd()`); elsewhere (a worker process of a tensor-
parallel engine, a test without a loop) `notify()` does nothing, and the loop's polling
interval bounds the delay as before.
"""

from __future__ import annotations

import os

_fd: int | None = None


def fd() -> int:
    """The eventfd the loop polls (made on the first call)."""
    global _fd
    if _fd is None:
        _fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    return _fd


def notify() -> None:
    if _fd is not None:
        try:
            os.eventfd_write(_fd, 1)
        except BlockingIOError:  # the counter is full: a wake-up is pending anyway
            pass


def drain() -> None:
    if _fd is not None:
        try:
            os.eventfd_read(_fd)
        except BlockingIOError:
            pass
