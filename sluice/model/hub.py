"""Model names to folders: a local folder as it is, a Hugging Face hub id (`Qwen/Qwen3-0.6B`)
through `huggingface_hub`, which downloads a snapshot into the HF cache once and reads it from
there afterwards (offline too: `HF_HUB_OFFLINE=1` uses the cache alone). `HF_HOME` /
`HF_HUB_CACHE` say where the cache is, as for every Hugging Face tool."""

from __future__ import annotations

import os
import re

# What a snapshot needs of a repository: configs, tokenizer files, safetensors weights (not the
# .bin / .h5 / .msgpack / .onnx copies many repositories also carry).
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
# huggingface_hub's repo id: "name" or "namespace/name", letters, digits, "-", "_", ".".
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def sluice_cache_dir() -> str:
    """Where sluice keeps what it builds or fetches once (the built-in models, GGUF files'
    folders): $SLUICE_CACHE_DIR, else $XDG_CACHE_HOME/sluice, else ~/.cache/sluice."""
    cache = os.environ.get("SLUICE_CACHE_DIR")
    if cache:
        return cache
    xdg = os.environ.get("XDG_CACHE_HOME")
    return os.path.join(xdg, "sluice") if xdg else os.path.expanduser("~/.cache/sluice")


def is_hub_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith(".")


def resolve_model_path(name: str, revision: str | None = None) -> str:
    """A folder holding the model `name`: itself if it is a folder (or looks like a path),
    else the HF cache's snapshot of the hub repository `name`. ValueError saying why not."""
    if os.path.isdir(name) or not is_hub_id(name):
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id=name, revision=revision,
                                 allow_patterns=_ALLOW_PATTERNS)
    except LocalEntryNotFoundError as exc:
        raise ValueError(
            f"model {name!r} is not a local folder, and the Hugging Face cache has no snapshot "
            f"of it while the hub cannot be reached (offline: HF_HUB_OFFLINE is set, or no "
            f"network): {exc}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ValueError(f"model {name!r} is not a local folder, and fetching it from the "
                         f"Hugging Face hub failed: {type(exc).__name__}: {exc}") from None
