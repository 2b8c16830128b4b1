"""The Redis pool backend: a real `redis-server` through redis-py (with hiredis), pipelined.

- A put is `SET key value NX` (content-addressed: an existing key keeps its value; `NX` answers
  None for it, which is still a success). Values go out as memoryviews of the staging buffer
  (redis-py sends large arguments without copying them into the command).
- A get is `GET`; the value is copied into its slot. Exists is `EXISTS` per key, pipelined.
- Chunks of 100 commands per pipeline (measured here: pipelines of about 100 are faster than one
  huge pipeline), without MULTI (no transaction: each command stands alone).
- Bounds: socket connect and read timeouts of `timeout_s`, no retries inside redis-py (its
  default retries with backoff would stretch a dead server into seconds), and a deadline checked
  between chunks. Refused or dropped connections raise `PoolUnavailable`, a silent server
  `PoolTimeout`. The connection pool reconnects on the next call, so calls work again as soon as
  the server is back (a restarted server without persistence starts empty: every key a miss).
- Eviction is the server's business: give it `--maxmemory` and `--maxmemory-policy allkeys-lru`
  and an evicted key is a miss. Under `noeviction` a full server fails puts (False).
- `count_keys` is `SCAN MATCH prefix*` (glob characters in the prefix escaped).
"""

from __future__ import annotations

import re
import time

from sluice.kv_transfer.pool.backend import PoolBackend

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # the `pool` extra is not installed
    redis = None


class RedisBackend(PoolBackend):
    backend_name = "redis"
    max_keys_per_call = 100
    max_keys_per_lookup = 1000  # EXISTS per key, one pipeline

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, *, db: int = 0,
                 timeout_s: float = 5.0, password: str | None = None) -> None:
        super().__init__(f"{host}:{port}/{db}" if db else f"{host}:{port}", timeout_s)
        if redis is None:
            raise ImportError("the redis pool backend needs redis-py: "
                              "pip install 'redis[hiredis]' (or sluice[pool])")
        self.host, self.port, self.db, self._password = host, port, db, password
        self._client = self._make_client()
        self._call(self._client.ping, time.monotonic() + self.timeout_s)

    def set_timeout(self, timeout_s: float) -> None:
        super().set_timeout(timeout_s)
        # The socket timeouts are fixed per client: a new one (it connects on its first call).
        old, self._client = self._client, self._make_client()
        old.close()

    def _make_client(self):  # noqa: ANN202 (redis.Redis, an optional import)
        return redis.Redis(
            host=self.host, port=self.port, db=self.db, password=self._password,
            socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
            single_connection_client=False)

    def _call(self, fn, deadline: float, *args):
        self._check_deadline(deadline)
        try:
            return fn(*args)
        except redis.TimeoutError as exc:
            raise self.timed_out(f"no answer within {self.timeout_s:g} s ({exc})") from exc
        except redis.ConnectionError as exc:
            raise self.unavailable(f"cannot reach the server ({exc})") from exc
        except redis.ResponseError as exc:
            # e.g. LOADING, or MISCONF: the server is up but cannot serve.
            raise self.unavailable(f"server refused the call ({exc})") from exc

    def _pipeline(self, deadline: float, fill) -> list:
        pipe = self._client.pipeline(transaction=False)
        fill(pipe)
        return self._call(lambda: pipe.execute(raise_on_error=False), deadline)

    def _exists(self, keys: list[str], deadline: float) -> list[bool]:
        def fill(pipe) -> None:
            for key in keys:
                pipe.exists(key)
        return [reply == 1 for reply in self._pipeline(deadline, fill)]

    def _put(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[bool]:
        view = self._buffer

        def fill(pipe) -> None:
            for key, offset, size in zip(keys, offsets, sizes):
                pipe.set(key, view[offset:offset + size], nx=True)
        # True: stored now; None: the key existed (kept); an exception object: not stored
        # (e.g. OOM under maxmemory with noeviction).
        return [reply is True or reply is None for reply in self._pipeline(deadline, fill)]

    def _get(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[int]:
        view = self._buffer

        def fill(pipe) -> None:
            for key in keys:
                pipe.get(key)
        received = []
        for reply, offset, size in zip(self._pipeline(deadline, fill), offsets, sizes):
            if not isinstance(reply, bytes) or len(reply) > size:
                received.append(-1)
                continue
            view[offset:offset + len(reply)] = reply
            received.append(len(reply))
        return received

    def count_keys(self, prefix: str = "") -> int:
        self._check_open()
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*"
        deadline = time.monotonic() + self.timeout_s
        cursor, found = 0, set()
        while True:  # SCAN may return a key twice (while the server rehashes): count a set
            cursor, batch = self._call(
                lambda c=cursor: self._client.scan(cursor=c, match=pattern, count=1000), deadline)
            found.update(batch)
            if cursor == 0:
                return len(found)

    def _close(self) -> None:
        self._client.close()
