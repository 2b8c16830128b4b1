"""Request text to token ids without stalling the server: checks that run before any tokenizer
(valid Unicode, a size no prompt of the context can have) and the tokenizer itself in a thread pool.

Tokenizing 10 MB of text takes seconds. The Rust tokenizer releases the GIL, so in a worker
thread it leaves the event loop (every other client, /health) free. Prompts that cannot fit the
context are refused by their size first when that is certain (`max_prompt_bytes`); everything
else is tokenized and checked by its token count.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Unicode normalizers that shrink text at most this many times in UTF-8 bytes: a 4-byte
# character maps to a 1-byte one under NFKC (U+1D400 -> "A"); compositions shrink less
# (Hangul L+V+T, 9 bytes -> 3).
_NORMALIZER_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4}
# Pre-tokenizers that drop no character (Split may, with behavior "Removed").
_LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation"}


# Token ids a slice of `ids_json`: about 10 ms of work on a slow CPU.
IDS_JSON_SLICE = 16384


def ids_json(ids: list[int]) -> str:
    """`ids` as a JSON array, built slice by slice. Each slice's join holds the GIL, but between
    slices a thread building a million-id array lets the event loop run; one json.dumps of it
    holds the GIL for a second on a slow CPU."""
    return "[" + ",".join([",".join(map(str, ids[i:i + IDS_JSON_SLICE]))
                           for i in range(0, len(ids), IDS_JSON_SLICE)]) + "]"


def encode_ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text)`, asking for the ids alone: encode also builds the attention
    mask and the token type ids, each another list as long, made while holding the GIL."""
    return tokenizer(text, add_special_tokens=add_special_tokens, return_attention_mask=False,
                     return_token_type_ids=False)["input_ids"]


def lone_surrogate(value: Any, path: str) -> str | None:
    """A message naming the first string in `value` (walked through dicts and lists) that is
    not valid Unicode, e.g. a lone UTF-16 surrogate from JSON's "\\ud800", or None. No
    tokenizer takes such a string, and UTF-8 cannot encode it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"{path} is not valid Unicode: a lone surrogate "
                    f"{value[exc.start]!r} at character {exc.start}")
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate(key, path) or lone_surrogate(item, f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the UTF-8 bytes of prompt text one token can stand for, or None where
    the tokenizer gives none that is certain.

    Certain for byte-level BPE (GPT-2, Llama 3, Qwen): every byte of the (normalized) text is
    in some token, a vocabulary entry spells one byte per character, and an added token matches
    its own text. A normalizer may shrink the text first (see _NORMALIZER_SHRINK); tokenizers
    whose normalizer or pre-tokenizer can drop characters (lowercasing, stripping, BERT's
    whitespace split) get None, and their prompts are only checked after tokenizing."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    pre = _flatten(spec.get("pre_tokenizer"), "pretokenizers")
    if not pre or not any(p.get("type") == "ByteLevel" for p in pre):
        return None
    if any(p.get("type") not in _LOSSLESS_PRE_TOKENIZERS or p.get("behavior") == "Removed"
           for p in pre):
        return None
    shrink = 1
    for normalizer in _flatten(spec.get("normalizer"), "normalizers"):
        factor = _NORMALIZER_SHRINK.get(normalizer.get("type"))
        if factor is None:
            return None
        shrink = max(shrink, factor)
    vocab: dict[str, int] = model.get("vocab") or {}
    # Every byte must have its own entry, or a byte the vocabulary lacks would be dropped.
    if not all(ch in vocab for ch in _byte_level_alphabet()):
        return None
    longest = max(len(token) for token in vocab)
    for added in spec.get("added_tokens") or []:
        longest = max(longest, len(added["content"].encode("utf-8")))
    return shrink * longest


def _flatten(component: dict | None, key: str) -> list[dict]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [leaf for part in component.get(key, []) for leaf in _flatten(part, key)]
    return [component]


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-character map: the 256 characters byte-level vocabularies spell with."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


class TextInputs:
    """The tokenizer behind a small thread pool, and the size bound of a prompt."""

    def __init__(self, tokenizer: Any, max_model_len: int, max_workers: int | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        per_token = max_bytes_per_token(tokenizer)
        # A prompt of more UTF-8 bytes than this has more than max_model_len tokens.
        self.max_prompt_bytes = None if per_token is None else per_token * max_model_len
        workers = max_workers or min(4, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="sluice-tokenizer")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def too_long(self, text: str) -> int | None:
        """The prompt's size in bytes when it certainly has more than max_model_len tokens."""
        bound = self.max_prompt_bytes
        # len() counts characters, each 1-4 bytes: only count bytes near the bound.
        if bound is None or 4 * len(text) <= bound:
            return None
        num_bytes = len(text.encode("utf-8"))
        return num_bytes if num_bytes > bound else None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
