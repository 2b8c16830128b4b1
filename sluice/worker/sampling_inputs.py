"""Build the sampler's per-step inputs from the sampling requests' state.

Only what some row needs is built: a batch without penalties sends no token history, one
without top-k uses no top-k column. The columns travel in one copy from pinned memory.

Token constraints (a request's logit_bias, a structured-output request's grammar mask from the
step message) are built only in steps that have them; the masks go through pinned buffers
(GrammarStaging) allocated on the first constrained step.

Row seeds (the fused sampling kernel's Philox keys, see triton_sampling.py) are mixed on the host
each launch, so building them never waits for the device: a seeded request's key comes from its
seed and the number of tokens it has sampled so far (its draws do not depend on the batch, its
row or the step), any other row's from the runner's seed, the launch number and the row.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from sluice.core.outputs import GrammarBitmask
from sluice.sample.metadata import SamplingMetadata
from sluice.sampling_params import SamplingParams
from sluice.worker.input_batch import CachedRequestState

_UINT64_MASK = (1 << 64) - 1


class SamplingStaging:
    """Pinned host buffers for the per-row sampling columns, two sets used in turn: a set is
    written again only two steps later, when its copy has long finished, so the host never
    waits and never allocates pinned memory on the hot path."""

    NUM_FLOAT_COLUMNS = 6  # temperature, top_p, min_p, presence, frequency, repetition
    NUM_INT_COLUMNS = 3  # top_k, row seed, fused-kernel row (0 / 1)

    def __init__(self, max_rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        width = _aligned_width(max_rows)
        self.floats = [torch.zeros(self.NUM_FLOAT_COLUMNS * width, dtype=torch.float32,
                                   pin_memory=pin) for _ in range(2)]
        self.ints = [torch.zeros(self.NUM_INT_COLUMNS * width, dtype=torch.int64,
                                 pin_memory=pin) for _ in range(2)]
        self.turn = 0

    def upload(self, floats: list[list[float]],
               ints: list[list[int] | np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """floats: NUM_FLOAT_COLUMNS columns of B values; ints: NUM_INT_COLUMNS columns of B
        values. Device [6, B] float32, [3, B] int64.

        Every column starts 16-byte aligned (rows padded to a multiple of 4 values): Triton
        compiles a kernel variant per alignment of its pointer arguments, so a column at an odd
        offset would compile a new one mid-run (measured: 0.8 s in a throughput run)."""
        self.turn ^= 1
        num_rows = len(ints[0])
        width = _aligned_width(num_rows)
        host_floats = self.floats[self.turn][:self.NUM_FLOAT_COLUMNS * width]
        host_floats.numpy().reshape(self.NUM_FLOAT_COLUMNS, width)[:, :num_rows] = floats
        host_ints = self.ints[self.turn][:self.NUM_INT_COLUMNS * width]
        int_columns = host_ints.numpy().reshape(self.NUM_INT_COLUMNS, width)
        for column, values in zip(int_columns, ints, strict=True):
            column[:num_rows] = values
        if self.device.type == "cpu":
            device_floats, device_ints = host_floats.clone(), host_ints.clone()
        else:
            device_floats = host_floats.to(self.device, non_blocking=True)
            device_ints = host_ints.to(self.device, non_blocking=True)
        return (device_floats.view(self.NUM_FLOAT_COLUMNS, width)[:, :num_rows],
                device_ints.view(self.NUM_INT_COLUMNS, width)[:, :num_rows])

    def upload_seeds(self, row_seeds: np.ndarray) -> torch.Tensor:
        """Row seeds alone ([B] int64 on the device), for metadata otherwise reused
        (SamplingMetadataReuse): through the start of the turn's int buffer, taking a turn as
        `upload` does."""
        self.turn ^= 1
        num_rows = len(row_seeds)
        host = self.ints[self.turn][:_aligned_width(num_rows)]
        host.numpy()[:num_rows] = row_seeds
        if self.device.type == "cpu":
            return host[:num_rows].clone()
        return host.to(self.device, non_blocking=True)[:num_rows]


class SamplingMetadataReuse:
    """A step's sampling metadata kept for the next one when that samples the same requests in
    the same rows and none of its columns can have changed: then only the row seeds (new every
    launch) are uploaded. In steady decoding most steps are such. Not kept when a column depends
    on the tokens so far (penalties, min_tokens' blocking) or the step had grammar masks."""

    def __init__(self, staging: SamplingStaging) -> None:
        self.staging = staging
        self._states: list[CachedRequestState] = []
        self._metadata: SamplingMetadata | None = None

    def get(self, states: list[CachedRequestState], row_seeds: np.ndarray,
            grammar: GrammarBitmask | None) -> SamplingMetadata | None:
        """The kept metadata with these seeds, or None when it does not fit this step."""
        kept = self._metadata
        if (kept is None or grammar is not None or len(states) != len(self._states)
                or any(a is not b for a, b in zip(states, self._states))):
            return None
        return dataclasses.replace(kept, seeds=self.staging.upload_seeds(row_seeds))

    def keep(self, states: list[CachedRequestState], metadata: SamplingMetadata) -> None:
        reusable = (metadata.seeds is not None and metadata.no_penalties
                    and metadata.grammar_bitmask is None
                    and not any(s.sampling_params.min_tokens for s in states))
        self._states = list(states) if reusable else []
        self._metadata = metadata if reusable else None


class GrammarStaging:
    """Host buffers for a step's grammar masks laid out by batch row ([max_rows, W] int32, two
    used in turn as SamplingStaging's, pinned on a GPU), allocated on first use."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.device = device
        self.buffers: list[torch.Tensor] = []
        self.turn = 0

    def upload(self, grammar: GrammarBitmask, states: list[CachedRequestState]
               ) -> tuple[torch.Tensor, list[int]] | None:
        """(device [B, W] bitmask, the batch rows it constrains), from the step message's
        packed rows; None when none of its requests is among `states` (a row dropped after a
        failed KV load)."""
        position = {s.req_id: i for i, s in enumerate(states)}
        rows = [(position[r], k) for k, r in enumerate(grammar.req_ids) if r in position]
        if not rows:
            return None
        num_words = len(grammar.bitmask) // 4 // len(grammar.req_ids)
        packed = np.frombuffer(grammar.bitmask, dtype=np.int32).reshape(-1, num_words)
        if not self.buffers or self.buffers[0].shape[1] != num_words:
            pin = self.device.type == "cuda"
            self.buffers = [torch.empty((self.max_rows, num_words), dtype=torch.int32,
                                        pin_memory=pin) for _ in range(2)]
        self.turn ^= 1
        host = self.buffers[self.turn][:len(states)]
        batch_rows = [i for i, _ in rows]
        host.numpy()[batch_rows] = packed[[k for _, k in rows]]
        if self.device.type == "cpu":
            return host.clone(), batch_rows
        return host.to(self.device, non_blocking=True), batch_rows


def _aligned_width(num_rows: int) -> int:
    return -(-num_rows // 4) * 4


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping): a bijection under which nearby
    inputs give unrelated outputs."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _splitmix64_int(x: int) -> int:
    """_splitmix64 of one python int (a scalar costs a few numpy calls more than this)."""
    x = (x + 0x9E3779B97F4A7C15) & _UINT64_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _UINT64_MASK
    return x ^ (x >> 31)


def _mix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _splitmix64(_splitmix64(a) ^ b)


def _mix_int(a: int, b: int) -> int:
    return _splitmix64_int(_splitmix64_int(a & _UINT64_MASK) ^ (b & _UINT64_MASK))


def _as_uint64(values: list[int]) -> np.ndarray:
    return np.array([v & _UINT64_MASK for v in values], dtype=np.uint64)


def build_row_seeds(states: list[CachedRequestState], base_seed: int,
                    launch: int) -> np.ndarray:
    """[B] int64 Philox keys for one sampling launch. Row i of a seeded request: a mix of its
    seed and its num_sampled; any other row: a mix of base_seed (the runner's), the launch
    number and i."""
    num_rows = len(states)
    # mix(launch_key, i) = splitmix(splitmix(launch_key) ^ i): the scalar half in python ints.
    launch_mixed = _splitmix64_int(_mix_int(base_seed, launch))
    if num_rows == 1:
        keys = np.array([_splitmix64_int(launch_mixed)], dtype=np.uint64)
    else:
        keys = _splitmix64(np.uint64(launch_mixed) ^ np.arange(num_rows, dtype=np.uint64))
    seeded = [i for i, s in enumerate(states) if s.sampling_params.seed is not None]
    if seeded:
        keys[seeded] = _mix(_as_uint64([states[i].sampling_params.seed for i in seeded]),
                            _as_uint64([states[i].num_sampled for i in seeded]))
    return keys.view(np.int64)


def build_sampling_metadata(states: list[CachedRequestState], staging: SamplingStaging,
                            vocab_size: int, row_seeds: np.ndarray | None = None,
                            grammar: GrammarBitmask | None = None,
                            grammar_staging: GrammarStaging | None = None) -> SamplingMetadata:
    """row_seeds: [B] int64 from build_row_seeds, or None where the fused kernel cannot be used
    (the metadata then has no seeds). grammar: the step's grammar masks (with the staging that
    uploads them), None when no request of the step is constrained."""
    params = [s.sampling_params for s in states]
    device = staging.device
    greedy = [p.greedy for p in params]
    no_penalties = all(p.presence_penalty == 0 and p.frequency_penalty == 0
                       and p.repetition_penalty == 1.0 for p in params)
    blocked = {i: s.sampling_params.all_stop_token_ids for i, s in enumerate(states)
               if s.sampling_params.min_tokens
               and len(s.token_ids) - s.num_prompt_tokens < s.sampling_params.min_tokens
               and s.sampling_params.all_stop_token_ids}
    plain = [_needs_only_temperature(p) and i not in blocked for i, p in enumerate(params)]
    columns, int_columns = staging.upload(
        [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params],
         [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
         [p.repetition_penalty for p in params]],
        [[p.top_k for p in params],
         np.zeros(len(states), dtype=np.int64) if row_seeds is None else row_seeds, plain])
    temperature, top_p, min_p, presence, frequency, repetition = columns.unbind(0)
    top_k, seeds, plain_column = int_columns.unbind(0)
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
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    logit_bias = _logit_bias(params, biased, device) if biased else None
    grammar_rows = None
    if grammar is not None:
        grammar_rows = grammar_staging.upload(grammar, states)
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
        seeds=None if row_seeds is None else seeds,
        fused_rows=(plain_column.bool() if row_seeds is not None and any(plain)
                    and not all(plain) else None),
        logit_bias=logit_bias,
        grammar_bitmask=None if grammar_rows is None else grammar_rows[0],
        grammar_rows=None if grammar_rows is None else grammar_rows[1],
    )


def _logit_bias(params: list[SamplingParams], rows: list[int], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    row_ids = [i for i in rows for _ in params[i].logit_bias]
    token_ids = [t for i in rows for t in params[i].logit_bias]
    biases = [b for i in rows for b in params[i].logit_bias.values()]
    return (torch.tensor(row_ids, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(token_ids, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(biases, dtype=torch.float32).to(device, non_blocking=True))


def _needs_only_temperature(params: SamplingParams) -> bool:
    """Whether the fused kernel can sample this request: temperature or greedy, nothing else
    (min_tokens blocking is checked per step)."""
    return (params.presence_penalty == 0 and params.frequency_penalty == 0
            and params.repetition_penalty == 1.0 and params.top_k <= 0 and params.top_p >= 1.0
            and params.min_p <= 0.0 and params.logprobs is None)
