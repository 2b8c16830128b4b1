"""Build the sampler's per-step inputs from the sampling requests' state.

Only what some row needs is built: a batch without penalties sends no token history, one
without top-k uses no top-k column. The columns travel in one copy from pinned memory.
"""

from __future__ import annotations

import numpy as np
import torch

from sluice.worker.input_batch import CachedRequestState
from sluice.worker.sampling_metadata import SamplingMetadata


class SamplingStaging:
    """Pinned host buffers for the per-row sampling columns, two sets used in turn: a set is
    written again only two steps later, when its copy has long finished, so the host never
    waits and never allocates pinned memory on the hot path."""

    NUM_FLOAT_COLUMNS = 6  # temperature, top_p, min_p, presence, frequency, repetition

    def __init__(self, max_rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.floats = [torch.zeros(self.NUM_FLOAT_COLUMNS * max_rows, dtype=torch.float32,
                                   pin_memory=pin) for _ in range(2)]
        self.ints = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin)
                     for _ in range(2)]
        self.turn = 0

    def upload(self, floats: list[list[float]], ints: list[int]) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
        """floats: NUM_FLOAT_COLUMNS columns of B values; ints: B values. Device [6, B], [B]."""
        self.turn ^= 1
        num_rows = len(ints)
        host_floats = self.floats[self.turn][:self.NUM_FLOAT_COLUMNS * num_rows]
        host_floats.numpy().reshape(self.NUM_FLOAT_COLUMNS, num_rows)[:] = floats
        host_ints = self.ints[self.turn][:num_rows]
        host_ints.numpy()[:] = ints
        if self.device.type == "cpu":
            return host_floats.view(self.NUM_FLOAT_COLUMNS, num_rows).clone(), host_ints.clone()
        return (host_floats.to(self.device, non_blocking=True).view(self.NUM_FLOAT_COLUMNS,
                                                                    num_rows),
                host_ints.to(self.device, non_blocking=True))


def build_sampling_metadata(states: list[CachedRequestState], staging: SamplingStaging,
                            vocab_size: int) -> SamplingMetadata:
    params = [s.sampling_params for s in states]
    device = staging.device
    greedy = [p.greedy for p in params]
    no_penalties = all(p.presence_penalty == 0 and p.frequency_penalty == 0
                       and p.repetition_penalty == 1.0 for p in params)
    columns, top_k = staging.upload(
        [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params],
         [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
         [p.repetition_penalty for p in params]],
        [p.top_k for p in params])
    temperature, top_p, min_p, presence, frequency, repetition = columns.unbind(0)
    prompt_token_ids = None
    output_token_ids: list[list[int]] = []
    if not no_penalties:
        width = max(s.num_prompt_tokens for s in states)
        padded = np.full((len(states), width), vocab_size, dtype=np.int64)
        for i, s in enumerate(states):
            padded[i, :s.num_prompt_tokens] = s.token_ids[:s.num_prompt_tokens]
        # Penalty batches have already waited for the step in flight (they count its token).
        prompt_token_ids = torch.from_numpy(padded).to(device)
        output_token_ids = [s.output_token_ids for s in states]

    wanted = [p.logprobs for p in params if p.logprobs is not None]
    blocked = {i: s.sampling_params.all_stop_token_ids for i, s in enumerate(states)
               if s.sampling_params.min_tokens
               and len(s.token_ids) - s.num_prompt_tokens < s.sampling_params.min_tokens
               and s.sampling_params.all_stop_token_ids}
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=top_k if any(p.top_k > 0 for p in params) else None,
        top_p=top_p if any(p.top_p < 1.0 for p in params) else None,
        min_p=min_p if any(p.min_p > 0.0 for p in params) else None,
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
