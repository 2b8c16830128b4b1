"""Checks of configuration values given by users, shared by the frozen configs
(sluice/config.py, sluice/spec_decode/config.py) and the engine arguments."""

from __future__ import annotations


def verify_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
