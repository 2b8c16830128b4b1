"""N-gram proposer: exact drafts on crafted sequences, agreement with a brute-force search, and
a search cost of about one pass over the sequence (counted, not timed)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.spec_decode.config import SpeculativeConfig
from sluice.spec_decode.ngram_proposer import NgramProposer, find_longest_ngram_match


def make_proposer(k: int, min_n: int, max_n: int) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=k,
            prompt_lookup_min=min_n,
            prompt_lookup_max=max_n,
        )
    )


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest n first; the earliest earlier occurrence (ending before the last token)."""
    num_tokens = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[num_tokens - n:]
        for start in range(num_tokens - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


# ----------------------------------------------------------------------------- crafted sequences


def test_no_recurring_ngram_proposes_nothing() -> None:
    assert make_proposer(4, 1, 4).propose([1, 2, 3, 4, 5]) == []
    # The last token recurs, but only 1-grams do and min_n is 2.
    assert make_proposer(4, 2, 4).propose([1, 2, 3, 9, 3]) == []


def test_vllm_docstring_example_truncates_at_the_end() -> None:
    # [4, 2, 3] has no earlier occurrence; [2, 3] does, followed by only three tokens.
    assert make_proposer(4, 2, 3).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_match_of_each_length_drafts_its_continuation(n: int) -> None:
    # The suffix [50 - n + 1, ..., 50] recurs at the start; one more token of it does not.
    ngram = list(range(51 - n, 51))
    tokens = ngram + [60, 61, 62, 63] + [7] + ngram
    assert find_longest_ngram_match(np.array(tokens), 1, 4) == (n, n)
    assert make_proposer(3, 1, 4).propose(tokens) == [60, 61, 62]
    assert make_proposer(3, n, n).propose(tokens) == [60, 61, 62]
    if n < 4:
        assert make_proposer(3, n + 1, 4).propose(tokens) == []


def test_longest_ngram_wins_over_an_earlier_shorter_one() -> None:
    tokens = [3, 30, 31, 1, 2, 3, 10, 11, 1, 2, 3]
    assert make_proposer(3, 1, 3).propose(tokens) == [10, 11, 1]
    # With only 1-grams allowed the earliest [3] wins.
    assert make_proposer(3, 1, 1).propose(tokens) == [30, 31, 1]


def test_earliest_occurrence_is_used_as_in_vllm() -> None:
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert make_proposer(3, 2, 2).propose(tokens) == [7, 1, 2]
    assert find_longest_ngram_match(np.array(tokens), 2, 2) == (2, 2)


def test_prompt_lookup_max_caps_the_ngram_length() -> None:
    tokens = [0, 3, 4, 5, 100, 1, 2, 3, 4, 5, 200, 1, 2, 3, 4, 5]
    assert make_proposer(3, 1, 5).propose(tokens) == [200, 1, 2]
    # Only the last 3 tokens are looked up, and [3, 4, 5] first occurs at index 1.
    assert make_proposer(3, 1, 3).propose(tokens) == [100, 1, 2]


def test_num_speculative_tokens_limits_the_draft() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert make_proposer(1, 1, 2).propose(tokens) == [3]
    assert make_proposer(2, 1, 2).propose(tokens) == [3, 4]
    assert make_proposer(5, 1, 2).propose(tokens) == [3, 4, 5, 6, 7]
    # The continuation runs into the suffix itself: the draft may repeat it.
    assert make_proposer(10, 1, 2).propose(tokens) == [3, 4, 5, 6, 7, 8, 1, 2]


def test_max_num_draft_tokens_caps_below_k() -> None:
    proposer = make_proposer(5, 1, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert proposer.propose(tokens, max_num_draft_tokens=2) == [3, 4]
    assert proposer.propose(tokens, max_num_draft_tokens=9) == [3, 4, 5, 6, 7]
    assert proposer.propose(tokens, max_num_draft_tokens=0) == []


def test_sequences_shorter_than_an_ngram_and_its_occurrence() -> None:
    assert make_proposer(3, 1, 4).propose([]) == []
    assert make_proposer(3, 1, 4).propose([7]) == []
    # [7, 7]: the 1-gram [7] recurs; the 2-gram would need a third token.
    assert make_proposer(3, 1, 4).propose([7, 7]) == [7]
    assert make_proposer(3, 2, 4).propose([7, 7]) == []
    assert make_proposer(3, 2, 4).propose([7, 7, 7]) == [7]


def test_repeated_tokens() -> None:
    # The 4-gram [7] * 4 first occurs at index 0; three tokens follow it.
    assert make_proposer(3, 1, 4).propose([7] * 10) == [7, 7, 7]
    # In [7] * 5 the earliest 4-gram is followed by one token only.
    assert make_proposer(3, 1, 4).propose([7] * 5) == [7]
    assert make_proposer(3, 1, 4).propose([5, 7, 7, 7, 7, 7]) == [7]


def test_numpy_input_of_any_integer_dtype_gives_python_ints() -> None:
    proposer = make_proposer(3, 1, 3)
    tokens = [9, 1, 2, 3, 4, 9, 1, 2]
    expected = [3, 4, 9]
    for dtype in (np.int32, np.int64, np.uint32):
        draft = proposer.propose(np.array(tokens, dtype=dtype))
        assert draft == expected
        assert all(type(token) is int for token in draft)
    assert proposer.propose(tuple(tokens)) == expected
    with pytest.raises(ValueError, match=r"1-D.*\(2, 4\)"):
        proposer.propose(np.array(tokens).reshape(2, 4))


def test_propose_batch_equals_propose_per_sequence() -> None:
    proposer = make_proposer(2, 1, 3)
    sequences: list[Any] = [
        [1, 2, 3, 1, 2],
        np.array([4, 5, 6], dtype=np.int32),
        [],
        [8, 8, 8, 8],
    ]
    assert proposer.propose_batch(sequences) == [[3, 1], [], [], [8]]
    assert proposer.propose_batch(sequences, [1, 2, 2, None]) == [[3], [], [], [8]]
    assert proposer.propose_batch([]) == []


def test_proposer_refuses_a_config_of_another_method() -> None:
    config = SpeculativeConfig(method="eagle", num_speculative_tokens=2, model="/some/head")
    with pytest.raises(ValueError, match="'ngram', got 'eagle'"):
        NgramProposer(config)


def test_vllm_default_lookup_window_is_five() -> None:
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    assert (proposer.min_n, proposer.max_n) == (5, 5)
    assert proposer.propose([1, 2, 3, 4, 9, 1, 2, 3, 4]) == []
    assert proposer.propose([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5]) == [9, 1]


# ----------------------------------------------------------------------------- brute force


def test_agrees_with_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    num_nonempty = 0
    for _ in range(4000):
        vocab = rng.randint(1, 4)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 6)
        expected = reference_propose(tokens, k, min_n, max_n)
        proposer = make_proposer(k, min_n, max_n)
        assert proposer.propose(tokens) == expected, (tokens, k, min_n, max_n)
        assert proposer.propose(np.array(tokens, dtype=np.int32)) == expected
        num_nonempty += bool(expected)
    # The sample exercises both outcomes in earnest.
    assert 1000 < num_nonempty < 3900


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), max_size=60),
    bounds=st.tuples(st.integers(1, 5), st.integers(0, 3)),
    k=st.integers(1, 8),
)
def test_agrees_with_brute_force_hypothesis(
    tokens: list[int], bounds: tuple[int, int], k: int
) -> None:
    min_n, extra = bounds
    max_n = min_n + extra
    assert make_proposer(k, min_n, max_n).propose(tokens) == reference_propose(
        tokens, k, min_n, max_n
    )


# ----------------------------------------------------------------------------- search cost


class CountingArray(np.ndarray):
    """An int array that counts the elements `==` compares (shared by its slices)."""

    counter: list[int]

    def __array_finalize__(self, obj: Any) -> None:
        self.counter = getattr(obj, "counter", [0])

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if ufunc is np.equal:
            counter = next(x.counter for x in inputs if isinstance(x, CountingArray))
            counter[0] += max(np.size(x) for x in inputs)
        plain = [x.view(np.ndarray) if isinstance(x, CountingArray) else x for x in inputs]
        return getattr(ufunc, method)(*plain, **kwargs)


def counted_propose(proposer: NgramProposer, tokens: np.ndarray) -> tuple[list[int], int]:
    counting = tokens.view(CountingArray)
    counting.counter = [0]
    draft = proposer.propose(counting)
    return draft, counting.counter[0]


def test_search_cost_is_one_pass_on_a_32k_random_sequence() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, size=32768)
    tokens[-4:] = tokens[1000:1004]
    draft, compared = counted_propose(make_proposer(5, 1, 4), tokens)
    assert draft == tokens[1004:1009].tolist()
    # One comparison per token, plus a few for the handful of occurrences of the last token.
    assert len(tokens) - 1 <= compared < len(tokens) + 100


def test_search_cost_on_a_repeated_prompt_is_one_pass_plus_its_occurrences() -> None:
    # The workload n-gram drafting is for: output repeating a 1024-token passage 32 times.
    rng = np.random.default_rng(1)
    passage = rng.integers(0, 32000, size=1024)
    tokens = np.concatenate([np.tile(passage, 32), passage[:100]])
    draft, compared = counted_propose(make_proposer(5, 1, 4), tokens)
    assert draft == passage[100:105].tolist()
    # Each round extends the ~32 occurrences of the suffix by one token.
    assert compared < len(tokens) + 4 * 33


def test_search_cost_is_bounded_by_max_n_passes_on_one_repeated_token() -> None:
    tokens = np.full(32768, 7)
    draft, compared = counted_propose(make_proposer(5, 1, 4), tokens)
    assert draft == [7] * 5
    assert compared <= 4 * len(tokens)
