"""Incremental detokenization of one request's output, with stop strings.

Decoding token by token is not decoding each token alone: a byte-level BPE token can hold part
of a UTF-8 character, and some decoders change a token's text by what precedes it. So each step
decodes a small window of trailing ids twice, `[prefix_offset, read_offset)` (text already
emitted) and `[prefix_offset, end)`, and emits the difference, but only once it no longer ends
in U+FFFD (an unfinished character). The window then slides: prefix_offset <- read_offset,
read_offset <- end. The window starts on the last few prompt tokens so the first output token
decodes as it would in context.

Stop strings are searched only in the new text plus the len(stop) - 1 characters before it, so
a match across a token boundary is found and the cost stays linear in the output. Until the
request finishes, the last (longest stop - 1) characters are held back from the caller: a prefix
of a stop string that may still complete is never shown and then taken back.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from sluice.sampling_params import SamplingParams

# Prompt tokens decoded as left context of the first output token.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams, incremental: bool = True) -> None:
        """`incremental=False` (only without stop strings): nobody reads the text before the
        end, so decode once in flush() instead of at every step."""
        self.tokenizer = tokenizer
        self._decode = ids_decoder(tokenizer, params.skip_special_tokens)
        self.incremental = incremental or bool(params.stop)
        # Output tokens that have text (all but a final EOS / stop token id).
        self._num_text_tokens = 0
        self.skip_special_tokens = params.skip_special_tokens
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop: list[str] = list(params.stop or [])
        self._stop_buffer_length = 0
        if self.stop and not self.include_stop_str_in_output:
            self._stop_buffer_length = max(len(s) for s in self.stop) - 1

        # The text of all output tokens so far (after any stop-string truncation).
        self.output_text = ""
        # All output token ids, including a final stop token.
        self.token_ids: list[int] = []
        # Decode window: recent ids (prompt tail, then output); trimmed as it slides.
        self._window_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._window_ids)
        # Characters of output_text already handed out by get_next_output_text.
        self._num_emitted_chars = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append tokens and decode them. `stop_terminated`: the last new token is an EOS or
        stop token id, whose text is not added. Returns the stop string that matched, if any
        (output_text is then cut before it, or after it with include_stop_str_in_output, and
        token_ids after the token that completed it)."""
        num_tokens_before = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        decoded_ids = new_token_ids[:-1] if stop_terminated else new_token_ids
        num_text_tokens_before = self._num_text_tokens
        self._num_text_tokens += len(decoded_ids)
        if not self.incremental:
            return None
        # Token by token: several tokens may arrive at once (speculative decoding), and the
        # output must end with the token that completed a stop string, as if they came singly.
        for n, token_id in enumerate(decoded_ids, 1):
            self._window_ids.append(token_id)
            text = self._decode_next()
            if not text:
                continue
            num_chars_before = len(self.output_text)
            self.output_text += text
            if not self.stop or num_tokens_before + n <= self.min_tokens:
                continue
            stop = self._truncate_at_stop_string(num_chars_before)
            if stop is not None:
                del self.token_ids[num_tokens_before + n:]
                self._num_text_tokens = num_text_tokens_before + n
                return stop
        return None

    def flush(self) -> None:
        """The output ended: add the text still waiting for the rest of a character (it shows
        as U+FFFD), so the final text equals decoding all output tokens at once."""
        if not self.incremental:
            self.output_text = self._decode(self.token_ids[:self._num_text_tokens])
            return
        ids = self._window_ids
        if self._read_offset < len(ids):
            prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
            full_text = self._decode(ids[self._prefix_offset:])
            self.output_text += full_text[len(prefix_text):]
            del ids[:]
            self._prefix_offset = self._read_offset = 0

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now. While not finished, the tail that could still start a stop
        string is held back. `delta`: only what was not returned before; else all of it."""
        buffer_length = 0 if finished else self._stop_buffer_length
        length = max(len(self.output_text) - buffer_length, self._num_emitted_chars)
        start = self._num_emitted_chars if delta else 0
        self._num_emitted_chars = length
        return self.output_text[start:length]

    def _decode_next(self) -> str:
        ids = self._window_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            # An unfinished character, or nothing visible (a skipped special token): wait.
            return ""
        new_text = full_text[len(prefix_text):]
        # Slide the window and drop the ids it has left behind.
        del ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(ids)
        return new_text

    def _truncate_at_stop_string(self, num_chars_before: int) -> str | None:
        # The earliest match wins; on a tie, the first stop string listed.
        match: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, max(num_chars_before - len(stop) + 1, 0))
            if index != -1 and (match is None or index < match[0]):
                match = (index, stop)
        if match is None:
            return None
        index, stop = match
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop


def decode_token(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """One token's own text, for logprob entries (special tokens kept; a partial UTF-8
    character shows as U+FFFD)."""
    return tokenizer.decode([token_id], skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)


def ids_decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
                ) -> Callable[[list[int]], str]:
    """decode(ids) as `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces
    =False)`. For a fast tokenizer whose decoding transformers does not change, that is the Rust
    tokenizer's own decode, called directly: a third of the cost (the detokenizer decodes twice
    per token, in the server's event loop)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and _decodes_as_backend(type(tokenizer)):
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens,
                   clean_up_tokenization_spaces=False)


@cache
def _decodes_as_backend(cls: type) -> bool:
    """Whether `cls` decodes with the fast tokenizer base class's own decode and _decode (which
    hand the ids to the Rust tokenizer and, without clean-up, return its text)."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return False
    return (issubclass(cls, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode)
