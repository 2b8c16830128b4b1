"""How the router picks an instance of a role (sgl-router's policies).

- round_robin: in turn.
- least_loaded: the fewest requests in flight through this router (ties in turn).
- cache_aware: prompt-prefix affinity. The prompt's text is cut into chunks of `chunk_chars`;
  the chain of chunk hashes is looked up in a bounded LRU table of which instance last served
  each chain. The instance holding the longest matching prefix gets the request if the match
  covers at least `match_threshold` of the prompt and it is not much busier than the least
  loaded one (`balance_slack` requests); otherwise the least loaded does. Either way the chain
  is recorded for the chosen instance, so repeated prefixes land where their KV is cached.
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict

from sluice.router.workers import Worker

POLICIES = ("round_robin", "least_loaded", "cache_aware")


class Policy(ABC):
    uses_prompt = False  # whether pick() reads its prompt (else the router passes "")

    @abstractmethod
    def pick(self, workers: list[Worker], prompt: str) -> Worker:
        """The worker for this prompt, of `workers` (healthy, non-empty)."""


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: list[Worker], prompt: str) -> Worker:
        return workers[next(self._counter) % len(workers)]


class LeastLoaded(Policy):
    def __init__(self) -> None:
        self._turn = RoundRobin()

    def pick(self, workers: list[Worker], prompt: str) -> Worker:
        least = min(w.in_flight for w in workers)
        return self._turn.pick([w for w in workers if w.in_flight == least], prompt)


class CacheAware(Policy):
    uses_prompt = True

    def __init__(self, chunk_chars: int = 64, match_threshold: float = 0.5,
                 balance_slack: int = 8, max_entries: int = 200_000) -> None:
        self.chunk_chars = chunk_chars
        self.match_threshold = match_threshold
        self.balance_slack = balance_slack
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # chain hash -> worker url
        self._least = LeastLoaded()

    def _chain(self, prompt: str) -> list[bytes]:
        chain, parent = [], b""
        for start in range(0, len(prompt), self.chunk_chars):
            parent = hashlib.blake2b(parent + prompt[start:start + self.chunk_chars].encode(
                errors="surrogatepass"), digest_size=16).digest()
            chain.append(parent)
        return chain

    def pick(self, workers: list[Worker], prompt: str) -> Worker:
        chain = self._chain(prompt)
        by_url = {w.url: w for w in workers}
        least = min(w.in_flight for w in workers)
        chosen = None
        for depth in range(len(chain), 0, -1):
            owner = by_url.get(self._owner.get(chain[depth - 1], ""))
            if owner is not None:
                if (depth / len(chain) >= self.match_threshold
                        and owner.in_flight <= least + self.balance_slack):
                    chosen = owner
                break
        if chosen is None:
            chosen = self._least.pick(workers, prompt)
        for key in chain:
            self._owner[key] = chosen.url
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return chosen


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "cache_aware":
        return CacheAware()
    raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
