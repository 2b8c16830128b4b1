"""The per-request `kv_transfer_params` of prefill/decode disaggregation, as a router sends them
(SGLang's bootstrap names, vLLM's `do_remote_*` flags):

    to the prefill   {"do_remote_decode": true, "bootstrap_room": R}
    to the decode    {"do_remote_prefill": true, "bootstrap_host": H, "bootstrap_port": P,
                      "bootstrap_room": R}

R is the request's room: a random integer in [0, 2**63) chosen per attempt by the router, the
key both instances file the transfer under. A prefill request with `do_remote_decode` computes
the prompt and one token (its engine caps max_tokens at 1) and hands both to the decode side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_ROOM = 2**63


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """Prefill side: send this request's KV and first token to whoever asks for `room`."""

    room: int


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Decode side: fetch this request's KV and first token from the prefill instance whose
    bootstrap server is at host:port, filed under `room`."""

    host: str
    port: int
    room: int

    @property
    def bootstrap_address(self) -> str:
        return f"{self.host}:{self.port}"


_KEYS = ("do_remote_decode", "do_remote_prefill", "bootstrap_host", "bootstrap_port",
         "bootstrap_room")


def parse(params: Any) -> RemoteDecode | RemotePrefill | None:
    """The PD instruction in a request's kv_transfer_params (None: a plain request). Raises
    ValueError naming the bad field; other keys (another connector's) are left alone."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {params!r}")
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    if not decode and not prefill:
        return None
    if decode and prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are "
                         "exclusive (a request is either the prefill or the decode half)")
    room = params.get("bootstrap_room")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_ROOM:
        raise ValueError(f"kv_transfer_params.bootstrap_room must be an integer in "
                         f"[0, 2**63), got {room!r}")
    if decode:
        return RemoteDecode(room)
    host, port = params.get("bootstrap_host"), params.get("bootstrap_port")
    if not isinstance(host, str) or not host:
        raise ValueError(f"kv_transfer_params.bootstrap_host must be a host name, "
                         f"got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.bootstrap_port must be a port in [1, 65535], "
                         f"got {port!r}")
    return RemotePrefill(host, port, room)


def parse_or_none(params: Any) -> RemoteDecode | RemotePrefill | None:
    """As `parse`, but a malformed instruction is None (the engine never raises on a request;
    the server refuses bad params with a 400 before they get here)."""
    try:
        return parse(params)
    except ValueError:
        return None
