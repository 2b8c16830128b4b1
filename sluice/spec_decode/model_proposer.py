"""Proposers that draft with a model: a smaller model (`draft_model`) or an EAGLE head (`eagle`).

Either keeps its own paged KV cache, addressed through the target's block tables and slots (the
scheduler allocates k lookahead slots past each request's tokens for it), so it stays in step
with the target through prefix-cache hits, chunked prefill, preemption and rollback without a
bookkeeping of its own: after every target step the proposer runs once over the tokens the
target just verified (and any prefill chunk), which (re)writes its KV there, then k - 1 single
token steps for the rest of the draft. Drafts are greedy (the argmax), so the rejection sampler
treats q as one-hot on them, which keeps sampling exact.

Which tokens the pass after a step covers, per scheduled request with `c` computed tokens before
the step, `n` scheduled and `T` its tokens after the step (accepted ones appended):
- draft model: positions c .. len(T) - 1 when the request sampled (the accepted tokens and the new
  one), else the chunk c .. c + n - 1; it predicts the token at len(T).
- EAGLE: position p takes the token at p + 1 and the target's hidden state at p (EAGLE-1), so the
  pass covers c .. len(T) - 2 when the request sampled, else c .. c + n - 1, and reads the
  target's hidden states of this step at those positions (the verified ones).
A rejected draft's KV in the proposer's cache is overwritten the same way as the target's.

With async scheduling the same runs on the device without the host waiting (`propose_on_device`):
how many drafts a request accepted is known to the device only, so the pass covers every position
the step could have verified (a fixed shape the host knows), stores KV only for the verified ones,
and takes the first draft at the last verified one; the drafts stay on the device, per
block-table row, for the next step's input fix-up (sluice/spec_decode/device_ngram.py).

While drafting is off that pass is skipped (sluice/worker/spec_decode.py decides, per step), and
the first pass over a request once drafting is back runs `catch_up` first: the KV of the positions
it lacks, from tokens the host knows by then; EAGLE reads the target's hidden states of those
positions from `hidden_cache`, where every target step stores them at its KV slots
(`store_hidden`, captured into the target's CUDA graphs).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from sluice.attention.kv_layout import allocate_kv_caches, bytes_per_block
from sluice.attention.metadata import AttentionMetadata
from sluice.model.attention import attention_layers, bind_kv_caches
from sluice.model.hf_config import HFModelConfig, load_hf_config
from sluice.model.loader import load_model
from sluice.spec_decode.config import SpeculativeConfig
from sluice.spec_decode.proposer_inputs import pass_inputs, step_inputs

logger = logging.getLogger("sluice")


# catch_up pads its tokens to a power of two from this many, up to this many (or max_model_len).
CATCH_UP_MIN_TOKENS = 16
CATCH_UP_MAX_TOKENS = 8192


def catch_up_tokens(num_tokens: int, max_model_len: int) -> int:
    """The token count `catch_up` runs `num_tokens` as: the next power of two from
    CATCH_UP_MIN_TOKENS while within CATCH_UP_MAX_TOKENS and max_model_len (its padding row
    takes positions from 0), else as is."""
    padded = CATCH_UP_MIN_TOKENS
    while padded < num_tokens:
        padded *= 2
    return padded if padded <= min(CATCH_UP_MAX_TOKENS, max_model_len) else num_tokens


@dataclass(slots=True)
class DeviceStep:
    """A launched step as the proposer's device pass reads it: host arrays per request row of
    the step ([B]), device tensors left where the step put them."""

    rows: np.ndarray  # block-table rows: where each row's drafts go
    query_start_loc: np.ndarray  # [B + 1] each row's tokens in the step's layout
    num_scheduled: np.ndarray  # tokens scheduled, draft slots included
    num_slots: np.ndarray  # draft slots (the tail of the scheduled tokens; 0 unless sampled)
    num_computed: np.ndarray  # the host's count before the step (the device's may be lower)
    num_blocks: np.ndarray  # blocks in each row's block table
    sample_index: np.ndarray  # row in `emitted`, -1 for a row that did not sample
    next_tokens: np.ndarray  # EAGLE: the prompt token after a chunk that did not sample
    num_wanted: np.ndarray  # drafts to propose (0: none; only rows that sampled)
    input_ids: torch.Tensor  # [>= T] the step's input ids, as fixed on the device
    positions: torch.Tensor  # [>= T]
    block_tables: torch.Tensor  # [B, width] int32
    hidden: torch.Tensor  # [>= T, H] the target's output hidden states
    emitted: torch.Tensor  # [S, W] int64 per sampled row: its tokens, -1 past `counts`
    counts: torch.Tensor  # [S] tokens each sampled row got (accepted drafts + 1)


class ModelProposer(ABC):
    """Shared by both model proposers: inputs, metadata, the draft loop."""

    # EAGLE feeds the token one position ahead of the position it writes.
    token_offset = 0

    def __init__(self, config: SpeculativeConfig, target_model: torch.nn.Module,
                 target_hf_config: HFModelConfig, dtype: torch.dtype, device: torch.device,
                 attn_backend: object, block_size: int, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.target_model = target_model
        self.target_hf_config = target_hf_config
        self.dtype = dtype
        self.device = device
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model: torch.nn.Module
        self.kv_hf_config: HFModelConfig  # the shapes of the proposer's KV cache
        # {layer_name: [2, num_blocks, block_size, KVH, D]}, addressed by the target's block ids
        self.kv_caches: dict[str, torch.Tensor] = {}
        # propose_on_device's index arrays: two pinned buffers used in turn, each with the
        # event of its last copy (the host rewrites one only once that copy has left).
        self._pin = device.type == "cuda"
        self._staging = [torch.zeros(4096, dtype=torch.int64, pin_memory=self._pin)
                         for _ in range(2)]
        # (recorded once used)
        self._staging_done = [torch.cuda.Event() for _ in range(2)] if self._pin else []
        self._staging_used = [False, False]
        self._parity = 0
        # Decode batches in a fixed shape (CUDA graphs on a GPU): see DecodeBatches.
        self.decode_batches: DecodeBatches | None = None
        # EAGLE with drafts on the device: the target's hidden state at every KV slot, so
        # that the passes skipped while drafting is off can be caught up (the runner sets it
        # before the cache is sized).
        self.keeps_hidden = False
        self.hidden_cache: torch.Tensor | None = None

    def kv_bytes_per_block(self) -> int:
        config = self.kv_hf_config
        kv = bytes_per_block(config.num_hidden_layers, self.block_size,
                             config.num_key_value_heads, config.head_dim, self.dtype)
        if not self.keeps_hidden:
            return kv
        hidden_size = self.target_hf_config.hidden_size
        return kv + self.block_size * hidden_size * self.dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        config = self.kv_hf_config
        self.kv_caches = allocate_kv_caches(list(attention_layers(self.model)), num_blocks,
                                            self.block_size, config.num_key_value_heads,
                                            config.head_dim, self.dtype, self.device)
        bind_kv_caches(self.model, self.kv_caches)
        if self.keeps_hidden:
            # One row per KV slot, and a last one that slot -1 (nothing stored) writes to.
            self.hidden_cache = torch.zeros(
                (num_blocks * self.block_size + 1, self.target_hf_config.hidden_size),
                dtype=self.dtype, device=self.device)

    def store_hidden(self, slot_mapping: torch.Tensor, hidden: torch.Tensor) -> None:
        """The target's output hidden states of a step, at their KV slots (-1, nothing
        stored: the last row), for the passes that catch up later (EAGLE with
        `keeps_hidden`). One launch; captured into the target's CUDA graphs."""
        cache = self.hidden_cache
        assert cache is not None
        cache[slot_mapping] = hidden[:slot_mapping.shape[0]]

    # ---- subclass hooks ------------------------------------------------------------------

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None, metadata: AttentionMetadata) -> torch.Tensor:
        """[T] ids, [T] positions, [T, H] target hidden states (EAGLE) -> [T, H]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32 logits."""

    # ---- one round of drafts -------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, token_ids: list[list[int]], num_computed: np.ndarray,
                num_scheduled: np.ndarray, query_start_loc: np.ndarray, sampled: list[bool],
                num_wanted: list[int], block_tables: np.ndarray,
                target_hidden: torch.Tensor) -> list[list[int]]:
        """Drafts for every scheduled request of the step just run ([] where none are wanted).

        token_ids: each request's tokens after the step; num_computed / num_scheduled /
        query_start_loc: the step's (query_start_loc as laid out in target_hidden); sampled:
        whether the request got tokens this step; num_wanted: drafts wanted (<= k, 0 for none);
        block_tables: [B, width] the requests' block-table rows; target_hidden: [T, H] the
        target's output hidden states of the step."""
        num_reqs = len(token_ids)
        offset = self.token_offset
        counts = np.array([len(t) - num_computed[i] - offset if sampled[i] else num_scheduled[i]
                           for i, t in enumerate(token_ids)], dtype=np.int64)
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        req_of_token = np.repeat(np.arange(num_reqs), counts)
        within = np.arange(int(cu[-1])) - cu[req_of_token]
        positions = num_computed[req_of_token] + within
        input_ids = np.fromiter(
            (tok for i, t in enumerate(token_ids)
             for tok in t[num_computed[i] + offset:num_computed[i] + offset + counts[i]]),
            np.int64, int(cu[-1]))
        hidden = None
        if offset:
            rows = query_start_loc[req_of_token] + within
            hidden = target_hidden[torch.from_numpy(rows).to(self.device)]
        metadata = self._metadata(positions, cu, num_computed + counts, block_tables)
        out = self.forward(self._tensor(input_ids), self._tensor(positions), hidden, metadata)

        drafting = [i for i in range(num_reqs) if sampled[i] and num_wanted[i] > 0]
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        if not drafting:
            return drafts
        last = self._tensor(cu[1:][drafting] - 1)
        out = out[last]
        tokens = self.compute_logits(out).argmax(dim=-1)
        # Later steps: one token per drafting request, at the position after the last one.
        next_pos = np.array([len(token_ids[i]) - offset for i in drafting], dtype=np.int64)
        steps = [tokens]
        for _ in range(1, max(num_wanted[i] for i in drafting)):
            positions = np.minimum(next_pos, self.max_model_len - 1)
            cu = np.arange(len(drafting) + 1, dtype=np.int64)
            metadata = self._metadata(positions, cu, positions + 1, block_tables[drafting],
                                      store=next_pos < self.max_model_len)
            out = self.forward(tokens, self._tensor(positions), out if offset else None,
                               metadata)
            tokens = self.compute_logits(out).argmax(dim=-1)
            steps.append(tokens)
            next_pos += 1
        table = torch.stack(steps, dim=1).tolist()  # [drafting, steps]
        for row, i in enumerate(drafting):
            drafts[i] = table[row][:num_wanted[i]]
        return drafts

    @torch.inference_mode()
    def catch_up(self, starts: np.ndarray, gaps: np.ndarray, tokens: np.ndarray,
                 block_tables: np.ndarray, first_inputs: torch.Tensor | None,
                 store: bool = True) -> None:
        """The KV of positions starts[i] .. starts[i] + gaps[i] - 1 of each row [R] (passes
        skipped while drafting was off), nothing else: `tokens` their tokens, row after row;
        `block_tables` [R, width] the rows' host tables. EAGLE's position p takes the token at
        p + 1, so a row's last one is the step's first input id, on the device only
        (`first_inputs` [R]), and reads the target's hidden state stored at its slot.

        The tokens are padded to a power of two (a last row that stores nothing): a GEMM or
        kernel of a token count seen first mid-run costs milliseconds of host time (its
        kernels loaded, planned, specialized), and `warm_up` runs every padded count."""
        total = int(gaps.sum())
        padded = catch_up_tokens(total, self.max_model_len)
        keep = np.full(len(gaps), store)
        if padded > total:
            pad = padded - total
            starts, gaps = np.append(starts, 0), np.append(gaps, pad)
            tokens = np.concatenate([tokens, np.zeros(pad - self.token_offset, np.int64)])
            block_tables = np.concatenate([block_tables, block_tables[:1] * 0])
            keep = np.append(keep, False)
            if first_inputs is not None:
                first_inputs = torch.cat([first_inputs, first_inputs[:1]])
        num = len(gaps)
        cu = np.zeros(num + 1, dtype=np.int64)
        np.cumsum(gaps, out=cu[1:])
        row_of = np.repeat(np.arange(num), gaps)
        t = np.arange(int(cu[-1])) - cu[row_of]
        positions = starts[row_of] + t
        metadata = self._metadata(positions, cu, starts + gaps, block_tables, store=keep)
        hidden = None
        if self.token_offset:
            assert first_inputs is not None and self.hidden_cache is not None
            host_start = np.zeros(num, dtype=np.int64)
            np.cumsum(gaps[:-1] - 1, out=host_start[1:])
            source = np.where(t < gaps[row_of] - 1, host_start[row_of] + t, len(tokens) + row_of)
            pool = torch.cat([self._tensor(tokens), first_inputs])
            input_ids = pool[self._tensor(source)]
            hidden = self.hidden_cache[metadata.slot_mapping]
        else:
            input_ids = self._tensor(tokens)
        self.forward(input_ids, self._tensor(positions), hidden, metadata)

    def warm_up_catch_up(self, width: int) -> None:
        """Every padded token count of `catch_up` once, storing nothing (a GPU's kernels for
        them loaded and planned before the first request)."""
        count = CATCH_UP_MIN_TOKENS
        first = torch.zeros(1, dtype=torch.int64, device=self.device)
        while count <= min(CATCH_UP_MAX_TOKENS, self.max_model_len):
            self.catch_up(np.zeros(1, dtype=np.int64), np.array([count]),
                          np.zeros(count - self.token_offset, dtype=np.int64),
                          np.zeros((1, width), dtype=np.int32),
                          first if self.token_offset else None, store=False)
            count *= 2

    @torch.inference_mode()
    def propose_on_device(self, step: DeviceStep, draft_ids: torch.Tensor,
                          num_drafts: torch.Tensor) -> None:
        """The KV pass over a launched step and, for rows with `num_wanted`, their drafts,
        queued on the device without waiting for it: draft_ids[row, :k] and num_drafts[row]
        (num_wanted, else 0) per block-table row of the step.

        Per row of n scheduled tokens with s draft slots, the pass covers what the step could
        have verified: a draft model the row's tokens up to the last input before the slots,
        then the s + 1 it could have emitted (n + 1 positions; n for a chunk that did not
        sample); EAGLE the same shifted by one, with the target's hidden states (n). Only
        positions up to the last verified one store KV (its count is on the device)."""
        offset = self.token_offset
        num_reqs = len(step.rows)
        qsl = step.query_start_loc
        n, s = step.num_scheduled, step.num_slots
        sampled = step.sample_index >= 0
        lengths = n + (sampled & (offset == 0))
        # Tokens of each row's pass that are input ids of the step; the rest are emitted (or,
        # for EAGLE's chunk that did not sample, the next prompt token).
        known = np.where(sampled, n - s, n) - offset
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        total = int(cu[-1])
        row_of = np.repeat(np.arange(num_reqs), lengths)
        t = np.arange(total) - cu[row_of]
        num_layout = int(qsl[-1])
        num_emitted, width = step.emitted.shape
        from_emitted = num_layout + step.sample_index[row_of] * width + t - known[row_of]
        from_next = num_layout + num_emitted * width + row_of
        source = np.where(t < known[row_of], qsl[row_of] + t + offset,
                          np.where(sampled[row_of], from_emitted, from_next))
        drafting = np.flatnonzero(step.num_wanted > 0)
        # One staged copy: the gather index, each token's row and index in its row, the
        # rows' pass starts, their first position in the step, their counts' index (sampled
        # rows; else the appended 0), the base of their verified count, their block counts,
        # their block-table rows, the next tokens, the drafting rows.
        parts = [source, row_of, t, cu, qsl[:-1],
                 np.where(sampled, step.sample_index, num_emitted),
                 np.where(sampled, known, lengths), lengths, step.num_blocks, step.rows,
                 step.next_tokens, drafting, step.num_wanted[drafting]]
        staged = self._stage(parts)
        (source_d, row_d, t_d, cu_d, first_d, count_index, base, lengths_d, num_blocks, rows,
         next_tokens, drafting_d, wanted_d) = staged

        pool = torch.cat([step.input_ids[:num_layout], step.emitted.reshape(-1), next_tokens])
        input_ids = pool[source_d].clamp_(min=0)  # a rejected slot's -1: any token
        start = step.positions[first_d]  # [B] the row's first position in the step
        positions = start[row_d] + t_d
        counts = torch.cat([step.counts, torch.zeros(1, dtype=step.counts.dtype,
                                                     device=self.device)])
        valid = base + counts[count_index]  # [B] positions of each row's pass to keep
        store = t_d < valid[row_d]
        slot_mapping = self._slots(step.block_tables, row_d, positions, num_blocks[row_d],
                                   store)
        seq_lens = (start + lengths_d).to(torch.int32)
        max_len = int((step.num_computed + lengths).max(initial=1))
        metadata = self._device_metadata(cu_d, seq_lens, step.block_tables, slot_mapping,
                                         cu, lengths, max_len)
        hidden = None
        if offset:
            hidden = step.hidden[first_d[row_d] + t_d]
        out = self.forward(input_ids, positions, hidden, metadata)

        num_drafts[rows] = 0
        if not len(drafting):
            return
        last = cu_d[drafting_d] + valid[drafting_d] - 1
        out = out[last]
        tokens = self.compute_logits(out).argmax(dim=-1)
        # Later steps: one token per drafting row, at the position after the last.
        next_pos = start[drafting_d] + valid[drafting_d]
        table = step.block_tables[drafting_d]
        blocks = num_blocks[drafting_d]
        one_each = torch.arange(len(drafting) + 1, dtype=torch.int32, device=self.device)
        steps = [tokens]
        k = int(step.num_wanted.max())
        for m in range(1, k):
            pos, slot_mapping, seq_lens = step_inputs(next_pos, blocks, table,
                                                      self.max_model_len, self.block_size)
            max_len = int((step.num_computed + lengths).max()) + m
            metadata = self._device_metadata(
                one_each, seq_lens, table, slot_mapping,
                np.arange(len(drafting) + 1, dtype=np.int64), np.ones(len(drafting), np.int64),
                max_len)
            out = self.forward(tokens, pos, out if offset else None, metadata)
            tokens = self.compute_logits(out).argmax(dim=-1)
            steps.append(tokens)
            next_pos = next_pos + 1
        draft_rows = rows[drafting_d]
        draft_ids[draft_rows, :k] = torch.stack(steps, dim=1)
        num_drafts[draft_rows] = wanted_d

    def _stage(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays in one copy to the device, through a pinned buffer, never blocking on
        the device (each buffer is rewritten only after its last copy has left it)."""
        sizes = [len(part) for part in parts]
        needed = sum(sizes)
        self._parity ^= 1
        if self._pin and self._staging_used[self._parity]:
            self._staging_done[self._parity].synchronize()
        if self._staging[self._parity].numel() < needed:
            self._staging[self._parity] = torch.zeros(
                max(needed, 2 * self._staging[self._parity].numel()), dtype=torch.int64,
                pin_memory=self._pin)
        host = self._staging[self._parity]
        np.concatenate(parts, out=host.numpy()[:needed], casting="unsafe")
        staged = host[:needed].to(self.device, non_blocking=True)
        if self._pin:
            self._staging_done[self._parity].record()
            self._staging_used[self._parity] = True
        elif self.device.type == "cpu":
            staged = staged.clone()  # the next call rewrites this buffer
        return list(torch.split(staged, sizes))

    def _slots(self, block_tables: torch.Tensor, row_of: torch.Tensor,
               positions: torch.Tensor, num_blocks: torch.Tensor,
               store: torch.Tensor) -> torch.Tensor:
        """Each position's KV slot through its row's block table (`block_tables` [R, width],
        contiguous; `row_of` each position's row); -1 (not stored) where `store` is False or
        the row holds no block there."""
        index = positions // self.block_size
        store = store & (index < num_blocks)
        width = block_tables.shape[1]
        index = index.clamp(max=width - 1)
        blocks = block_tables.reshape(-1)[row_of * width + index]
        slots = blocks.to(torch.int64) * self.block_size + positions % self.block_size
        return torch.where(store, slots, -1)

    def _device_metadata(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, slot_mapping: torch.Tensor,
                         cu: np.ndarray, lengths: np.ndarray,
                         max_seq_len: int) -> AttentionMetadata:
        """Metadata whose lengths are on the device; the host's copies are upper bounds on a
        GPU (only the reference backend reads them: on a CPU, where they are exact)."""
        qsl_cpu = torch.from_numpy(cu.astype(np.int32))
        if self.device.type == "cpu":
            seq_cpu = seq_lens
        else:
            seq_cpu = torch.full((len(lengths),), max_seq_len, dtype=torch.int32)
        return AttentionMetadata(
            num_actual_tokens=int(cu[-1]),
            max_query_len=int(lengths.max(initial=1)),
            max_seq_len=max_seq_len,
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _metadata(self, positions: np.ndarray, query_start_loc: np.ndarray,
                  seq_lens: np.ndarray, block_tables: np.ndarray,
                  store: np.ndarray | None = None) -> AttentionMetadata:
        req_of_token = np.repeat(np.arange(len(seq_lens)), np.diff(query_start_loc))
        blocks = block_tables[req_of_token, positions // self.block_size].astype(np.int64)
        slots = blocks * self.block_size + positions % self.block_size
        if store is not None:
            slots = np.where(store[req_of_token], slots, -1)
        width = max(1, -(-int(seq_lens.max(initial=1)) // self.block_size))
        qsl_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        return AttentionMetadata(
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(np.diff(query_start_loc).max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            query_start_loc=qsl_cpu.to(self.device),
            seq_lens=seq_cpu.to(self.device),
            block_tables=self._tensor(block_tables[:, :width].astype(np.int32)),
            slot_mapping=self._tensor(slots),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )


class DraftModelProposer(ModelProposer):
    """A smaller model of the same vocabulary, run with its own KV cache."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        hf_config = load_hf_config(self.config.model)
        target = self.target_hf_config
        if hf_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocab_size ({hf_config.vocab_size}) must equal the target's "
                f"({target.vocab_size}): draft tokens are verified by id")
        if hf_config.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"the draft model's max_position_embeddings ({hf_config.max_position_embeddings}) "
                f"is below max_model_len ({self.max_model_len})")
        self.kv_hf_config = hf_config
        self.model = load_model(self.config.model, hf_config, self.dtype, self.device,
                                self.attn_backend)
        if self.device.type == "cuda":  # an FP8 draft multiplies in FP8 (even eager)
            from sluice.worker.compile import install_fp8_ops

            install_fp8_ops(self.model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


class EagleProposer(ModelProposer):
    """An EAGLE-1 head: the token embedding and the target's last hidden state, one decoder
    layer, the target's LM head."""

    token_offset = 1

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        from sluice.spec_decode.eagle_model import load_eagle_head

        self.model = load_eagle_head(self.config.model, self.target_model,
                                     self.target_hf_config, self.dtype, self.device,
                                     self.attn_backend)
        self.kv_hf_config = self.model.config  # one layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None, metadata: AttentionMetadata) -> torch.Tensor:
        assert hidden is not None
        return self.model(input_ids, hidden, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target_model.compute_logits(hidden)


@dataclass(slots=True)
class StepSources:
    """The runner's persistent step buffers on the device, which a decode batch's pass reads
    in place (so that a CUDA graph of it needs no copies of them): the step's input ids and
    positions (as fixed up on the device), its query_start_loc (int32), and the full-width
    block table its CUDA graphs read (None without graphs)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    graph_block_tables: torch.Tensor | None


class DecodeBatches:
    """A model proposer's device pass over decode batches (every request one token plus its
    draft slots, every request sampled) in one fixed shape per padded size: each request's
    pass is L = k + 2 positions (EAGLE: k + 1), as if it had k slots, and drafts are
    computed for every row. On a GPU each size, with and without drafts, is a CUDA graph
    reading the runner's step buffers in place (`StepSources`), so a step costs the host a
    few copies and a replay; elsewhere (CPU tests) the same code runs eagerly. Padding rows
    hold no blocks, so they store nothing."""

    def __init__(self, proposer: ModelProposer, max_size: int, sources: StepSources,
                 graph_sizes: list[int] | None) -> None:
        """graph_sizes: the padded batch sizes to capture as CUDA graphs, the largest
        `max_size` (None: no graphs, one eager shape)."""
        self.proposer = proposer
        self.sources = sources
        self.sizes = graph_sizes or [max_size]
        self.max_size = max_size
        k = proposer.k
        self.k = k
        self.known = 1 - proposer.token_offset  # input ids at the start of a row's pass
        self.length = k + 1 + self.known  # L: the pass's positions per row
        dev = proposer.device
        i64 = dict(dtype=torch.int64, device=dev)
        # Per row: its block-table row, drafts wanted, blocks held (each [max_size], in one
        # buffer so that one copy brings them), from pinned host buffers used in turn.
        self.meta = torch.zeros(3 * max_size, **i64)
        self.rows, self.wanted, self.num_blocks = self.meta.view(3, max_size)
        pin = dev.type == "cuda"
        self._meta_host = ([torch.zeros(3 * max_size, dtype=torch.int64, pin_memory=True)
                            for _ in range(2)] if pin else [self.meta])
        self._meta_host_np = [host.numpy() for host in self._meta_host]
        # Each pinned buffer's last copy (recorded once used).
        self._meta_done = [torch.cuda.Event() for _ in range(2)] if pin else []
        self._meta_used = [False, False]
        self._parity = 0
        self.emitted = torch.full((max_size, k + 1), -1, **i64)
        self.counts = torch.zeros(max_size, **i64)
        self.hidden: torch.Tensor | None = None  # EAGLE: the target's hidden states
        if proposer.token_offset:
            self.hidden = torch.zeros((max_size * (k + 1), proposer.target_hf_config.hidden_size),
                                      dtype=proposer.dtype, device=dev)
        self.drafts = torch.zeros((max_size, max(k, 1)), **i64)
        # query_start_loc of a pass (L positions a row) and of a draft step (one a row).
        self._pass_starts_np = np.arange(max_size + 1, dtype=np.int64) * self.length
        self._one_each_np = np.arange(max_size + 1, dtype=np.int64)
        self._pass_starts = torch.from_numpy(self._pass_starts_np.astype(np.int32)).to(dev)
        self._one_each = torch.from_numpy(self._one_each_np.astype(np.int32)).to(dev)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.num_runs = 0
        if graph_sizes:
            self._capture()

    def propose(self, rows: np.ndarray, num_wanted: np.ndarray, num_blocks: np.ndarray,
                emitted: torch.Tensor, counts: torch.Tensor | None, hidden: torch.Tensor,
                block_tables: torch.Tensor, graph_step: bool, draft_ids: torch.Tensor,
                num_drafts: torch.Tensor) -> None:
        """The pass over a decode batch of len(rows) requests: `emitted` [B, W] each row's
        tokens of the step (-1 past `counts`, None: one each), `hidden` the target's hidden
        states of the step, `block_tables` its [B, width] table; `graph_step`: the target
        step replayed a CUDA graph (the full-width table is filled). Writes draft_ids[row]
        and num_drafts[row] (wanted, else 0) per block-table row."""
        num_reqs = len(rows)
        use_graph = graph_step and bool(self.graphs)
        size = next(s for s in self.sizes if s >= num_reqs) if use_graph else num_reqs
        draft = bool(num_wanted.any())
        self._load_meta(rows, num_wanted, num_blocks, size)
        self.emitted[:num_reqs, :emitted.shape[1]].copy_(emitted)
        if counts is None:
            self.counts[:num_reqs].fill_(1)
        else:
            self.counts[:num_reqs].copy_(counts)
        if self.hidden is not None:
            num_hidden = min(hidden.shape[0], self.hidden.shape[0])
            self.hidden[:num_hidden].copy_(hidden[:num_hidden])
        self.num_runs += 1
        if use_graph:
            self.graphs[(size, draft)].replay()
        else:
            self._body(size, draft, block_tables)
        if draft:
            draft_ids.index_copy_(0, self.rows[:num_reqs], self.drafts[:num_reqs])
        num_drafts.index_copy_(0, self.rows[:num_reqs], self.wanted[:num_reqs])

    def _load_meta(self, rows: np.ndarray, num_wanted: np.ndarray, num_blocks: np.ndarray,
                   size: int) -> None:
        num_reqs, cap = len(rows), self.max_size
        parity = self._parity = (self._parity + 1) % len(self._meta_host)
        if self._meta_done and self._meta_used[parity]:
            self._meta_done[parity].synchronize()  # its copy two steps ago has left
        view = self._meta_host_np[parity]
        view[:num_reqs] = rows
        view[cap:cap + num_reqs] = num_wanted
        view[2 * cap:2 * cap + num_reqs] = num_blocks
        view[2 * cap + num_reqs:2 * cap + size] = 0  # padding rows hold no blocks
        if self._meta_done:
            host = self._meta_host[parity]
            self.meta[:2 * cap + size].copy_(host[:2 * cap + size], non_blocking=True)
            self._meta_done[parity].record()
            self._meta_used[parity] = True

    def _capture(self) -> None:
        """A CUDA graph per size, with and without drafts (largest first, one memory pool,
        separate from the target's: the target's hidden states are read before a replay)."""
        tables = self.sources.graph_block_tables
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            for draft in (True, False):
                self._body(size, draft, tables[:size])  # warm up: compiles kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._body(size, draft, tables[:size])
                if pool is None:
                    pool = graph.pool()
                self.graphs[(size, draft)] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs of the %s proposer's pass over decode batch sizes %s, "
                    "with and without drafts, in %.1f s", self.proposer.config.method,
                    self.sizes, time.perf_counter() - start)

    def _body(self, size: int, draft: bool, block_tables: torch.Tensor) -> None:
        """The pass over the first `size` rows; with `draft` their drafts, in self.drafts."""
        proposer = self.proposer
        src = self.sources
        length = self.length
        num_blocks = self.num_blocks[:size]
        input_ids, positions, slot_mapping, seq_lens, valid, first_pos, hidden_rows = (
            pass_inputs(src.query_start_loc, src.input_ids, src.positions, self.emitted,
                        self.counts, num_blocks, block_tables, length, self.known,
                        proposer.block_size,
                        0 if self.hidden is None else self.hidden.shape[0]))
        max_len = proposer.max_model_len
        metadata = proposer._device_metadata(
            self._pass_starts[:size + 1], seq_lens, block_tables, slot_mapping,
            self._pass_starts_np[:size + 1], np.full(size, length, dtype=np.int64), max_len)
        hidden = self.hidden[hidden_rows] if self.hidden is not None else None
        out = proposer.forward(input_ids, positions, hidden, metadata)
        if not draft:
            return
        # Each row's output at its last kept position predicts its first draft.
        out = out[self._pass_starts[:size] + valid - 1]
        tokens = proposer.compute_logits(out).argmax(dim=-1)
        next_pos = first_pos + valid
        steps = [tokens]
        for _ in range(1, self.k):
            pos, slot_mapping, seq_lens = step_inputs(next_pos, num_blocks, block_tables,
                                                      max_len, proposer.block_size)
            metadata = proposer._device_metadata(
                self._one_each[:size + 1], seq_lens, block_tables, slot_mapping,
                self._one_each_np[:size + 1], np.ones(size, dtype=np.int64), max_len)
            out = proposer.forward(tokens, pos, out if proposer.token_offset else None,
                                   metadata)
            tokens = proposer.compute_logits(out).argmax(dim=-1)
            steps.append(tokens)
            next_pos = next_pos + 1
        self.drafts[:size, :self.k] = torch.stack(steps, dim=1)
