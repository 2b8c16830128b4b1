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
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from sluice.attention.kv_layout import allocate_kv_caches, bytes_per_block
from sluice.attention.metadata import AttentionMetadata
from sluice.model.attention import attention_layers, bind_kv_caches
from sluice.model.hf_config import HFModelConfig, load_hf_config
from sluice.model.loader import load_model
from sluice.spec_decode.config import SpeculativeConfig


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

    def kv_bytes_per_block(self) -> int:
        config = self.kv_hf_config
        return bytes_per_block(config.num_hidden_layers, self.block_size,
                               config.num_key_value_heads, config.head_dim, self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        config = self.kv_hf_config
        self.kv_caches = allocate_kv_caches(list(attention_layers(self.model)), num_blocks,
                                            self.block_size, config.num_key_value_heads,
                                            config.head_dim, self.dtype, self.device)
        bind_kv_caches(self.model, self.kv_caches)

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
