"""Two pool backends as one: a near tier (the host's shared tier, `shm`) in front of a far one
(Redis or Mooncake Store, across hosts).

    backend = create_backend("shm://127.0.0.1:7070", remote_url="redis://10.0.0.5:6379")

- exists: near, then far for the keys near lacks. get: near, then far for its misses; values
  found far are put near (promoted: the next get on this host is near). put: near and far; True
  where either took the value.
- A tier that fails (PoolUnavailable, PoolTimeout) counts as holding nothing for that call; a
  call raises only when both fail (the far tier's error). Each tier is given half of `timeout_s`,
  so a call stays within it (a far hit's promotion near may add up to another half).
- `busy` is the far tier's (Mooncake's native call that timed out and goes on): while it is,
  every call is refused before touching a slot, and a far timeout that leaves it busy is raised
  whatever the near tier did, so that the caller holds those slots (backend.py's rule).
- `count_keys` is the larger of the tiers' counts (a key is in either or both).
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.kv_transfer.pool import framing
from sluice.kv_transfer.pool.backend import PoolBackend, PoolError, PoolTimeout, _check_ints


class TieredBackend(PoolBackend):
    backend_name = "tiered"
    max_keys_per_call = 1 << 16  # the tiers split their own calls
    max_keys_per_lookup = 1 << 16

    def __init__(self, near: PoolBackend, far: PoolBackend, *, timeout_s: float) -> None:
        super().__init__(f"{near.backend_name}://{near.address} in front of "
                         f"{far.backend_name}://{far.address}", timeout_s)
        self.near, self.far = near, far
        self.set_timeout(timeout_s)

    def set_timeout(self, timeout_s: float) -> None:
        super().set_timeout(timeout_s)
        self.near.set_timeout(timeout_s / 2)
        self.far.set_timeout(timeout_s / 2)

    @property
    def busy(self) -> bool:
        return self.far.busy

    @property
    def max_value_size(self) -> int | None:
        sizes = [s for s in (self.near.max_value_size, self.far.max_value_size) if s is not None]
        return min(sizes) if sizes else None

    def _register(self, address: int, size: int) -> None:
        self.near.register_buffer(address, size)
        self.far.register_buffer(address, size)

    def _close(self) -> None:
        self.near.close()
        self.far.close()

    def _check_ready(self) -> None:
        if self.far.busy:
            raise self.unavailable("a call of the far tier that timed out still runs")

    def _far_error(self, result: object) -> PoolError | None:
        """`result` if the far call failed; raised if it timed out and still runs."""
        if not isinstance(result, PoolError):
            return None
        if isinstance(result, PoolTimeout) and self.far.busy:
            raise result
        return result

    def count_keys(self, prefix: str = "") -> int:
        self._check_open()
        counts = [count for count in (_attempt(self.near.count_keys, prefix),
                                      _attempt(self.far.count_keys, prefix))
                  if not isinstance(count, PoolError)]
        if not counts:
            raise self.unavailable("neither tier answered")
        return max(counts)

    # ---- the interface, tier by tier (each tier validates, frames and checks its own) ----

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        self._check_ready()
        keys = list(keys)
        near = _attempt(self.near.batch_exists, keys)
        found = [False] * len(keys) if isinstance(near, PoolError) else near
        missing = [i for i, hit in enumerate(found) if not hit]
        if not missing:
            return found
        far = _attempt(self.far.batch_exists, [keys[i] for i in missing])
        if self._far_error(far):
            if isinstance(near, PoolError):
                raise far
            return found
        for i, hit in zip(missing, far):
            found[i] = hit
        return found

    def stage_seconds(self) -> dict[str, float]:
        """Both tiers' host stages, summed."""
        out = self.near.stage_seconds()
        for name, seconds in self.far.stage_seconds().items():
            out[name] = out.get(name, 0.0) + seconds
        return out

    def rejections(self) -> dict[str, int]:
        """Both tiers' refused values, summed."""
        out = self.near.rejections()
        for kind, count in self.far.rejections().items():
            out[kind] = out.get(kind, 0) + count
        return out

    def batch_get(self, keys: Sequence[str], offsets: Sequence[int],
                  sizes: Sequence[int]) -> list[bool]:
        self._check_open()
        self._check_ready()
        keys = list(keys)
        offsets, sizes = _check_ints("offsets", offsets), _check_ints("sizes", sizes)
        near = _attempt(self.near.batch_get, keys, offsets, sizes)
        ok = [False] * len(keys) if isinstance(near, PoolError) else near
        missing = [i for i, hit in enumerate(ok) if not hit]
        if not missing:
            return ok
        pick = lambda values: [values[i] for i in missing]  # noqa: E731
        far = _attempt(self.far.batch_get, pick(keys), pick(offsets), pick(sizes))
        if self._far_error(far):
            if isinstance(near, PoolError):
                raise far
            return ok
        promote = [i for i, hit in zip(missing, far) if hit]
        for i in promote:
            ok[i] = True
        if promote and not isinstance(near, PoolError):
            # The slots hold whole checked values (payload and trailer): stored as they are.
            _attempt(self.near._chunked, self.near._put, [keys[i] for i in promote],
                     [offsets[i] for i in promote],
                     [framing.value_size(sizes[i]) for i in promote])
        return ok

    def batch_put(self, keys: Sequence[str], offsets: Sequence[int],
                  sizes: Sequence[int]) -> list[bool]:
        self._check_open()
        self._check_ready()
        keys = list(keys)
        offsets, sizes = _check_ints("offsets", offsets), _check_ints("sizes", sizes)
        near = _attempt(self.near.batch_put, keys, offsets, sizes)  # seals every slot
        if isinstance(near, PoolError):
            return self.far.batch_put(keys, offsets, sizes)
        far = _attempt(self._far_put_sealed, keys, offsets, sizes)
        if self._far_error(far):
            return near
        return [a or b for a, b in zip(near, far)]

    def _far_put_sealed(self, keys: list[str], offsets: list[int],
                        sizes: list[int]) -> list[bool]:
        """The far put of slots the near put sealed already (no second checksum pass)."""
        self.far._check_open()
        self.far._check_ready()
        return self.far._chunked(self.far._put, keys, offsets,
                                 [framing.value_size(size) for size in sizes])

    # PoolBackend's per-store hooks: never called, since the batch_* methods above go to the
    # tiers' own batch_* (each tier's hooks do the store's work).
    def _exists(self, keys: list[str], deadline: float) -> list[bool]:
        raise NotImplementedError("TieredBackend answers through its tiers' batch_exists")

    def _get(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[int]:
        raise NotImplementedError("TieredBackend answers through its tiers' batch_get")

    def _put(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[bool]:
        raise NotImplementedError("TieredBackend answers through its tiers' batch_put")


def _attempt(call, *args):  # noqa: ANN001, ANN202
    """The call's result, or the PoolError it raised."""
    try:
        return call(*args)
    except PoolError as exc:
        return exc

