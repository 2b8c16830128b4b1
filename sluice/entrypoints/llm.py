"""The offline API, shaped like vLLM's `LLM` so that vLLM scripts run unchanged."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from sluice.core.outputs import SpecDecodingStats
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.processors import PromptType, RequestOutputKind
from sluice.outputs import RequestOutput
from sluice.sampling_params import SamplingParams
from sluice.worker.profiler import ProfileSummary

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate from a Hugging Face model folder.

    >>> llm = LLM(model="path/to/Qwen3-0.6B")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args)

    def shutdown(self) -> None:
        """Free the GPU memory (KV cache, CUDA graphs, weights) now, e.g. before another engine
        or library needs it in the same process. The LLM cannot generate afterwards."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`), e.g. between two timed
        runs of the same prompts. False, and nothing reset, while requests hold blocks."""
        return self.llm_engine.kv_cache_manager.reset_prefix_cache()

    def start_profile(self) -> None:
        """Start a torch.profiler window on every worker rank (vLLM's `LLM.start_profile`);
        the steps that follow, until stop_profile, are in it."""
        self.llm_engine.engine_core.executor.start_profile()

    def stop_profile(self) -> list[ProfileSummary]:
        """End the window: each rank's summary (sluice.worker.profiler.ProfileSummary: its
        steps, top GPU kernels and host ops), in rank order. Waits for the device."""
        return self.llm_engine.engine_core.executor.stop_profile()

    def get_spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's counters since the engine started (drafts, draft tokens,
        accepted tokens, accepted tokens per draft position; `acceptance_rate` and
        `mean_acceptance_length` derive from them); None when speculation is off. A copy:
        later steps do not change it."""
        stats = self.llm_engine.scheduler.spec_decoding_stats
        return None if stats is None else copy.deepcopy(stats)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries but there are "
                                 f"{len(prompts)} prompts; give one, or one per prompt")
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                # Each request gets its own copy: the engine fills in its stop token ids.
                request_ids.append(engine.add_request(
                    None, prompt, params.clone(), RequestOutputKind.FINAL_ONLY))
        except ValueError:
            engine.abort_request(request_ids)  # a bad prompt leaves no request behind
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Each conversation rendered with the chat template (with `tools` when given, as
        vLLM's), then generated."""
        conversations = messages
        if not conversations or isinstance(conversations[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            token_ids = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=True, tools=tools,
                add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
            if hasattr(token_ids, "keys"):  # transformers 5 returns a BatchEncoding
                token_ids = token_ids["input_ids"]
            prompts.append({"prompt_token_ids": list(token_ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts",
                            dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
            # A KV connector may still hold finished requests' blocks (a save to the CPU
            # tier, a send): let it finish, so the engine is at rest when this returns.
            engine.drain_kv_transfers()
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in results])
            raise
        finally:
            if progress is not None:
                progress.close()
        return [results[r] for r in request_ids]
