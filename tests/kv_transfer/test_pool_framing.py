"""The pool's value trailer (framing.py), without a store: what `verify` calls each kind of bad
value, and that the hash binds the key and every payload byte."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from sluice.kv_transfer.pool import framing
from sluice.kv_transfer.pool.framing import TRAILER_SIZE, Verdict, frame, value_size, verify

SIZE = 4096 + 8


def staged(value: bytes, slot: int = value_size(SIZE)) -> memoryview:
    buffer = bytearray(slot)
    buffer[:len(value)] = value
    return memoryview(buffer)


def payload(seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, SIZE, np.uint8).tobytes()


def test_a_sealed_value_verifies_only_under_its_own_key() -> None:
    view = staged(payload())
    framing.seal(view, 0, SIZE, "sluice/m/abc/tp0-1/00ff")
    assert verify(view, 0, SIZE, "sluice/m/abc/tp0-1/00ff", value_size(SIZE)) is Verdict.INTACT
    assert bytes(view) == frame("sluice/m/abc/tp0-1/00ff", payload())
    for other in ("sluice/m/abc/tp0-1/00fe", "sluice/m/abc/tp0-1/00ff0", "sluice/m/abc/tp0-1/00f"):
        assert verify(view, 0, SIZE, other, value_size(SIZE)) is Verdict.CORRUPT, other


@pytest.mark.parametrize("position", [0, 1, SIZE // 2, SIZE - 1])
def test_any_flipped_payload_bit_fails_the_check(position: int) -> None:
    value = bytearray(frame("k", payload(1)))
    value[position] ^= 0x10
    assert verify(staged(bytes(value)), 0, SIZE, "k", len(value)) is Verdict.CORRUPT


def test_each_kind_of_bad_value_gets_its_verdict() -> None:
    good = payload(2)
    future = bytearray(frame("k", good))
    future[-4:] = struct.pack("<I", framing.FORMAT_VERSION + 1)
    format1 = good + struct.pack("<II", zlib.crc32(good, zlib.crc32(b"k")), SIZE)
    bad_length = bytearray(frame("k", good))
    bad_length[-8:-4] = struct.pack("<I", SIZE + 1)
    cases = {  # name: (stored bytes, bytes received, key read, verdict)
        "missing": (b"", -1, "k", Verdict.MISSING),
        "format 1 (crc32)": (format1, len(format1), "k", Verdict.OTHER_FORMAT),
        # Its crc32 fails: not a format-1 value of this key, only bytes of another size.
        "format 1 of another key": (format1, len(format1), "j", Verdict.WRONG_SIZE),
        "a later format": (bytes(future), len(future), "k", Verdict.OTHER_FORMAT),
        "length field": (bytes(bad_length), len(bad_length), "k", Verdict.CORRUPT),
        "zeros": (bytes(value_size(SIZE)), value_size(SIZE), "k", Verdict.CORRUPT),
        "truncated": (frame("k", good)[:-1], value_size(SIZE) - 1, "k", Verdict.WRONG_SIZE),
        "another payload size": (frame("k", good[:-8]), value_size(SIZE) - 8, "k",
                                 Verdict.WRONG_SIZE),
    }
    for name, (value, received, key, expected) in cases.items():
        assert verify(staged(value), 0, SIZE, key, received) is expected, name
    assert TRAILER_SIZE == 16
