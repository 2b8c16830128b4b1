"""Next-token sampling for a batch of last-position logits, with vLLM v1 semantics.

Per step:
1. logprobs of the raw model distribution (log_softmax of the logits as given), if a row asks;
   then, in steps that have them, the token constraints: logit_bias added (OpenAI's: the
   logprobs do not see it, as in vLLM) and the grammar masks of structured-output rows (their
   disallowed tokens -inf), on a float32 copy of the logits;
2. blocked tokens (EOS / stop ids while below min_tokens) get -inf;
3. penalties: repetition over prompt + output tokens, frequency and presence over output tokens;
4. greedy rows take the argmax of the penalised logits;
5. random rows: temperature, min-p, top-k, top-p, then the exponential race argmax(p / q) with
   q ~ Exp(1), which draws from p exactly.

A seeded row is reproducible whatever the batch: its q comes from its own generator, exactly V
exponentials per step when it samples and none when it is greedy. Every mask sets logits to -inf,
so a masked token has probability exactly 0 and can never win the race.

Fused path: on CUDA, rows that need nothing but temperature or greedy (no penalties, blocked
tokens, top-k / top-p / min-p or logprobs) sample in two Triton kernels that read the logits
once in their own dtype, and one chunk of them again (a two-level race, triton_sampling.py). A
batch of only such rows skips the torch path; in a mixed batch the torch path runs as below and
those rows take the kernels' tokens instead, so a row's path depends on its own request, never
on its batch mates. The kernels' exponentials come
from Philox keyed by the per-row seeds in metadata.seeds, not from torch generators: a seeded
request is reproducible from its seed and the number of tokens it has sampled, whatever the
batch, but its tokens are not bit-equal to the torch path's. The torch path (the CPU reference)
is unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from sluice.sample.metadata import SamplingMetadata

logger = logging.getLogger("sluice")

# Greedy is temperature below this (as SamplingParams.greedy).
_SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class SamplerOutput:
    # [B] int64
    sampled_token_ids: torch.Tensor
    # [B, max_num_logprobs + 1]: the sampled token, then the top-N ids.
    logprob_token_ids: torch.Tensor | None
    # [B, max_num_logprobs + 1] float32, matching logprob_token_ids.
    logprobs: torch.Tensor | None
    # [B] int64: rank of the sampled token in the raw distribution (1 = most likely).
    sampled_token_ranks: torch.Tensor | None


class Sampler(nn.Module):
    def __init__(self, default_generator: torch.Generator | None = None,
                 use_triton: bool | None = None) -> None:
        super().__init__()
        # Rows without their own generator draw from this (None: torch's global RNG).
        self.default_generator = default_generator
        # The fused kernel for the rows that allow it: None = for CUDA logits; True = for CPU
        # logits too (Triton's interpreter, in tests); False = never.
        self.use_triton = use_triton

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits: [B, V] float32 or the model's dtype (the torch path works in float32)
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        raw_logprobs = None
        if metadata.logit_bias is not None or metadata.grammar_bitmask is not None:
            if metadata.max_num_logprobs is not None:
                raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
            logits = apply_token_constraints(logits, metadata)
        if self.uses_fused_kernel(logits, metadata):
            return SamplerOutput(self._sample_fused(logits, metadata), None, None, None)
        fused = None
        if self.kernel_allowed(logits) and metadata.fused_rows is not None:
            fused = self._sample_fused(logits, metadata)  # for the rows that need only it
        logits = logits.to(torch.float32)
        if metadata.max_num_logprobs is not None and raw_logprobs is None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = apply_blocked_tokens(logits, metadata.blocked_token_ids)
        if not metadata.no_penalties:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        sampled = self._sample(logits, metadata)
        if fused is not None:
            sampled = torch.where(metadata.fused_rows, fused, sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, lps, ranks = compute_topk_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled, ids, lps, ranks)

    def kernel_allowed(self, logits: torch.Tensor) -> bool:
        """Whether the fused kernel may run on these logits (see use_triton)."""
        return bool(self.use_triton) or (self.use_triton is None and logits.is_cuda)

    def uses_fused_kernel(self, logits: torch.Tensor, metadata: SamplingMetadata) -> bool:
        """Whether the fused kernel samples the whole batch (no torch path): allowed on the
        logits' device, row seeds built, and no row asks beyond temperature and greedy."""
        return (self.kernel_allowed(logits) and metadata.seeds is not None
                and metadata.no_penalties and not metadata.blocked_token_ids
                and metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
                and metadata.max_num_logprobs is None)

    def warm_up(self, logits: torch.Tensor) -> None:
        """Run every path now, not in the steps of the first requests that use it: the fused
        kernels on the model's logits and on the float32 copy that logit_bias and grammars make
        (each a Triton variant), and the torch path with every feature on (CUDA loads a kernel
        on its first launch and waits for the device to go idle): otherwise a feature's first
        request stalls every running one (benchmarks/journal/2026-11-28-first-use-stalls.md).
        One variant
        serves every batch size. logits: [>= 2, V] in the model's dtype. Every random row has
        a generator of its own, so the shared one draws nothing."""
        logits = logits[:2]
        device = logits.device
        num_rows, vocab_size = logits.shape
        temperature = torch.tensor([0.0, 1.0], device=device)  # a greedy, a random row
        seeds = torch.tensor([1, 2], dtype=torch.int64, device=device)
        if self.kernel_allowed(logits):
            from sluice.sample.triton_sampling import sample_tokens

            sample_tokens(logits, temperature, seeds)
            sample_tokens(logits.to(torch.float32), temperature, seeds)
        ones = torch.ones(num_rows, device=device)
        metadata = SamplingMetadata(
            temperature=temperature, all_greedy=False, all_random=False,
            top_k=torch.full((num_rows,), 20, dtype=torch.int64, device=device),
            top_p=0.9 * ones, min_p=0.05 * ones,
            generators={row: torch.Generator(device).manual_seed(row) for row in range(num_rows)},
            max_num_logprobs=2, no_penalties=False, presence_penalties=0.5 * ones,
            frequency_penalties=0.5 * ones, repetition_penalties=1.2 * ones,
            prompt_token_ids=torch.zeros((num_rows, 1), dtype=torch.int64, device=device),
            output_token_ids=[[1], [2]], blocked_token_ids={0: {3}}, seeds=seeds,
            logit_bias=(torch.tensor([1], device=device), torch.tensor([4], device=device),
                        torch.tensor([1.0], device=device)))
        self(logits, metadata)
        if device.type == "cuda" and _has_xgrammar():
            # xgrammar's bitmask kernel (Triton on CUDA), every token allowed. Where it cannot
            # run, structured-output requests fail with its error as they did; the engine
            # still starts.
            bitmask = torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32,
                                 device=device)
            try:
                apply_token_constraints(logits, dataclasses.replace(
                    metadata, grammar_bitmask=bitmask, grammar_rows=[0]))
            except Exception as error:  # an optional feature's warm-up: xgrammar's own errors
                logger.warning("structured outputs' bitmask kernel did not warm up: %s", error)

    def _sample_fused(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        # Imported here: CPU-only installs need no Triton, and tests choose its interpreter
        # before the kernels are defined.
        from sluice.sample.triton_sampling import sample_tokens

        return sample_tokens(logits, metadata.temperature, metadata.seeds)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None
        if not metadata.all_random:
            greedy = logits.argmax(dim=-1)
            if metadata.all_greedy:
                return greedy

        is_greedy = metadata.temperature < _SAMPLING_EPS
        # Greedy rows divide by 1 so the shared tensor math stays finite; their result is unused.
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        logits = logits / temperature[:, None]
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if metadata.min_p is None and metadata.top_k is None and metadata.top_p is None:
            # argmax(p / q) = argmax(logits - log q): no softmax needed (a pass fewer over
            # [B, V] each step, which matters at large batch).
            sampled = self._exponential_race(logits, metadata, log_space=True)
        else:
            sampled = self._exponential_race(logits.softmax(dim=-1), metadata)
        if greedy is None:
            return sampled
        return torch.where(is_greedy, greedy, sampled)

    def _exponential_race(self, probs: torch.Tensor, metadata: SamplingMetadata,
                          log_space: bool = False) -> torch.Tensor:
        # probs: [B, V] (or logits, log_space). argmax(p / q), q ~ Exp(1) i.i.d., draws from p.
        num_rows, vocab_size = probs.shape
        generators = metadata.generators
        if len(generators) < num_rows:
            q = torch.empty_like(probs).exponential_(generator=self.default_generator)
        else:
            q = torch.ones_like(probs)
        if generators:
            # A greedy seeded row must not consume its generator (one sync, only in mixed batches).
            random_rows = None if metadata.all_random else (
                metadata.temperature >= _SAMPLING_EPS).tolist()
            for row, generator in generators.items():
                if random_rows is None or random_rows[row]:
                    q[row] = torch.empty(vocab_size, device=probs.device,
                                         dtype=probs.dtype).exponential_(generator=generator)
        # q == 0 would turn a zero-probability token into 0 / 0 = nan, which argmax picks.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        if log_space:
            return probs.sub(q.log_()).argmax(dim=-1)  # -inf logits stay -inf: never drawn
        return probs.div(q).argmax(dim=-1)


def _has_xgrammar() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def apply_token_constraints(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """A float32 copy of logits [B, V] with every row's logit_bias added and the grammar rows'
    disallowed tokens at -inf (xgrammar's kernels: C++ on the CPU, Triton on CUDA)."""
    logits = logits.to(torch.float32, copy=True)
    if metadata.logit_bias is not None:
        rows, token_ids, biases = metadata.logit_bias
        logits.index_put_((rows, token_ids), biases, accumulate=True)
    if metadata.grammar_bitmask is not None:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, metadata.grammar_bitmask,
                                        vocab_size=logits.shape[-1],
                                        indices=metadata.grammar_rows)
    return logits


def apply_blocked_tokens(logits: torch.Tensor,
                         blocked_token_ids: dict[int, set[int]]) -> torch.Tensor:
    """Out of place: blocked (row, token) pairs get -inf. logits: [B, V]."""
    rows = [row for row, token_ids in blocked_token_ids.items() for _ in token_ids]
    if not rows:
        return logits
    cols = [token_id for token_ids in blocked_token_ids.values() for token_id in token_ids]
    logits = logits.clone()
    logits[torch.tensor(rows, device=logits.device),
           torch.tensor(cols, device=logits.device)] = float("-inf")
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Out of place. logits: [B, V]; prompt_token_ids: [B, P] padded with V; penalties: [B].

    Repetition: a token seen in the prompt or output has a positive logit divided by the
    penalty and a negative one multiplied. Then logit -= frequency * count_in_output
    + presence * (count_in_output > 0).
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    # The extra column V absorbs padding.
    max_output_len = max((len(ids) for ids in output_token_ids), default=0)
    width = max(max_output_len, 1)
    padded_output = torch.tensor([ids + [vocab_size] * (width - len(ids))
                                  for ids in output_token_ids], dtype=torch.int64, device=device)
    output_counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=device)
    output_counts.scatter_add_(1, padded_output, torch.ones_like(padded_output, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab_size]
    output_mask = output_counts > 0

    seen = output_mask
    if prompt_token_ids is not None:
        prompt_mask = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)
        prompt_mask.scatter_(1, prompt_token_ids.to(device=device, dtype=torch.int64), True)
        seen = seen | prompt_mask[:, :vocab_size]

    repetition = repetition_penalties[:, None]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency_penalties[:, None] * output_counts
    return logits - presence_penalties[:, None] * output_mask.to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Out of place: drop tokens whose probability is below min_p * the top probability.

    logits: [B, V]; min_p: [B], 0.0 = off.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Out of place, by a full sort: keep the k most likely tokens (ties broken by the sort),
    then the smallest prefix of them whose mass reaches top_p. The top token is always kept.

    logits: [B, V]; top_k: [B] int64, 0 = off; top_p: [B] float32, 1.0 = off.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    # drop: [B, V] in sorted order.
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
        positions = torch.arange(vocab_size, device=logits.device)
        drop = positions[None, :] >= k[:, None]
    if top_p is not None:
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Rows at 1.0 are off: rounding in the cumsum must not cut their tail.
        drop = drop | ((mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None])
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(-1, sorted_ids, drop)
    return logits.masked_fill(mask, float("-inf"))


def compute_topk_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs: [N, V] log-softmax; token_ids: [N].

    Returns ids [N, num_logprobs + 1] int64 and lps [N, num_logprobs + 1] float32 (the given
    token first, then the top num_logprobs), and ranks [N] int64: the number of tokens at least
    as likely as the given one (1 = most likely).
    """
    token_ids = token_ids.to(torch.int64)[:, None]
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)
    return token_ids, token_logprobs.to(torch.float32), ranks
