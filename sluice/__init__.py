"""sluice: an LLM inference and serving engine."""

from typing import TYPE_CHECKING, Any

from sluice.outputs import CompletionOutput, Logprob, RequestOutput
from sluice.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.version import __version__

if TYPE_CHECKING:
    from sluice.entrypoints.llm import LLM

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "__version__"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the model code: only load it when asked for (so the HTTP load
    # generator and other light commands start fast).
    if name == "LLM":
        from sluice.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")
