"""Synthetic serving workloads: `random` and `shared-prefix` prompts of controlled token length.

Prompts are built from random token ids and decoded to text, so that the server, tokenizing that
text again, sees the intended length. Decoding then re-encoding does not always give the same ids
back (merges across token boundaries, partial UTF-8 bytes), so `_text_of_length` re-encodes,
truncates or pads, and decodes again until the length holds. Without a tokenizer the prompts are
made of common short English words, about one token each; their lengths are estimates, which the
server's usage (prompt_tokens) replaces.

Lengths count the tokens the server counts: special tokens the tokenizer adds (a BOS) included.
Every draw comes from the `numpy.random.Generator` passed in, so a seed fixes the workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# Each one token (with its leading space) in the common BPE vocabularies.
_WORDS = ("the of and to in is was for on are with as by at from his her they this that have "
          "not but had one all were when we there can an your which their said if do will each "
          "about how up out them then she many some so these would other into has more two "
          "like him see time could no make than first been its who now people my made over did "
          "down only way find use may water long little very after words called just where most "
          "know").split()

_MAX_TRIES = 10


@dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: str
    # Prompt tokens as the server counts them; an estimate when built without a tokenizer.
    prompt_len: int
    expected_output_len: int
    # shared-prefix: the index of the prompt's prefix group (None for other datasets).
    group: int | None = None


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths drawn around `mean`: floor(mean(1-r)), ceil(mean(1+r))."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    # The epsilon keeps float noise (100 * 1.1 = 110.00000000000001) from widening the band.
    low = max(1, math.floor(mean * (1.0 - range_ratio) + 1e-9))
    return low, max(low, math.ceil(mean * (1.0 + range_ratio) - 1e-9))


class PromptBuilder:
    """Text of a given token length from a Hugging Face tokenizer (or word estimates, if None)."""

    def __init__(self, tokenizer: Any | None, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        if tokenizer is None:
            self.num_special = 0
            self._allowed_ids = np.zeros(0, dtype=np.int64)
            return
        self.num_special = len(tokenizer.encode("a", add_special_tokens=True)) - len(
            tokenizer.encode("a", add_special_tokens=False))
        # Ids that decode alone to clean text: partial UTF-8 bytes decode to U+FFFD, which
        # re-encodes to several tokens and keeps the length from settling.
        special = set(tokenizer.all_special_ids)
        ids = [i for i in range(tokenizer.vocab_size) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in ids])
        self._allowed_ids = np.array([i for i, t in zip(ids, texts) if t and "\ufffd" not in t],
                                     dtype=np.int64)

    def random_text(self, num_tokens: int) -> tuple[str, list[int]]:
        """(text, ids): text whose encoding, without special tokens, is `ids`, ~num_tokens long."""
        if self.tokenizer is None:
            words = self.rng.choice(len(_WORDS), size=num_tokens)
            return " ".join(_WORDS[w] for w in words), []
        ids = self._random_ids(num_tokens)
        return self._text_of_length(ids, num_tokens)

    def count(self, text: str) -> int:
        """Tokens the server will count for `text` as a prompt (special tokens included)."""
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    def starts_with(self, text: str, prefix_ids: list[int]) -> bool:
        if self.tokenizer is None:
            return True
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[:len(prefix_ids)] == prefix_ids

    def _random_ids(self, n: int) -> list[int]:
        return self._allowed_ids[self.rng.integers(0, len(self._allowed_ids), size=n)].tolist()

    def _text_of_length(self, ids: list[int], target: int) -> tuple[str, list[int]]:
        for _ in range(_MAX_TRIES):
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == target:
                break
            ids = ids[:target] if len(ids) > target else ids + self._random_ids(target - len(ids))
        return text, ids


def _check_counts(num_requests: int, input_len: int, output_len: int) -> None:
    if num_requests < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_requests}")
    if input_len < 1:
        raise ValueError(f"--random-input-len must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"--random-output-len must be >= 1, got {output_len}")


def sample_random(num_requests: int, input_len: int, output_len: int, range_ratio: float,
                  rng: np.random.Generator, tokenizer: Any | None = None) -> list[SampleRequest]:
    """Independent random prompts; input and output lengths uniform in their range_ratio bands."""
    _check_counts(num_requests, input_len, output_len)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    builder = PromptBuilder(tokenizer, rng)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    requests = []
    for total, out in zip(input_lens.tolist(), output_lens.tolist()):
        text, _ = builder.random_text(max(1, total - builder.num_special))
        requests.append(SampleRequest(text, builder.count(text), out))
    return requests


def sample_shared_prefix(num_requests: int, num_groups: int, prefix_len: int, suffix_len: int,
                         output_len: int, range_ratio: float, rng: np.random.Generator,
                         tokenizer: Any | None = None) -> list[SampleRequest]:
    """`num_groups` random prefixes of `prefix_len` tokens; each prompt is one group's prefix and a
    unique random suffix of about `suffix_len` tokens (range_ratio band), in shuffled order, so
    that requests of a group arrive interleaved with others, as prefix caching meets them."""
    _check_counts(num_requests, suffix_len, output_len)
    if not 1 <= num_groups <= num_requests:
        raise ValueError(f"--shared-prefix-groups must be in [1, --num-prompts={num_requests}], "
                         f"got {num_groups}")
    if prefix_len < 1:
        raise ValueError(f"--shared-prefix-len must be >= 1, got {prefix_len}")
    suffix_low, suffix_high = length_range(suffix_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    builder = PromptBuilder(tokenizer, rng)
    prefixes = [builder.random_text(prefix_len) for _ in range(num_groups)]
    requests = []
    for i in range(num_requests):
        prefix_text, prefix_ids = prefixes[i % num_groups]
        n = int(rng.integers(suffix_low, suffix_high + 1))
        # A suffix whose first token merges with the prefix's last would break the shared token
        # prefix; draw another (rare with byte-level BPE, and bounded).
        for _ in range(_MAX_TRIES):
            suffix_text, _ = builder.random_text(n)
            prompt = prefix_text + (" " if tokenizer is None else "") + suffix_text
            if builder.starts_with(prompt, prefix_ids):
                break
        out = int(rng.integers(out_low, out_high + 1))
        requests.append(SampleRequest(prompt, builder.count(prompt), out, i % num_groups))
    order = rng.permutation(num_requests)
    return [requests[i] for i in order.tolist()]
