"""SchedulerOutput in, one forward pass, ModelRunnerOutput out.

The runner keeps each request's state (token ids, block table, sampling generator) from the
step it first appears until it shows up in `finished_req_ids`; preempted requests keep their
state (so a seeded generator continues where it stopped) and get a fresh block table on resume.
It never decides policy: which tokens to compute comes entirely from the scheduler.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import torch

from sluice.attention import AttentionMetadata, get_attention_backend
from sluice.config import CacheConfig, ModelConfig, SchedulerConfig
from sluice.core.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    ModelRunnerOutput,
    PositionLogprobs,
    SchedulerOutput,
)
from sluice.model.attention import bind_kv_caches
from sluice.model.hf_config import HFModelConfig
from sluice.model.loader import load_model, resolve_dtype
from sluice.sampling_params import SamplingParams
from sluice.worker.kv_cache import allocate_kv_caches, determine_num_blocks
from sluice.worker.sampler import Sampler, compute_topk_logprobs
from sluice.worker.sampling_metadata import SamplingMetadata


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    # Prompt logprob entries already sent (entry 0 is None); recompute after preemption
    # must not send them twice.
    num_prompt_logprobs_sent: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
class ModelInputs:
    req_ids: list[str]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    query_start_loc: np.ndarray  # [B + 1]
    num_computed: np.ndarray  # [B] before this step
    num_scheduled: np.ndarray  # [B]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return torch.device(device)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, hf_config: HFModelConfig) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.hf_config = hf_config
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, hf_config)
        self.block_size = cache_config.block_size
        backend_name = model_config.attention_backend
        if backend_name == "auto":
            backend_name = "torch_ref"
        self.attn_backend = get_attention_backend(backend_name)
        torch.manual_seed(model_config.seed)
        # This engine's GPU share: gpu_memory_utilization of the device, but never more than was
        # free when it started (another engine in the process may hold the rest), less weights.
        gpu_share = 0
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            gpu_share = min(free, int(total * cache_config.gpu_memory_utilization))
            allocated_before = torch.cuda.memory_allocated(self.device)
        self.model = load_model(model_config.model, hf_config, self.dtype, self.device,
                                self.attn_backend)
        if self.device.type == "cuda":
            gpu_share -= torch.cuda.memory_allocated(self.device) - allocated_before
        self.gpu_bytes_available = gpu_share
        generator = torch.Generator(device=self.device)
        generator.manual_seed(model_config.seed)
        self.sampler = Sampler(default_generator=generator)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0

    # ---- KV cache ------------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        return determine_num_blocks(self.cache_config, self.scheduler_config, self.hf_config,
                                    self.dtype, self.device, self.gpu_bytes_available)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.hf_config, num_blocks, self.block_size,
                                            self.dtype, self.device)
        bind_kv_caches(self.model, self.kv_caches)
        self.num_blocks = num_blocks

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return EMPTY_MODEL_RUNNER_OUTPUT
        inputs = self._prepare_inputs(scheduler_output)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)

        states = [self.requests[r] for r in inputs.req_ids]
        seq_lens = inputs.num_computed + inputs.num_scheduled
        # A request samples once its chunk reaches the end of its known tokens.
        sample_rows = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids)]
        output = ModelRunnerOutput(req_ids=inputs.req_ids,
                                   sampled_token_ids=[[] for _ in states])
        self._compute_prompt_logprobs(inputs, states, hidden, output)
        if not sample_rows:
            return output

        logits_indices = torch.as_tensor(inputs.query_start_loc[1:][sample_rows] - 1,
                                         device=self.device)
        logits = self.model.compute_logits(hidden[logits_indices])  # [S, V] float32
        sample_states = [states[i] for i in sample_rows]
        sampler_output = self.sampler(logits, self._sampling_metadata(sample_states))
        sampled = sampler_output.sampled_token_ids.tolist()
        if sampler_output.logprobs is not None:
            ids = sampler_output.logprob_token_ids.tolist()
            lps = sampler_output.logprobs.tolist()
            ranks = sampler_output.sampled_token_ranks.tolist()
        for j, (row, state) in enumerate(zip(sample_rows, sample_states)):
            state.token_ids.append(sampled[j])
            output.sampled_token_ids[row] = [sampled[j]]
            num_logprobs = state.sampling_params.logprobs
            if num_logprobs is not None:
                output.logprobs[state.req_id] = [
                    _position_logprobs(ids[j], lps[j], ranks[j], num_logprobs)]
        return output

    # ---- internals -----------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> ModelInputs:
        req_ids = [r.req_id for r in so.scheduled_new_reqs]
        req_ids += [r.req_id for r in so.scheduled_cached_reqs]
        states = [self.requests[r] for r in req_ids]
        num_reqs = len(states)
        num_scheduled = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        num_computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        seq_lens = num_computed + num_scheduled
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        # Token t belongs to request req_of_token[t] and sits at positions[t] in it.
        req_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
        positions = num_computed[req_of_token] + (np.arange(num_tokens)
                                                  - query_start_loc[req_of_token])
        input_ids = np.empty(num_tokens, dtype=np.int64)
        for i, state in enumerate(states):
            start, end = num_computed[i], seq_lens[i]
            input_ids[query_start_loc[i]:query_start_loc[i + 1]] = state.token_ids[start:end]

        max_blocks = max(len(s.block_ids) for s in states)
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        for i, state in enumerate(states):
            block_tables[i, :len(state.block_ids)] = state.block_ids
        block_of_token = block_tables[req_of_token, positions // self.block_size]
        slot_mapping = block_of_token.astype(np.int64) * self.block_size \
            + positions % self.block_size

        dev = self.device
        query_start_loc_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=query_start_loc_cpu.to(dev, non_blocking=True),
            seq_lens=seq_lens_cpu.to(dev, non_blocking=True),
            block_tables=torch.from_numpy(block_tables).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        return ModelInputs(
            req_ids=req_ids,
            input_ids=torch.from_numpy(input_ids).to(dev, non_blocking=True),
            positions=torch.from_numpy(positions).to(dev, non_blocking=True),
            attn_metadata=metadata,
            query_start_loc=query_start_loc,
            num_computed=num_computed,
            num_scheduled=num_scheduled,
        )

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        dev = self.device

        def column(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        temperature = [p.temperature for p in params]
        greedy = [p.greedy for p in params]
        no_penalties = all(p.presence_penalty == 0 and p.frequency_penalty == 0
                           and p.repetition_penalty == 1.0 for p in params)
        prompt_token_ids = None
        if not no_penalties:
            vocab = self.hf_config.vocab_size
            width = max(s.num_prompt_tokens for s in states)
            padded = np.full((len(states), width), vocab, dtype=np.int64)
            for i, s in enumerate(states):
                padded[i, :s.num_prompt_tokens] = s.token_ids[:s.num_prompt_tokens]
            prompt_token_ids = torch.from_numpy(padded).to(dev)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        blocked = {i: s.sampling_params.all_stop_token_ids for i, s in enumerate(states)
                   if len(s.token_ids) - s.num_prompt_tokens < s.sampling_params.min_tokens
                   and s.sampling_params.all_stop_token_ids}
        return SamplingMetadata(
            temperature=column(temperature, torch.float32),
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
            presence_penalties=column([p.presence_penalty for p in params], torch.float32),
            frequency_penalties=column([p.frequency_penalty for p in params], torch.float32),
            repetition_penalties=column([p.repetition_penalty for p in params], torch.float32),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=[s.output_token_ids for s in states],
            blocked_token_ids=blocked,
        )

    def _compute_prompt_logprobs(self, inputs: ModelInputs, states: list[CachedRequestState],
                                 hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1, from the positions computed this step."""
        for i, state in enumerate(states):
            num_logprobs = state.sampling_params.prompt_logprobs
            if num_logprobs is None or state.num_prompt_logprobs_sent >= state.num_prompt_tokens:
                continue
            # Prompt token t is predicted by position t - 1.
            start = int(inputs.num_computed[i])
            lo = max(state.num_prompt_logprobs_sent, start + 1, 1)
            hi = min(start + int(inputs.num_scheduled[i]) + 1, state.num_prompt_tokens)
            entries: list[PositionLogprobs | None] = []
            if state.num_prompt_logprobs_sent == 0:
                entries.append(None)
            if hi > lo:
                first_row = int(inputs.query_start_loc[i]) + (lo - 1 - start)
                logits = self.model.compute_logits(hidden[first_row:first_row + hi - lo])
                logprobs = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(state.token_ids[lo:hi], device=self.device)
                ids, lps, ranks = compute_topk_logprobs(logprobs, num_logprobs, targets)
                for row_ids, row_lps, rank in zip(ids.tolist(), lps.tolist(), ranks.tolist()):
                    entries.append(_position_logprobs(row_ids, row_lps, rank, num_logprobs))
            if entries:
                state.num_prompt_logprobs_sent = max(state.num_prompt_logprobs_sent, 1, hi)
                output.prompt_logprobs[state.req_id] = entries


def _position_logprobs(ids: list[int], lps: list[float], rank: int,
                       num_logprobs: int) -> PositionLogprobs:
    """The chosen token (first) with its rank, then the top-N with ranks 1..N."""
    entry: PositionLogprobs = {ids[0]: (lps[0], rank)}
    for j in range(1, num_logprobs + 1):
        entry.setdefault(ids[j], (lps[j], j))
    return entry
