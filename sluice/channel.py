"""Typed, versioned frames for every socket between sluice processes (front end <-> engine
core, engine core <-> workers, prefill <-> decode).

A frame is one msgpack map encoded by msgspec from a `Message` subclass: `type` is its tag,
`version` is SCHEMA_VERSION. Decoding is typed (the receiver names the union it accepts), so a
frame of the wrong shape, an unknown type or another schema version raises `WireError` saying
what was wrong. No pickle anywhere.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sluice.core.outputs import SCHEMA_VERSION


class WireError(ValueError):
    """A frame that is not a valid message of the expected kind."""


class WireVersionError(WireError):
    """A frame of another schema version."""


class Message(msgspec.Struct, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    version: int = SCHEMA_VERSION


class _VersionProbe(msgspec.Struct):
    """Reads only `version` from any map frame, to tell a version mismatch from a bad frame."""

    version: int | None = None


class MessageDecoder:
    """Decodes frames into one of the message types of `message_type` (a Message subclass or
    a union of them); `kind` and `peers` name the channel in errors."""

    def __init__(self, message_type: Any, kind: str, peers: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._probe = msgspec.msgpack.Decoder(_VersionProbe)
        self._kind = kind
        self._peers = peers

    def decode(self, frame: bytes | memoryview) -> Any:
        try:
            message = self._decoder.decode(frame)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._check_version(frame)
            raise WireError(f"malformed {self._kind} frame ({len(frame)} bytes): {exc}") from None
        if message.version != SCHEMA_VERSION:
            raise WireVersionError(self._version_text(message.version))
        return message

    def _check_version(self, frame: bytes | memoryview) -> None:
        try:
            version = self._probe.decode(frame).version
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        if version is not None and version != SCHEMA_VERSION:
            raise WireVersionError(self._version_text(version)) from None

    def _version_text(self, version: object) -> str:
        return (f"{self._kind} frame has wire schema version {version!r}, this side speaks "
                f"version {SCHEMA_VERSION}: {self._peers} are from different sluice versions")


class Encoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: Message) -> bytes:
        return self._encoder.encode(message)
