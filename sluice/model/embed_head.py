"""The token embedding and the LM head, split over the vocabulary (Megatron style).

Rank r of N holds rows [r * S, (r + 1) * S) of the [V, hidden] table, S = ceil(V / N); the last
rank's rows past V are zeros (never looked up; their logits are cut off). A tied LM head shares
the embedding's parameter, so both shard the same way.

- Embedding: each rank looks up the ids in its range (zeros for the others) and one all-reduce
  sums them: exactly one rank contributes each row, so the sum is exact.
- LM head: each rank computes its [N_rows, S] logits, an all-gather gives every rank all V
  (copies, no arithmetic: the same bits everywhere). Every rank then samples with the same
  seeds from the same logits, so every rank draws the same tokens without a broadcast (the
  multiprocess executor checks they agree every step); each rank feeds its own device-side
  tokens to the next step (async scheduling) as at TP = 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.weights import LoadedWeight, check_shape, new_param


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        # Rows of the checkpoint this rank holds (fewer on the last rank when N does not divide V).
        self.num_loaded_rows = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        self.weight = new_param(self.rows_per_rank, hidden_size)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight,
                      shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter is not merged, got shard id {shard_id!r}")
        if loaded_weight is param:  # a table offered to itself (EAGLE's shared embedding)
            return
        check_shape((self.vocab_size, param.shape[1]), loaded_weight, "parameter")
        rows = self.num_loaded_rows
        param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden]."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden: [N, hidden] (the same on every rank) -> logits [N, vocab] in float32
        (upcast=False: in the weight dtype, for a sampler that reads them once as they are
        instead of paying a pass over [N, vocab] for the copy). The matmul runs in the weight
        dtype as in HF (an fp32 copy of a large vocab matrix per step would cost more than it
        buys). At TP > 1 every rank gets every logit (an all-gather)."""
        logits = F.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits)[:, :self.vocab_size]
        return logits.float() if upcast else logits
