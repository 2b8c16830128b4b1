"""sluice: an LLM inference and serving engine."""

from sluice.entrypoints.llm import LLM
from sluice.outputs import CompletionOutput, Logprob, RequestOutput
from sluice.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
