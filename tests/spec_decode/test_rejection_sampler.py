"""Rejection sampler: exact greedy verification, output distribution equal to the target's,
acceptance rates, truncated supports, seeded reproducibility, output layout."""

from __future__ import annotations

import pytest
import torch

from sluice.sample.metadata import SamplingMetadata
from sluice.sample.sampler import Sampler
from sluice.spec_decode.rejection_sampler import (
    RejectionSampler,
    RejectionSamplerOutput,
    target_probabilities,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NUM_DRAWS = 100_000


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def make_metadata(temperature: list[float], device: str = "cpu", *,
                  top_k: list[int] | None = None, top_p: list[float] | None = None,
                  min_p: list[float] | None = None,
                  generators: dict[int, torch.Generator] | None = None) -> SamplingMetadata:
    num_rows = len(temperature)
    greedy = [t < 1e-5 for t in temperature]

    def column(values: list | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if values is None else torch.tensor(values, dtype=dtype, device=device)

    return SamplingMetadata(
        temperature=column(temperature, torch.float32),
        all_greedy=all(greedy), all_random=not any(greedy),
        top_k=column(top_k, torch.int64), top_p=column(top_p, torch.float32),
        min_p=column(min_p, torch.float32), generators=generators or {},
        max_num_logprobs=None, no_penalties=True,
        presence_penalties=torch.zeros(num_rows, device=device),
        frequency_penalties=torch.zeros(num_rows, device=device),
        repetition_penalties=torch.ones(num_rows, device=device),
        prompt_token_ids=None, output_token_ids=[[] for _ in range(num_rows)],
        blocked_token_ids={},
    )


def seeded(seed: int = 0, device: str = "cpu") -> RejectionSampler:
    return RejectionSampler(default_generator=torch.Generator(device).manual_seed(seed))


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    return 0.5 * (counts / tokens.numel() - probs.double().cpu()).abs().sum().item()


def check_layout(out: RejectionSamplerOutput, draft_token_ids: torch.Tensor,
                 num_draft_tokens: torch.Tensor) -> None:
    """Accepted drafts, then one emitted token, then -1; 0 <= num_accepted <= n."""
    num_rows, max_num_drafts = draft_token_ids.shape
    tokens, accepted = out.output_token_ids.cpu(), out.num_accepted.cpu()
    assert tokens.shape == (num_rows, max_num_drafts + 1) and tokens.dtype == torch.int64
    assert accepted.dtype == torch.int64
    assert ((accepted >= 0) & (accepted <= num_draft_tokens.cpu())).all()
    positions = torch.arange(max_num_drafts + 1)[None, :]
    drafts = torch.cat([draft_token_ids.cpu(), torch.full((num_rows, 1), -1)], dim=1)
    before = positions < accepted[:, None]
    assert torch.equal(tokens[before], drafts[before])
    assert (tokens.gather(1, accepted[:, None]) >= 0).all()
    assert (tokens[positions > accepted[:, None]] == -1).all()


def peaked_logits(token_ids: list[list[int]], vocab_size: int, seed: int = 0) -> torch.Tensor:
    """[B, len, V]: noise below 0.5, +5 on the given token at each position (its argmax)."""
    ids = torch.tensor(token_ids)
    noise = torch.rand(*ids.shape, vocab_size, generator=torch.Generator().manual_seed(seed))
    return noise * 0.5 + 5.0 * torch.nn.functional.one_hot(ids, vocab_size)


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_accepts_the_matching_prefix_then_emits_the_target_argmax(k: int,
                                                                         device: str) -> None:
    vocab_size = 12
    target = [(3 * j + 1) % vocab_size for j in range(k + 1)]  # argmax at positions 0..k
    middle = k // 2
    wrong = lambda token: (token + 5) % vocab_size
    drafts = [target[:k],                                           # all accepted + bonus
              [wrong(target[0])] + target[1:k],                     # first rejected
              target[:middle] + [wrong(target[middle])] + target[middle + 1:k],  # middle
              target[:middle] + [wrong(t) for t in target[middle:k]]]  # later ones wrong too
    expected_accepted = [k, 0, middle, middle]
    expected = [target[:a + 1] + [-1] * (k - a) for a in expected_accepted]
    logits = peaked_logits([target] * len(drafts), vocab_size).to(device)
    draft_ids = torch.tensor(drafts, device=device)
    num_drafts = torch.full((len(drafts),), k, device=device)
    out = seeded(device=device)(draft_ids, num_drafts, None, logits,
                                make_metadata([0.0] * len(drafts), device))
    assert out.num_accepted.tolist() == expected_accepted
    assert out.output_token_ids.tolist() == expected
    check_layout(out, draft_ids, num_drafts)


def test_greedy_rows_with_fewer_drafts_stop_at_their_own_bonus_position(device: str) -> None:
    vocab_size, k = 10, 4
    target = [2, 7, 1, 8, 3]
    # Every padding draft matches the target too (or is -1): it must still be ignored.
    drafts = [target[:k]] * 5 + [[target[0], -1, -1, -1]]
    num_drafts = [0, 1, 2, 3, 4, 1]
    logits = peaked_logits([target] * 6, vocab_size).to(device)
    draft_ids = torch.tensor(drafts, device=device)
    n = torch.tensor(num_drafts, device=device)
    out = seeded(device=device)(draft_ids, n, None, logits, make_metadata([0.0] * 6, device))
    assert out.num_accepted.tolist() == [0, 1, 2, 3, 4, 1]
    assert out.output_token_ids.tolist() == [
        target[:m + 1] + [-1] * (k - m) for m in num_drafts]


def test_no_drafts_at_all_emits_the_bonus_token(device: str) -> None:
    logits = peaked_logits([[4], [6]], 8).to(device)
    out = seeded(device=device)(torch.empty(2, 0, dtype=torch.int64, device=device),
                                torch.zeros(2, dtype=torch.int64, device=device), None, logits,
                                make_metadata([0.0, 1.0], device))
    assert out.num_accepted.tolist() == [0, 0]
    assert out.output_token_ids.shape == (2, 1)
    assert out.output_token_ids[0].tolist() == [4]


def test_self_speculation_accepts_every_draft(device: str) -> None:
    """Greedy: draft = target argmax. Sampling: q = the target's own processed p."""
    num_rows, k, vocab_size = 64, 4, 16
    logits = torch.randn(num_rows, k + 1, vocab_size,
                         generator=torch.Generator().manual_seed(3)).to(device)
    argmax = logits.argmax(dim=-1)
    n = torch.full((num_rows,), k, device=device)
    out = seeded(device=device)(argmax[:, :k], n, None, logits,
                                make_metadata([0.0] * num_rows, device))
    assert out.num_accepted.tolist() == [k] * num_rows
    assert torch.equal(out.output_token_ids, argmax)

    metadata = make_metadata([0.8] * num_rows, device, top_k=[6] * num_rows)
    probs = target_probabilities(logits, metadata)
    drafts = torch.multinomial(probs[:, :k].reshape(-1, vocab_size), 1,
                               generator=torch.Generator(device).manual_seed(4))
    out = seeded(device=device)(drafts.view(num_rows, k), n, probs[:, :k], logits, metadata)
    assert out.num_accepted.tolist() == [k] * num_rows


# ---------------------------------------------------------------- distribution

V8 = torch.tensor
PAIRS = {  # name: (target p, proposer q), vocab 8
    "q_zero_where_p_has_mass": (V8([.3, .2, .15, .1, .1, .08, .05, .02]),
                                V8([.5, .5, 0, 0, 0, 0, 0, 0])),
    "p_zero_where_q_has_mass": (V8([.4, .3, .2, .1, 0, 0, 0, 0]), torch.full((8,), 1 / 8)),
    "q_equals_p": (V8([.05, .1, .15, .2, .2, .15, .1, .05]),
                   V8([.05, .1, .15, .2, .2, .15, .1, .05])),
    "peaked_p_flat_q": (V8([.86] + [.02] * 7), torch.full((8,), 1 / 8)),
    "flat_p_peaked_q": (torch.full((8,), 1 / 8), V8([.02] * 7 + [.86])),
    "disjoint_supports": (V8([.5, .5, 0, 0, 0, 0, 0, 0]), V8([0, 0, 0, 0, .5, .5, 0, 0])),
}


def draw_drafts(q: torch.Tensor, num_rows: int, seed: int) -> torch.Tensor:
    return torch.multinomial(q, num_rows, replacement=True,
                             generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_first_token_follows_the_target_distribution(pair: str, device: str) -> None:
    """k = 1, 100,000 draws: total variation between the first emitted token and p below 0.01
    (the expected TV of an exact sampler is about 0.004), and the acceptance rate within 0.01
    of sum(min(p, q)), which an always-reject-and-resample sampler would miss. Where p != q,
    TV(p, q) > 0.1, so emitting the drafts unchecked fails too."""
    p, q = PAIRS[pair]
    if pair != "q_equals_p":
        assert 0.5 * (p - q).abs().sum() > 0.1
    drafts = draw_drafts(q, NUM_DRAWS, seed=1)[:, None].to(device)
    logits = p.log()[None, None, :].expand(NUM_DRAWS, 2, 8).contiguous().to(device)
    n = torch.ones(NUM_DRAWS, dtype=torch.int64, device=device)
    draft_probs = q[None, None, :].expand(NUM_DRAWS, 1, 8).to(device)
    out = seeded(2, device)(drafts, n, draft_probs, logits,
                            make_metadata([1.0] * NUM_DRAWS, device))
    check_layout(out, drafts, n)
    assert total_variation(out.output_token_ids[:, 0], p) < 0.01
    acceptance = out.num_accepted.double().mean().item()
    assert abs(acceptance - torch.minimum(p, q).sum().item()) < 0.01
    if pair == "disjoint_supports":
        assert acceptance == 0.0


def test_a_proposer_dominating_the_target_leaves_no_residual_and_falls_back_to_p(
        device: str) -> None:
    """q >= p everywhere with q(x) > p(x) (as rounding can make it): a rejection leaves
    max(0, p - q) = 0, and the emitted token must then still follow p (TV < 0.01, 100,000
    draws), at acceptance rate 2 / 3 +- 0.01."""
    p = V8([.4, .2, .15, .1, .1, .05, 0, 0])
    q = p * 1.5
    drafts = draw_drafts(p, NUM_DRAWS, seed=17)[:, None].to(device)
    logits = p.log()[None, None, :].expand(NUM_DRAWS, 2, 8).contiguous().to(device)
    n = torch.ones(NUM_DRAWS, dtype=torch.int64, device=device)
    out = seeded(18, device)(drafts, n, q[None, None, :].expand(NUM_DRAWS, 1, 8).to(device),
                             logits, make_metadata([1.0] * NUM_DRAWS, device))
    assert abs(out.num_accepted.double().mean().item() - 2 / 3) < 0.01
    assert total_variation(out.output_token_ids[:, 0], p) < 0.01


@pytest.mark.parametrize("draft_token", [0, 3, 6])
def test_deterministic_proposer_keeps_the_target_distribution(draft_token: int,
                                                              device: str) -> None:
    """n-gram (q one-hot): the first token is within TV 0.01 of p over 100,000 draws, and the
    draft is accepted at rate p(draft) +- 0.01 (never when p(draft) = 0)."""
    p = V8([.4, .2, .15, .1, .1, .05, 0, 0])
    drafts = torch.full((NUM_DRAWS, 1), draft_token, device=device)
    logits = p.log()[None, None, :].expand(NUM_DRAWS, 2, 8).contiguous().to(device)
    n = torch.ones(NUM_DRAWS, dtype=torch.int64, device=device)
    out = seeded(5, device)(drafts, n, None, logits, make_metadata([1.0] * NUM_DRAWS, device))
    assert total_variation(out.output_token_ids[:, 0], p) < 0.01
    acceptance = out.num_accepted.double().mean().item()
    assert abs(acceptance - p[draft_token].item()) < 0.01
    if p[draft_token] == 0:
        assert acceptance == 0.0


def test_two_drafts_follow_the_target_distribution_at_every_position(device: str) -> None:
    """k = 2, 100,000 draws, position-independent p_0, p_1, p_2 (bonus) and q_0, q_1 (q_1 with
    zero mass where p_1 has mass). Bounds: first token TV < 0.01 from p_0; the second token of
    rows that accepted the first draft (>= 20,000 of them) TV < 0.015 from p_1; the bonus of
    rows that accepted both (>= 20,000) TV < 0.015 from p_2; the joint (first, second) of rows
    that accepted the first draft TV < 0.03 from (min(p_0, q_0) / a_0) x p_1; acceptance rates
    a_0, a_1 = sum(min(p_j, q_j)) within 0.01."""
    p = torch.stack([V8([.3, .25, .15, .1, .08, .06, .04, .02]),
                     V8([.05, .05, .1, .1, .2, .2, .15, .15]),
                     V8([.6, 0, .1, 0, .1, 0, .2, 0])])
    q = torch.stack([V8([.25, .3, .1, .15, .05, .05, .05, .05]),
                     V8([0, 0, .1, .1, .3, .2, .2, .1])])
    alpha = torch.minimum(p[:2], q).sum(dim=-1)
    drafts = torch.stack([draw_drafts(q[0], NUM_DRAWS, 6), draw_drafts(q[1], NUM_DRAWS, 7)],
                         dim=1).to(device)
    logits = p.log()[None].expand(NUM_DRAWS, 3, 8).contiguous().to(device)
    n = torch.full((NUM_DRAWS,), 2, device=device)
    out = seeded(8, device)(drafts, n, q[None].expand(NUM_DRAWS, 2, 8).to(device), logits,
                            make_metadata([1.0] * NUM_DRAWS, device))
    check_layout(out, drafts, n)
    tokens, accepted = out.output_token_ids.cpu(), out.num_accepted.cpu()
    assert total_variation(tokens[:, 0], p[0]) < 0.01
    first_accepted = accepted >= 1
    assert first_accepted.sum() >= 20_000 and (accepted == 2).sum() >= 20_000
    assert total_variation(tokens[first_accepted, 1], p[1]) < 0.015
    assert total_variation(tokens[accepted == 2, 2], p[2]) < 0.015
    joint = (torch.minimum(p[0], q[0]) / alpha[0])[:, None] * p[1][None, :]
    pairs = tokens[first_accepted, 0] * 8 + tokens[first_accepted, 1]
    assert total_variation(pairs, joint.flatten()) < 0.03
    assert abs(first_accepted.double().mean().item() - alpha[0].item()) < 0.01
    rate_1 = (accepted == 2).sum().item() / first_accepted.sum().item()
    assert abs(rate_1 - alpha[1].item()) < 0.01


def truncated_reference(logits: list[float], temperature: float, top_k: int, top_p: float,
                        min_p: float) -> torch.Tensor:
    """The sampler's order (temperature, min-p, top-k, top-p) for one row, written plainly."""
    probs = torch.tensor(logits, dtype=torch.float64).div(temperature).softmax(dim=0).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = [i for i in order if probs[i] >= min_p * probs[order[0]]]
    kept = kept[:top_k] if top_k > 0 else kept
    mass = sum(probs[i] for i in kept)
    support, before = [], 0.0
    for i in kept:
        if before >= top_p:
            break
        support.append(i)
        before += probs[i] / mass
    out = torch.zeros(len(probs), dtype=torch.float64)
    for i in support:
        out[i] = probs[i]
    return out / out.sum()


TRUNCATIONS = {  # name: (temperature, top_k, top_p, min_p)
    "temperature": (0.7, 0, 1.0, 0.0),
    "top_k": (1.0, 3, 1.0, 0.0),
    "top_p": (1.0, 0, 0.6, 0.0),
    "min_p": (1.0, 0, 1.0, 0.3),
    "all": (0.5, 5, 0.8, 0.05),
}


@pytest.mark.parametrize("truncation", sorted(TRUNCATIONS))
@pytest.mark.parametrize("proposer", ["flat_q", "ngram_outside_support"])
def test_truncated_target_is_followed_and_never_left(truncation: str, proposer: str,
                                                     device: str) -> None:
    """k = 2, 50,000 draws: no emitted token (draft, recovered or bonus) is outside the
    truncated support, and the first token is within TV 0.01 of the truncated target."""
    num_rows, vocab_size, k = 50_000, 10, 2
    temperature, top_k, top_p, min_p = TRUNCATIONS[truncation]
    base = torch.tensor([.3, .2, .15, .1, .08, .06, .05, .03, .02, .01]).log()
    expected = truncated_reference(base.tolist(), temperature, top_k, top_p, min_p)
    assert (expected == 0).any() or truncation == "temperature"
    logits = base[None, None, :].expand(num_rows, k + 1, vocab_size).contiguous().to(device)
    n = torch.full((num_rows,), k, device=device)
    if proposer == "flat_q":
        draft_probs = torch.full((num_rows, k, vocab_size), 1 / vocab_size, device=device)
        drafts = torch.randint(vocab_size, (num_rows, k),
                               generator=torch.Generator().manual_seed(9)).to(device)
    else:
        draft_probs, drafts = None, torch.full((num_rows, k), vocab_size - 1, device=device)
    metadata = make_metadata([temperature] * num_rows, device, top_k=[top_k] * num_rows,
                             top_p=[top_p] * num_rows, min_p=[min_p] * num_rows)
    out = seeded(10, device)(drafts, n, draft_probs, logits, metadata)
    check_layout(out, drafts, n)
    tokens = out.output_token_ids.cpu()
    emitted = tokens[tokens >= 0]
    assert (expected[emitted] > 0).all()
    assert total_variation(tokens[:, 0], expected) < 0.01


# ---------------------------------------------------------------- seeds and batches


def test_seeded_rows_are_reproducible_alone_and_in_any_batch(device: str) -> None:
    """A seeded row's tokens do not depend on its batch: other rows (seeded, unseeded, greedy),
    its place, the batch's k and the default generator's state."""
    vocab_size = 12
    logits = torch.randn(6, 5, vocab_size, generator=torch.Generator().manual_seed(11))
    draft_probs = torch.rand(6, 4, vocab_size, generator=torch.Generator().manual_seed(12))
    draft_probs /= draft_probs.sum(dim=-1, keepdim=True)
    drafts = logits[:, :4].argmax(dim=-1)  # often accepted, so rows emit several tokens
    drafts[:, 1] = torch.randint(vocab_size, (6,), generator=torch.Generator().manual_seed(13))

    def run_alone(seed: int) -> list[int]:
        # The row alone, padded to k = 2 (its own n).
        metadata = make_metadata([0.9], device, top_k=[6],
                                 generators={0: torch.Generator(device).manual_seed(seed)})
        out = seeded(0, device)(drafts[:1, :2].to(device), torch.tensor([2], device=device),
                                draft_probs[:1, :2].to(device), logits[:1, :3].to(device),
                                metadata)
        return out.output_token_ids[0].tolist() + [-1, -1]

    def run_batched(seed: int) -> list[int]:
        # Row 0's data at row 3 of a k = 4 batch: logits past its bonus position are garbage.
        order = [1, 2, 4, 0, 5]
        batch_logits = logits[order].clone()
        batch_logits[3, 3:] = 100.0
        batch_drafts = drafts[order].clone()
        batch_drafts[3, 2:] = -1
        greedy_generator = torch.Generator(device).manual_seed(99)
        greedy_state = greedy_generator.get_state()
        metadata = make_metadata(
            [1.0, 0.0, 0.5, 0.9, 1.3], device, top_k=[0, 0, 3, 6, 0],
            generators={0: torch.Generator(device).manual_seed(seed + 1), 1: greedy_generator,
                        3: torch.Generator(device).manual_seed(seed)})
        out = seeded(seed + 7, device)(
            batch_drafts.to(device), torch.tensor([4, 3, 1, 2, 0], device=device),
            draft_probs[order].to(device), batch_logits.to(device), metadata)
        assert torch.equal(greedy_generator.get_state(), greedy_state)
        return out.output_token_ids[3].tolist()

    results = [run_alone(seed) for seed in range(20)]
    assert results == [run_batched(seed) for seed in range(20)]
    assert len({tuple(r) for r in results}) > 3  # the seeds do change the outcome


def test_unseeded_rows_follow_the_default_generator(device: str) -> None:
    logits = torch.randn(32, 3, 12, generator=torch.Generator().manual_seed(14)).to(device)
    drafts = torch.randint(12, (32, 2), generator=torch.Generator().manual_seed(15)).to(device)
    n = torch.full((32,), 2, device=device)
    runs = [seeded(seed, device)(drafts, n, None, logits, make_metadata([1.0] * 32, device))
            for seed in (0, 0, 1)]
    assert torch.equal(runs[0].output_token_ids, runs[1].output_token_ids)
    assert not torch.equal(runs[0].output_token_ids, runs[2].output_token_ids)


def test_a_row_without_drafts_draws_what_the_sampler_draws(device: str) -> None:
    """n = 0 consumes a seeded row's generator as one Sampler step does: same token."""
    num_rows, vocab_size = 200, 16
    logits = torch.randn(num_rows, 3, vocab_size,
                         generator=torch.Generator().manual_seed(16)).to(device)

    def metadata() -> SamplingMetadata:
        return make_metadata([0.8] * num_rows, device, top_k=[8] * num_rows, generators={
            row: torch.Generator(device).manual_seed(row) for row in range(num_rows)})

    out = RejectionSampler()(torch.full((num_rows, 2), -1, device=device),
                             torch.zeros(num_rows, dtype=torch.int64, device=device), None,
                             logits, metadata())
    reference = Sampler()(logits[:, 0], metadata()).sampled_token_ids
    assert torch.equal(out.output_token_ids[:, 0], reference)
    assert (out.output_token_ids[:, 1:] == -1).all()


def test_warm_up_runs_every_path_and_leaves_the_shared_generator_alone(device):
    """The warm-up (before the first request: SpecDecoder.initialize_kv_cache) draws from a
    generator of its own: what the sampler draws afterwards is what it would have drawn
    without it."""
    logits = torch.randn(2, 4, 50, device=device)
    warmed, fresh = seeded(3, device), seeded(3, device)
    warmed.warm_up(logits)
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]], device=device)
    counts = torch.tensor([3, 2], device=device)
    metadata = make_metadata([0.8, 1.0], device)
    want = fresh(drafts, counts, None, logits, metadata)
    got = warmed(drafts, counts, None, logits, metadata)
    assert torch.equal(want.output_token_ids, got.output_token_ids)
    assert torch.equal(want.num_accepted, got.num_accepted)
