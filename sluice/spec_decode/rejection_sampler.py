"""Exact rejection sampling of a batch of draft tokens against the target model's logits.

Per row, with n real drafts x_0..x_{n-1} and target logits at positions 0..n (n is the bonus
position):

- greedy rows (temperature < 1e-5) accept x_j while it equals the target argmax at j, then emit
  the target argmax at the first mismatch, or at position n when every draft was accepted;
- random rows turn the target logits into p_j exactly as the Sampler does for a row
  (temperature, min-p, top-k, top-p), accept x_j with probability min(1, p_j(x_j) / q_j(x_j))
  until the first rejection, then emit one token from normalize(max(0, p_j - q_j)) at the first
  rejected position j, or from p_n when every draft was accepted. The emitted tokens then follow
  the target distribution exactly. A proposer without probabilities (n-gram) has q one-hot on
  its draft token.

Not handled here: penalties and min_tokens blocking depend on the tokens before each position,
so they are not applied (SamplingMetadata's penalty and blocked-token fields are ignored), nor
are logprobs computed.

Randomness. Only one token per row is ever drawn from a distribution (the first rejection's
residual or the bonus), and the position it is drawn at depends on the uniforms alone, so one
row of V exponentials serves whichever position it is: the draw is the exponential race
argmax(r / e), e ~ Exp(1), which picks from r exactly without normalising it. A seeded row draws
from its own generator exactly n uniforms then V exponentials (none when greedy), so its output
does not depend on the batch; with n = 0 that is the same stream the Sampler uses for a step.
Seeded rows cost one host read of num_draft_tokens (and of the temperatures in batches that mix
greedy and random rows); nothing else syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.sample.metadata import SamplingMetadata
from sluice.sample.sampler import apply_min_p, apply_top_k_top_p

# Greedy is temperature below this (as SamplingParams.greedy).
_SAMPLING_EPS = 1e-5
# Marks the unused tail of output_token_ids.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class RejectionSamplerOutput:
    # [B, k + 1] int64: the accepted drafts, then the recovered or bonus token, then -1.
    output_token_ids: torch.Tensor
    # [B] int64 in [0, n]: accepted drafts per row; the row emits num_accepted + 1 tokens.
    num_accepted: torch.Tensor


class RejectionSampler:
    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        # Rows without their own generator draw from this (None: torch's global RNG).
        self.default_generator = default_generator

    def __call__(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        sampling: SamplingMetadata,
    ) -> RejectionSamplerOutput:
        """draft_token_ids: [B, k] int64, a row's entries past its num_draft_tokens are ignored
        (any value, -1 included); num_draft_tokens: [B] int64 in [0, k] (not checked: that would
        sync); draft_probs: [B, k, V] float32 proposer distributions q, None for a proposer whose
        q is one-hot on its draft; target_logits: [B, k + 1, V] raw target logits at the draft
        positions and the bonus position (a row with n drafts uses positions 0..n)."""
        num_rows, max_num_drafts = draft_token_ids.shape
        assert target_logits.dim() == 3 and target_logits.shape[:2] == (
            num_rows, max_num_drafts + 1), (
            f"target_logits must be [B, k + 1, V] = [{num_rows}, {max_num_drafts + 1}, V], "
            f"got {tuple(target_logits.shape)}")
        vocab_size = target_logits.shape[-1]
        assert draft_probs is None or tuple(draft_probs.shape) == (
            num_rows, max_num_drafts, vocab_size), (
            f"draft_probs must be [{num_rows}, {max_num_drafts}, {vocab_size}], "
            f"got {tuple(draft_probs.shape)}")
        assert num_draft_tokens.shape == (num_rows,)
        device = target_logits.device
        draft_token_ids = draft_token_ids.to(device=device, dtype=torch.int64)
        num_draft_tokens = num_draft_tokens.to(device=device, dtype=torch.int64)
        # is_real_draft: [B, k]
        is_real_draft = (torch.arange(max_num_drafts, device=device)[None, :]
                         < num_draft_tokens[:, None])
        # Padding drafts may be -1: clamped so they can be gathered; is_real_draft masks them.
        draft_ids = draft_token_ids.clamp(0, vocab_size - 1)

        if sampling.all_greedy:
            num_accepted, emitted = _greedy(draft_ids, is_real_draft, target_logits)
        elif sampling.all_random:
            num_accepted, emitted = self._random(draft_ids, is_real_draft, num_draft_tokens,
                                                 draft_probs, target_logits, sampling)
        else:
            greedy_accepted, greedy_emitted = _greedy(draft_ids, is_real_draft, target_logits)
            random_accepted, random_emitted = self._random(
                draft_ids, is_real_draft, num_draft_tokens, draft_probs, target_logits, sampling)
            is_greedy = sampling.temperature.to(device) < _SAMPLING_EPS
            num_accepted = torch.where(is_greedy, greedy_accepted, random_accepted)
            emitted = torch.where(is_greedy, greedy_emitted, random_emitted)
        return RejectionSamplerOutput(
            _assemble(draft_token_ids, num_accepted, emitted), num_accepted)

    def warm_up(self, target_logits: torch.Tensor) -> None:
        """Run each path once, before the first request: a greedy batch, and a mixed one whose
        random row uses min-p, top-k and top-p (every row with a generator of its own: the
        shared one is left as it was). target_logits: [2, k + 1, V] as verification makes
        them (their values do not matter). CUDA loads a kernel on its first launch and waits
        for the device to go idle to do so, which otherwise stalls the first verification of a
        run (benchmarks/journal/2026-11-28-first-use-stalls.md)."""
        num_rows, num_positions, _ = target_logits.shape
        device = target_logits.device
        drafts = torch.zeros((num_rows, num_positions - 1), dtype=torch.int64, device=device)
        counts = torch.full((num_rows,), num_positions - 1, dtype=torch.int64, device=device)
        counts[-1] = 0  # a row without drafts samples its one token
        ones = torch.ones(num_rows, device=device)
        for greedy in (True, False):
            temperature = torch.zeros(num_rows, device=device)
            if not greedy:
                temperature[-1] = 0.7
            self(drafts, counts, None, target_logits, SamplingMetadata(
                temperature=temperature, all_greedy=greedy, all_random=False,
                top_k=None if greedy else torch.full((num_rows,), 20, device=device),
                top_p=None if greedy else 0.9 * ones, min_p=None if greedy else 0.05 * ones,
                # Every row its own generator: the shared one draws nothing here.
                generators={} if greedy else {
                    row: torch.Generator(device).manual_seed(row) for row in range(num_rows)},
                max_num_logprobs=None, no_penalties=True, presence_penalties=0 * ones,
                frequency_penalties=0 * ones, repetition_penalties=ones,
                prompt_token_ids=None, output_token_ids=[[] for _ in range(num_rows)],
                blocked_token_ids={}))

    def _random(
        self,
        draft_ids: torch.Tensor,
        is_real_draft: torch.Tensor,
        num_draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        sampling: SamplingMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_rows, max_num_drafts = draft_ids.shape
        vocab_size = target_logits.shape[-1]
        # target_probs: [B, k + 1, V]
        target_probs = target_probabilities(target_logits, sampling)
        # p_j(x_j), q_j(x_j): [B, k]
        target_draft_probs = target_probs[:, :max_num_drafts].gather(
            2, draft_ids[:, :, None]).squeeze(2)
        if draft_probs is None:
            draft_draft_probs = torch.ones_like(target_draft_probs)
        else:
            draft_draft_probs = draft_probs.gather(
                2, draft_ids[:, :, None]).squeeze(2).to(torch.float32)

        uniforms, exponentials = self._draw(num_rows, max_num_drafts, vocab_size,
                                            num_draft_tokens, sampling, target_logits.device)
        # u < p / q without dividing: p = 0 never accepts (u >= 0), q = 0 < p always does.
        accepted = (uniforms * draft_draft_probs < target_draft_probs) & is_real_draft
        num_accepted = _count_leading(accepted)

        # The emitted token: at the first rejection j < n from max(0, p_j - q_j), at the bonus
        # position n from p_n (q taken as 0 there).
        rows = torch.arange(num_rows, device=target_logits.device)
        emit_target = target_probs[rows, num_accepted]  # [B, V]
        if max_num_drafts == 0:
            emit_draft = torch.zeros_like(emit_target)
        else:
            draft_position = num_accepted.clamp(max=max_num_drafts - 1)
            if draft_probs is None:
                emit_draft = torch.zeros_like(emit_target).scatter_(
                    1, draft_ids[rows, draft_position][:, None], 1.0)
            else:
                emit_draft = draft_probs[rows, draft_position].to(torch.float32)
            emit_draft = emit_draft * (num_accepted < num_draft_tokens)[:, None]
        residual = (emit_target - emit_draft).clamp_min_(0.0)
        # p == q leaves no residual; a rejection is then reachable only through rounding.
        has_residual = residual.sum(dim=-1, keepdim=True) > 0
        residual = torch.where(has_residual, residual, emit_target)
        return num_accepted, residual.div_(exponentials).argmax(dim=-1)

    def _draw(self, num_rows: int, max_num_drafts: int, vocab_size: int,
              num_draft_tokens: torch.Tensor, sampling: SamplingMetadata,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """uniforms [B, k] in [0, 1) for the acceptance tests, exponentials [B, V] for the one
        distribution draw per row."""
        generators = sampling.generators
        if len(generators) < num_rows:
            uniforms = torch.rand(num_rows, max_num_drafts, device=device,
                                  generator=self.default_generator)
            exponentials = torch.empty(num_rows, vocab_size, device=device).exponential_(
                generator=self.default_generator)
        else:
            uniforms = torch.zeros(num_rows, max_num_drafts, device=device)
            exponentials = torch.ones(num_rows, vocab_size, device=device)
        if generators:
            # The one host read: a seeded row's draw count is its own n (-1: greedy, no draws).
            counts = num_draft_tokens
            if not sampling.all_random:
                is_random = sampling.temperature.to(device) >= _SAMPLING_EPS
                counts = torch.where(is_random, counts, -1)
            draw_counts = counts.tolist()
            for row, generator in generators.items():
                count = draw_counts[row]
                if count < 0:
                    continue
                if count:
                    uniforms[row, :count] = torch.rand(count, device=device, generator=generator)
                exponentials[row] = torch.empty(vocab_size, device=device).exponential_(
                    generator=generator)
        # e == 0 would turn a zero-probability token into 0 / 0 = nan, which argmax picks.
        exponentials.clamp_min_(torch.finfo(exponentials.dtype).tiny)
        return uniforms, exponentials


def target_probabilities(target_logits: torch.Tensor,
                         sampling: SamplingMetadata) -> torch.Tensor:
    """[B, k + 1, V] logits -> [B, k + 1, V] float32 probabilities, each position processed as
    the Sampler processes its row: temperature, min-p, top-k, top-p (greedy rows at T = 1)."""
    num_rows, num_positions, vocab_size = target_logits.shape
    device = target_logits.device
    temperature = sampling.temperature.to(device)
    temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
    # logits: [B * (k + 1), V], row-major so row b's positions are contiguous.
    logits = (target_logits.to(torch.float32) / temperature[:, None, None]).reshape(
        num_rows * num_positions, vocab_size)

    def per_position(column: torch.Tensor | None) -> torch.Tensor | None:
        if column is None:
            return None
        return column.to(device).repeat_interleave(num_positions)

    if sampling.min_p is not None:
        logits = apply_min_p(logits, per_position(sampling.min_p))
    if sampling.top_k is not None or sampling.top_p is not None:
        logits = apply_top_k_top_p(logits, per_position(sampling.top_k),
                                   per_position(sampling.top_p))
    return logits.softmax(dim=-1).view(num_rows, num_positions, vocab_size)


def _greedy(draft_ids: torch.Tensor, is_real_draft: torch.Tensor,
            target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    max_num_drafts = draft_ids.shape[1]
    # target_argmax: [B, k + 1]
    target_argmax = target_logits.argmax(dim=-1)
    accepted = (draft_ids == target_argmax[:, :max_num_drafts]) & is_real_draft
    num_accepted = _count_leading(accepted)
    return num_accepted, target_argmax.gather(1, num_accepted[:, None]).squeeze(1)


def _count_leading(accepted: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] int64: the length of each row's leading run of True."""
    return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _assemble(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor,
              emitted: torch.Tensor) -> torch.Tensor:
    """[B, k + 1]: draft tokens before num_accepted, the emitted token at it, -1 after."""
    num_rows, max_num_drafts = draft_token_ids.shape
    positions = torch.arange(max_num_drafts + 1, device=draft_token_ids.device)[None, :]
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((num_rows, 1),
                                                                  PLACEHOLDER_TOKEN_ID)], dim=1)
    output = torch.where(positions < num_accepted[:, None], drafts, PLACEHOLDER_TOKEN_ID)
    return torch.where(positions == num_accepted[:, None], emitted[:, None], output)
