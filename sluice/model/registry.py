"""Hugging Face architecture name -> sluice model class.

Model modules are imported on first use, so reading a config never imports model code and the
models may import the loader without a cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# architecture name -> (module, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("sluice.model.models.qwen3", "Qwen3ForCausalLM"),
    "LlamaForCausalLM": ("sluice.model.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("sluice.model.models.llama", "Qwen2ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def resolve_architecture(architectures: list[str]) -> str:
    """The first supported name in `architectures` (config.json's list)."""
    for arch in architectures:
        if arch in _MODELS:
            return arch
    raise ValueError(
        f"architecture {architectures!r} is not supported (supported: {supported_architectures()})"
    )


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    module_name, class_name = _MODELS[resolve_architecture(architectures)]
    return getattr(importlib.import_module(module_name), class_name)
