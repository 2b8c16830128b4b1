"""Sampler: greedy, raw logprobs, seeded reproducibility, truncation supports, penalties."""

from __future__ import annotations

import pytest
import torch

from sluice.sample.metadata import SamplingMetadata
from sluice.sample.sampler import (
    Sampler,
    apply_penalties,
    apply_top_k_top_p,
    compute_topk_logprobs,
)


def make_metadata(
    temperature: list[float],
    *,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    max_num_logprobs: int | None = None,
    penalties: tuple[list[float], list[float], list[float]] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
    output_token_ids: list[list[int]] | None = None,
    blocked_token_ids: dict[int, set[int]] | None = None,
    vocab_size: int = 0,
) -> SamplingMetadata:
    num_rows = len(temperature)
    greedy = [t < 1e-5 for t in temperature]
    presence, frequency, repetition = penalties or ([0.0] * num_rows, [0.0] * num_rows,
                                                    [1.0] * num_rows)
    prompt = None
    if penalties is not None:
        prompts = prompt_token_ids or [[] for _ in range(num_rows)]
        width = max(max(len(p) for p in prompts), 1)
        prompt = torch.tensor([p + [vocab_size] * (width - len(p)) for p in prompts])
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
        no_penalties=penalties is None,
        presence_penalties=torch.tensor(presence, dtype=torch.float32),
        frequency_penalties=torch.tensor(frequency, dtype=torch.float32),
        repetition_penalties=torch.tensor(repetition, dtype=torch.float32),
        prompt_token_ids=prompt,
        output_token_ids=output_token_ids or [[] for _ in range(num_rows)],
        blocked_token_ids=blocked_token_ids or {},
    )


def seeded_sampler(seed: int = 0) -> Sampler:
    return Sampler(default_generator=torch.Generator().manual_seed(seed))


def empirical(sampled: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(sampled, minlength=vocab_size).double() / sampled.numel()


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    out = seeded_sampler()(logits, make_metadata([0.0] * 5))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None
    assert out.sampled_token_ranks is None


def test_greedy_rows_in_a_mixed_batch_take_argmax() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    temperature = [0.0, 1.0, 0.0, 5.0, 0.0, 1.0]
    generators = {2: torch.Generator().manual_seed(3), 3: torch.Generator().manual_seed(4)}
    out = seeded_sampler()(logits, make_metadata(temperature, top_k=[0, 3, 0, 0, 2, 0],
                                                 generators=generators))
    greedy_rows = [0, 2, 4]
    assert torch.equal(out.sampled_token_ids[greedy_rows], logits[greedy_rows].argmax(dim=-1))


def test_logprobs_are_of_the_raw_distribution() -> None:
    vocab_size = 30
    logits = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(5))
    metadata = make_metadata(
        [0.0, 0.7, 1.3, 0.0], top_k=[0, 5, 0, 0], max_num_logprobs=3,
        penalties=([0.5] * 4, [0.3] * 4, [1.5] * 4), output_token_ids=[[1, 2]] * 4,
        blocked_token_ids={0: {int(logits[0].argmax())}}, vocab_size=vocab_size)
    out = seeded_sampler()(logits, metadata)

    reference = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprob_token_ids.shape == out.logprobs.shape == (4, 4)
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], reference.gather(1, sampled[:, None])[:, 0])
    top_values, top_ids = reference.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_values)
    order = reference.argsort(dim=-1, descending=True)
    expected_ranks = [order[row].tolist().index(int(sampled[row])) + 1 for row in range(4)]
    assert out.sampled_token_ranks.tolist() == expected_ranks
    # Row 0 had its argmax blocked: it took another token, whose rank is at least 2.
    assert expected_ranks[0] >= 2


def test_compute_topk_logprobs_with_zero_extra() -> None:
    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 2.0]]), dim=-1)
    ids, lps, ranks = compute_topk_logprobs(logprobs, 0, torch.tensor([2, 0]))
    assert ids.tolist() == [[2], [0]]
    torch.testing.assert_close(lps[:, 0], torch.stack([logprobs[0, 2], logprobs[1, 0]]))
    assert ranks.tolist() == [2, 1]
    ids, _, _ = compute_topk_logprobs(logprobs, 2, torch.tensor([0, 1]))
    assert ids.tolist() == [[0, 1, 2], [1, 0, 2]]


def _sequence(sampler: Sampler, step_logits: list[torch.Tensor], position: int,
              batch: list[tuple[float, int | None]], seed: int = 1234) -> list[int]:
    """Runs the steps with the tracked row (temperature 1, `seed`) at `position` among
    `batch` (temperature, seed or None); returns the tracked row's tokens."""
    rows = list(batch)
    rows.insert(position, (1.0, seed))
    generators = {i: torch.Generator().manual_seed(seed)
                  for i, (_, seed) in enumerate(rows) if seed is not None}
    other = torch.randn(len(rows), step_logits[0].numel(),
                        generator=torch.Generator().manual_seed(99))
    tokens = []
    for logits in step_logits:
        batch_logits = other.clone()
        batch_logits[position] = logits
        metadata = make_metadata([t for t, _ in rows], generators=generators,
                                 top_k=[0] * len(rows))
        tokens.append(int(sampler(batch_logits, metadata).sampled_token_ids[position]))
    return tokens


def test_seeded_row_is_reproducible_whatever_the_batch() -> None:
    vocab_size = 50
    gen = torch.Generator().manual_seed(7)
    step_logits = [0.3 * torch.randn(vocab_size, generator=gen) for _ in range(8)]

    alone = _sequence(Sampler(), step_logits, 0, [])
    assert len(set(alone)) > 2  # a near-flat distribution: the sequence is not trivially fixed
    layouts = [
        (1, [(0.8, 5), (1.0, None)]),
        (2, [(1.0, None), (0.0, 77), (1.5, 9)]),
        (0, [(1.0, None), (1.0, None)]),
        (3, [(0.0, None), (1.0, 1234 + 1), (0.5, None)]),
    ]
    for position, others in layouts:
        # A fresh default generator each time: unseeded rows draw differently in every run.
        sampler = seeded_sampler(position + 100)
        assert _sequence(sampler, step_logits, position, others) == alone

    # The tracked row's tokens do depend on its seed.
    other_seed = _sequence(Sampler(), step_logits, 1, [(1.0, 1234)], seed=4321)
    assert other_seed != alone


def test_seeded_row_draws_exactly_one_exponential_vector_per_step() -> None:
    vocab_size = 20
    logits = torch.randn(2, vocab_size, generator=torch.Generator().manual_seed(8))
    g_random = torch.Generator().manual_seed(11)
    g_greedy = torch.Generator().manual_seed(12)
    greedy_state = g_greedy.get_state()
    metadata = make_metadata([1.0, 0.0], generators={0: g_random, 1: g_greedy})
    token = int(Sampler()(logits, metadata).sampled_token_ids[0])

    reference = torch.Generator().manual_seed(11)
    q = torch.empty(vocab_size).exponential_(generator=reference)
    assert token == int((logits[0].softmax(-1) / q).argmax())
    assert torch.equal(g_random.get_state(), reference.get_state())
    assert torch.equal(g_greedy.get_state(), greedy_state)


NUM_DRAWS = 20_000
_PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
_LOGITS = _PROBS.log()


def _renormalised(keep: list[int]) -> torch.Tensor:
    expected = torch.zeros_like(_PROBS, dtype=torch.float64)
    expected[keep] = _PROBS[keep].double()
    return expected / expected.sum()


@pytest.mark.parametrize(
    ("settings", "keep"),
    [
        ({"top_k": 3}, [0, 1, 2]),
        ({"top_k": 1}, [0]),
        ({"top_p": 0.6}, [0, 1]),         # 0.40 < 0.6 <= 0.65
        ({"top_p": 0.75}, [0, 1, 2]),     # 0.65 < 0.75 <= 0.80
        ({"top_p": 0.1}, [0]),            # the top token is always kept
        ({"min_p": 0.3}, [0, 1, 2]),      # threshold 0.12
        ({"min_p": 0.5}, [0, 1]),         # threshold 0.20
        # Top-p over the renormalised top 4: 0.65 / 0.9 < 0.85 <= 0.80 / 0.9.
        ({"top_k": 4, "top_p": 0.85}, [0, 1, 2]),
        ({"top_p": 0.85}, [0, 1, 2, 3]),  # 0.80 < 0.85 <= 0.90
        ({"min_p": 0.2, "top_k": 5}, [0, 1, 2, 3]),  # threshold 0.08
        ({}, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_truncation_never_leaves_its_support(settings: dict[str, float], keep: list[int]) -> None:
    logits = _LOGITS.expand(NUM_DRAWS, -1).clone()
    kwargs = {name: [value] * NUM_DRAWS for name, value in settings.items()}
    out = seeded_sampler(3)(logits, make_metadata([1.0] * NUM_DRAWS, **kwargs))
    freq = empirical(out.sampled_token_ids, _PROBS.numel())
    outside = [t for t in range(_PROBS.numel()) if t not in keep]
    assert freq[outside].sum() == 0
    assert (freq - _renormalised(keep)).abs().max() < 0.02


def test_per_row_settings_in_one_batch() -> None:
    per_config = 5_000
    # Rows alternate: off, top_k 2, top_p 0.6, min_p 0.5 (tensors hold "off" values elsewhere).
    top_k = [0, 2, 0, 0] * per_config
    top_p = [1.0, 1.0, 0.6, 1.0] * per_config
    min_p = [0.0, 0.0, 0.0, 0.5] * per_config
    logits = _LOGITS.expand(4 * per_config, -1).clone()
    metadata = make_metadata([1.0] * len(top_k), top_k=top_k, top_p=top_p, min_p=min_p)
    sampled = seeded_sampler(4)(logits, metadata).sampled_token_ids.view(per_config, 4)
    for column, keep in enumerate([[0, 1, 2, 3, 4, 5], [0, 1], [0, 1], [0, 1]]):
        freq = empirical(sampled[:, column], _PROBS.numel())
        assert (freq - _renormalised(keep)).abs().max() < 0.03


def test_temperature_scales_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for temperature in (0.5, 2.0):
        batch = logits.expand(NUM_DRAWS, -1).clone()
        out = seeded_sampler(5)(batch, make_metadata([temperature] * NUM_DRAWS))
        expected = (logits / temperature).softmax(-1).double()
        assert (empirical(out.sampled_token_ids, 4) - expected).abs().max() < 0.02


def test_top_k_keeps_exactly_k_tokens_under_ties() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isfinite(masked).sum() == 2
    assert torch.equal(masked[torch.isfinite(masked)], torch.tensor([1.0, 1.0]))


def test_blocked_tokens_are_never_sampled() -> None:
    num_rows = 2_000
    logits = torch.tensor([0.0, 10.0, 0.5, 9.0]).expand(num_rows, -1).clone()
    temperature = [0.0 if row % 2 else 2.0 for row in range(num_rows)]
    blocked = {row: {1, 3} for row in range(num_rows)}
    out = seeded_sampler(6)(logits, make_metadata(temperature, blocked_token_ids=blocked))
    sampled = out.sampled_token_ids
    assert not torch.isin(sampled, torch.tensor([1, 3])).any()
    assert (sampled[1::2] == 2).all()  # greedy rows take the best unblocked token
    assert set(sampled[0::2].tolist()) == {0, 2}


def test_penalties_follow_the_formulas() -> None:
    vocab_size = 6
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]] * 2)
    prompt = torch.tensor([[0, 1, vocab_size], [0, 1, 2]])
    presence = torch.tensor([0.25, 0.0])
    frequency = torch.tensor([0.5, 0.0])
    repetition = torch.tensor([2.0, 1.0])
    penalised = apply_penalties(logits, prompt, [[2, 2, 3], [4]], presence, frequency, repetition)
    expected_row0 = [
        2.0 / 2,                        # prompt, positive: divided
        -1.0 * 2,                       # prompt, negative: multiplied
        0.5 / 2 - 0.5 * 2 - 0.25,       # output twice
        -0.5 * 2 - 0.5 * 1 - 0.25,      # output once
        3.0,
        1.0,
    ]
    assert penalised[0].tolist() == pytest.approx(expected_row0)
    assert torch.equal(penalised[1], logits[1])  # penalties at their "off" values
    assert logits[0, 0] == 2.0  # the input is not modified


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    metadata = make_metadata([0.0], penalties=([0.0], [0.0], [1.2]),
                             prompt_token_ids=[[0]], output_token_ids=[[]], vocab_size=4)
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1]
    metadata = make_metadata([0.0], penalties=([0.2], [0.0], [1.0]),
                             output_token_ids=[[0]], vocab_size=4)
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1]
    metadata = make_metadata([0.0], penalties=([0.0], [0.1], [1.0]),
                             output_token_ids=[[0, 0]], vocab_size=4)
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1]


def test_default_generator_makes_unseeded_rows_repeatable() -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(9))
    metadata = make_metadata([1.0] * 8)
    first = seeded_sampler(42)(logits, metadata).sampled_token_ids
    second = seeded_sampler(42)(logits, metadata).sampled_token_ids
    third = seeded_sampler(43)(logits, metadata).sampled_token_ids
    assert torch.equal(first, second)
    assert not torch.equal(first, third)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_up_runs_the_torch_path_and_leaves_the_shared_generator_alone(dtype):
    """The warm-up (before the first request, on a GPU engine) runs the torch path with every
    feature on (top-k/p, min-p, penalties, blocked tokens, logprobs, logit_bias), its random row
    on a generator of its own: the sampler draws afterwards what it would have drawn without
    it."""
    logits = torch.randn(4, 64).to(dtype)
    warmed, fresh = seeded_sampler(9), seeded_sampler(9)
    warmed.warm_up(logits)
    metadata = make_metadata([1.0, 0.7, 0.0])
    want = fresh(logits[:3], metadata).sampled_token_ids
    assert torch.equal(warmed(logits[:3], metadata).sampled_token_ids, want)
