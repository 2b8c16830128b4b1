"""Which KV heads go from which prefill rank to which decode rank, when the two instances run
different tensor-parallel sizes (heterogeneous TP).

Head layout (sluice.distributed.tp): with H KV heads at TP = N, rank r holds heads
[r * H // N, ... + max(1, H // N)): an even share when H >= N, else the one head its query
heads read, replicated on N / H ranks (MQA, and GQA with fewer KV heads than ranks).

Pairing, for prefill TP P and decode TP D (one must be a multiple of the other, k the ratio;
anything else is refused, naming both sizes):

- P = k * D: decode rank d asks prefill ranks d * k ... d * k + k - 1, whose heads together
  are d's; each writes its heads into d's cache at their offset. A head replicated on several
  of those ranks is written by the first of them only; the others are asked all the same, with
  nothing to write, so every prefill rank learns the room is done and frees its blocks.
- D = k * P: decode rank d asks prefill rank d // k, which writes to each of its k askers the
  heads that rank holds (a replicated head goes to every decode rank holding it: each computes
  with its own copy).
- P = D: rank r asks rank r for all its heads (the homogeneous transfer).

So every prefill rank is asked by max(1, D / P) decode ranks, every decode rank asks
max(1, P / D) prefill ranks, and every head of every decode rank is written exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.distributed.head_split import first_kv_head, kv_heads_per_rank


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """What one prefill rank writes into one decode rank: `num_heads` heads from its own head
    `src_head` on into the decode rank's head `dst_head` on (indices among each rank's own
    heads). num_heads == 0: nothing (a replica another prefill rank sends)."""

    prefill_rank: int
    decode_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def held_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads that rank `rank` of `tp_size` holds."""
    first = first_kv_head(num_kv_heads, tp_size, rank)
    return range(first, first + kv_heads_per_rank(num_kv_heads, tp_size))


def check_tp_pair(prefill_tp: int, decode_tp: int) -> None:
    """ValueError naming both sizes unless one is a multiple of the other."""
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise ValueError(
            f"tensor-parallel size mismatch: the prefill instance has {prefill_tp} ranks, the "
            f"decode instance {decode_tp}; one must be a multiple of the other (prefill TP = k "
            "x decode TP, or decode TP = k x prefill TP: --tensor-parallel-size)")


def prefill_peers(prefill_tp: int, decode_tp: int, decode_rank: int) -> list[int]:
    """The prefill ranks decode rank `decode_rank` asks, in rank order."""
    if prefill_tp >= decode_tp:
        k = prefill_tp // decode_tp
        return list(range(decode_rank * k, decode_rank * k + k))
    return [decode_rank // (decode_tp // prefill_tp)]


def decode_peers(prefill_tp: int, decode_tp: int, prefill_rank: int) -> list[int]:
    """The decode ranks that ask prefill rank `prefill_rank`, in rank order."""
    if prefill_tp >= decode_tp:
        return [prefill_rank // (prefill_tp // decode_tp)]
    k = decode_tp // prefill_tp
    return list(range(prefill_rank * k, prefill_rank * k + k))


def plan_slices(num_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int
                ) -> list[HeadSlice]:
    """One HeadSlice per prefill rank that decode rank `decode_rank` asks: together they
    write each of its heads exactly once (the first holder of a replicated head sends it)."""
    check_tp_pair(prefill_tp, decode_tp)
    wanted = held_heads(num_kv_heads, decode_tp, decode_rank)
    covered = wanted.start
    slices = []
    for prefill_rank in prefill_peers(prefill_tp, decode_tp, decode_rank):
        held = held_heads(num_kv_heads, prefill_tp, prefill_rank)
        start, end = max(covered, held.start), min(wanted.stop, held.stop)
        if start >= end:
            slices.append(HeadSlice(prefill_rank, decode_rank, 0, 0, 0))
            continue
        if start != covered:
            raise ValueError(f"decode rank {decode_rank} of {decode_tp}: heads {covered}.."
                             f"{start - 1} are held by none of its prefill ranks")
        slices.append(HeadSlice(prefill_rank, decode_rank, start - held.start,
                                start - wanted.start, end - start))
        covered = end
    if covered != wanted.stop:
        raise ValueError(f"decode rank {decode_rank} of {decode_tp}: heads {covered}.."
                         f"{wanted.stop - 1} are held by none of its prefill ranks")
    return slices


def slice_for(num_kv_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int,
              decode_rank: int) -> HeadSlice:
    """What prefill rank `prefill_rank` writes into decode rank `decode_rank`; ValueError
    if that decode rank does not ask this prefill rank."""
    for heads in plan_slices(num_kv_heads, prefill_tp, decode_tp, decode_rank):
        if heads.prefill_rank == prefill_rank:
            return heads
    raise ValueError(f"decode rank {decode_rank} of {decode_tp} asked prefill rank "
                     f"{prefill_rank} of {prefill_tp}, which is not one of its peers (it asks "
                     f"{prefill_peers(prefill_tp, decode_tp, decode_rank)})")
