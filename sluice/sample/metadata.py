"""The batch of sampling settings handed to the sampler (and the rejection sampler) each step;
the model runner builds it (sluice.worker.sampling_inputs).

Row i of every tensor belongs to the i-th request of the batch. Optional tensors are None when
no row uses the feature, so the sampler skips that work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingMetadata:
    # [B] float32; rows below 1e-5 are greedy.
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    # [B] int64, 0 = off; None when no row uses top-k.
    top_k: torch.Tensor | None
    # [B] float32, 1.0 = off; None when no row uses top-p.
    top_p: torch.Tensor | None
    # [B] float32, 0.0 = off; None when no row uses min-p.
    min_p: torch.Tensor | None
    # row -> the request's own generator (seeded requests); other rows use the sampler's default.
    generators: dict[int, torch.Generator]
    # None: no row wants logprobs. Otherwise the largest N asked for in the batch.
    max_num_logprobs: int | None
    no_penalties: bool
    # [B] float32 each; 0.0, 0.0 and 1.0 are "off".
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    # [B, max_prompt_len] int64, padded with vocab_size; None when no_penalties.
    prompt_token_ids: torch.Tensor | None
    # Per row, the tokens generated so far.
    output_token_ids: list[list[int]]
    # row -> token ids that must not be sampled now (EOS / stop ids while below min_tokens).
    blocked_token_ids: dict[int, set[int]]
    # [B] int64 Philox keys of the fused sampling kernel (sampling_inputs.build_row_seeds);
    # None: the batch was built without them and samples on the torch path.
    seeds: torch.Tensor | None = None
    # [B] bool: the rows the fused kernel samples when the others need the torch path (they
    # need nothing but temperature or greedy). None when all rows or none do, or without seeds.
    fused_rows: torch.Tensor | None = None
    # OpenAI's logit_bias of every row that has one, as (rows [N] int64, token ids [N] int64,
    # biases [N] float32) on the device; None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Structured outputs: [B, ceil(V / 32)] int32 on the device, bit v of row i set when row i
    # may sample token v; only the rows in grammar_rows are read (the others sample
    # unconstrained). None when no row is constrained.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] | None = None
