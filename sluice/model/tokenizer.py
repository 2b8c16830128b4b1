"""The tokenizer of a model folder, as the engine's front end and its grammar compiler load it."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str) -> Any:
    """A transformers fast tokenizer from a model folder (tokenizer.json + tokenizer_config)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"tokenizer folder {path!r} has no tokenizer.json")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
