"""N-gram (prompt lookup) proposer: drafts by copying what followed an earlier occurrence of the
sequence's own suffix.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are looked for
earlier in the sequence (an occurrence may overlap the suffix but must end before the last
token); the first n that occurs wins, and among its occurrences the earliest one, as in vLLM.
The draft is the up to k tokens that followed that occurrence, fewer when the sequence ends
first, and [] when no n-gram in the range recurs.

The search is vectorised: one comparison of every token with the last one, then each round
extends the surviving occurrences by one token to the left, so the cost is N + the number of
occurrences of each shorter suffix (N * prompt_lookup_max at worst, for a run of one token).
No model, no KV cache: nothing to roll back after verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sluice.spec_decode.config import SpeculativeConfig


def find_longest_ngram_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int] | None:
    """(n, start): the longest n in [min_n, max_n] whose suffix n-gram recurs earlier, and where
    the tokens after its earliest earlier occurrence begin; None when no such n-gram exists.

    tokens: [num_tokens] integers.
    """
    assert 1 <= min_n <= max_n
    num_tokens = tokens.shape[0]
    # An earlier occurrence of an n-gram ends at index <= num_tokens - 2 and starts at >= 0.
    if num_tokens <= min_n:
        return None
    # ends: [num_matches] ascending end indices of earlier occurrences of the last n tokens.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.size == 0:
        return None
    n = 1
    while n < max_n:
        # An occurrence extended by one token to the left must still start at >= 0.
        longer = ends[np.searchsorted(ends, n):]
        if longer.size == 0:
            break
        longer = longer[tokens[longer - n] == tokens[num_tokens - 1 - n]]
        if longer.size == 0:
            break
        ends = longer
        n += 1
    if n < min_n:
        return None
    return n, int(ends[0]) + 1


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs method 'ngram', got {config.method!r}")
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(
        self,
        token_ids: Sequence[int] | np.ndarray,
        max_num_draft_tokens: int | None = None,
    ) -> list[int]:
        """Draft tokens to follow `token_ids` (prompt plus output so far).

        max_num_draft_tokens caps the draft below k, e.g. at the room left before
        max_model_len or max_tokens; None means k.
        """
        num_drafts = self.num_speculative_tokens
        if max_num_draft_tokens is not None:
            assert max_num_draft_tokens >= 0, max_num_draft_tokens
            num_drafts = min(num_drafts, max_num_draft_tokens)
        if num_drafts == 0 or len(token_ids) == 0:
            return []
        # asanyarray: no copy for an integer ndarray (and subclasses pass through).
        tokens = np.asanyarray(token_ids)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be one sequence (1-D), got shape {tokens.shape}")
        match = find_longest_ngram_match(tokens, self.min_n, self.max_n)
        if match is None:
            return []
        _, start = match
        return tokens[start:start + num_drafts].tolist()

    def propose_batch(
        self,
        sequences: Sequence[Sequence[int] | np.ndarray],
        max_num_draft_tokens: Sequence[int | None] | None = None,
    ) -> list[list[int]]:
        """One draft per sequence, in order; max_num_draft_tokens as in propose, per sequence."""
        if max_num_draft_tokens is None:
            return [self.propose(token_ids) for token_ids in sequences]
        assert len(max_num_draft_tokens) == len(sequences)
        return [
            self.propose(token_ids, limit)
            for token_ids, limit in zip(sequences, max_num_draft_tokens)
        ]
