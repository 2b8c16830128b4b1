"""Errors that cross the engine's layers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot go on: its core process or one of its workers is gone (crashed,
    killed, shut down, or failed to start); the text says which and why."""
