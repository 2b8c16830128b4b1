"""KVPoll: where one request's KV transfer stands, on one rank and across ranks.

Ordered so that the minimum across ranks is the request's state (a request is only as far as
its slowest rank, and one failed rank fails it): Failed = 0 < Bootstrapping = 1 <
WaitingForInput = 2 < Transferring = 3 < Success = 4. Updates only move forward (`max`), and
Failed, once reached, stays: a late "Transferring" from a peer never revives a failed room.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1  # looking up the peer (decode: the prefill's route; prefill: decode's ask)
    WaitingForInput = 2  # peer known; waiting for the other half (decode's ask or the KV)
    Transferring = 3  # blocks are moving
    Success = 4  # every block written, first token delivered

    @property
    def is_done(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


def advance(current: KVPoll, new: KVPoll) -> KVPoll:
    """The state after `new` is reported in state `current`: forward only, Failed sticky."""
    if current == KVPoll.Failed:
        return KVPoll.Failed
    if new == KVPoll.Failed:
        return KVPoll.Failed
    return max(current, new)


def consensus(states: Iterable[KVPoll]) -> KVPoll:
    """The request's state across ranks: the minimum (Failed if any rank failed)."""
    return min(states, default=KVPoll.Failed)
