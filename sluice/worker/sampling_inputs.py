"""Build the sampler's per-step inputs from the sampling requests' state.

Only what some row needs is built: a batch without penalties sends no token history, one
without top-k sends no top-k column. Each column is one host-to-device copy from pinned memory.
"""

from __future__ import annotations

import numpy as np
import torch

from sluice.worker.input_batch import CachedRequestState
from sluice.worker.sampling_metadata import SamplingMetadata


def build_sampling_metadata(states: list[CachedRequestState], device: torch.device,
                            vocab_size: int) -> SamplingMetadata:
    params = [s.sampling_params for s in states]
    num_rows = len(states)

    def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), device)

    greedy = [p.greedy for p in params]
    no_penalties = all(p.presence_penalty == 0 and p.frequency_penalty == 0
                       and p.repetition_penalty == 1.0 for p in params)
    prompt_token_ids = None
    output_token_ids: list[list[int]] = []
    if no_penalties:
        zeros = torch.zeros(num_rows, dtype=torch.float32, device=device)
        presence = frequency = zeros
        repetition = torch.ones(num_rows, dtype=torch.float32, device=device)
    else:
        presence = column([p.presence_penalty for p in params], torch.float32)
        frequency = column([p.frequency_penalty for p in params], torch.float32)
        repetition = column([p.repetition_penalty for p in params], torch.float32)
        width = max(s.num_prompt_tokens for s in states)
        padded = np.full((num_rows, width), vocab_size, dtype=np.int64)
        for i, s in enumerate(states):
            padded[i, :s.num_prompt_tokens] = s.token_ids[:s.num_prompt_tokens]
        prompt_token_ids = to_device(torch.from_numpy(padded), device)
        output_token_ids = [s.output_token_ids for s in states]

    wanted = [p.logprobs for p in params if p.logprobs is not None]
    blocked = {i: s.sampling_params.all_stop_token_ids for i, s in enumerate(states)
               if s.sampling_params.min_tokens
               and len(s.token_ids) - s.num_prompt_tokens < s.sampling_params.min_tokens
               and s.sampling_params.all_stop_token_ids}
    return SamplingMetadata(
        temperature=column([p.temperature for p in params], torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=column([p.top_k for p in params], torch.int64)
        if any(p.top_k > 0 for p in params) else None,
        top_p=column([p.top_p for p in params], torch.float32)
        if any(p.top_p < 1.0 for p in params) else None,
        min_p=column([p.min_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params) else None,
        generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        max_num_logprobs=max(wanted) if wanted else None,
        no_penalties=no_penalties,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        blocked_token_ids=blocked,
    )


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy without making the host wait: a copy from pageable memory would block until the
    device has finished everything queued before it, undoing async scheduling. The pinned
    buffer comes from torch's caching host allocator, which keeps it until the copy is done."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
