"""Text in, EngineCoreRequests out (InputProcessor); EngineCoreOutputs in, RequestOutputs out
(OutputProcessor: incremental detokenization, stop strings, logprobs, `n > 1` fan-in)."""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from sluice.core.outputs import EngineCoreOutput, PositionLogprobs
from sluice.core.request import EngineCoreRequest
from sluice.engine.detokenizer import IncrementalDetokenizer, decode_token
from sluice.model.hf_config import HFModelConfig
from sluice.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from sluice.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


def load_eos_token_ids(model_dir: str, hf_config: HFModelConfig, tokenizer: Any) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, together."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(hf_config.eos_token_id)
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            add(json.load(f).get("eos_token_id"))
    add(tokenizer.eos_token_id)
    return ids


class InputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int,
                 vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string, got ''")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = list(prompt["prompt_token_ids"])
                self._check_token_ids(token_ids)
                return prompt.get("prompt"), token_ids
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', "
                             f"got keys {sorted(prompt)}")
        if isinstance(prompt, list):
            self._check_token_ids(prompt)
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, "
                         f"got {type(prompt).__name__}")

    def _check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        # Passes in C over the list (a 143k-token batch: 8 ms in a Python loop, 1 ms here); the
        # loop below only runs to name the bad value.
        if (set(map(type, token_ids)) == {int} and min(token_ids) >= 0
                and max(token_ids) < self.vocab_size):
            return
        for t in token_ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size}), "
                                 f"got {t!r}")

    def check_constraints(self, params: SamplingParams) -> None:
        """ValueError for logit_bias ids outside the vocabulary and for structured outputs
        whose schema, regex or grammar does not compile (cached: the server checks first, off
        its event loop)."""
        if params.logit_bias:
            bad = _out_of_vocab(params.logit_bias, self.vocab_size)
            if bad:
                raise ValueError(f"logit_bias has token ids outside the vocabulary [0, "
                                 f"{self.vocab_size}): {bad[:8]}")
        if params.structured_outputs is not None:
            from sluice.structured_output.grammar import check_structured_outputs

            check_structured_outputs(params.structured_outputs)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                arrival_time: float | None = None,
                kv_transfer_params: dict[str, Any] | None = None,
                ) -> tuple[str | None, list[EngineCoreRequest]]:
        """Validate and tokenize; returns the prompt text and one request per sample (`n`)."""
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty (it tokenized to no tokens)")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt (length {len(token_ids)}) is longer than max_model_len "
                f"({self.max_model_len})")
        self.check_constraints(params)
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.eos_token_ids
        eos = set() if params.ignore_eos else self.eos_token_ids
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(params.max_tokens, max_tokens)
        max_tokens = max(max_tokens, 1)
        if isinstance(kv_transfer_params, dict) and kv_transfer_params.get("do_remote_decode"):
            max_tokens = 1  # the prefill half of a disaggregated request: prompt + first token
        arrival = time.time() if arrival_time is None else arrival_time
        requests = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = params.clone(n=1, seed=seed)
            requests.append(EngineCoreRequest(
                request_id=child_request_id(request_id, index, params.n),
                prompt_token_ids=token_ids,
                sampling_params=child_params,
                eos_token_ids=eos,
                arrival_time=arrival,
                max_tokens=max_tokens,
                kv_transfer_params=kv_transfer_params,
            ))
        return text, requests


def _out_of_vocab(token_ids: object, vocab_size: int) -> list[int]:
    return sorted(t for t in token_ids if t >= vocab_size)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new, every step
    FINAL_ONLY = 2  # once, when finished


@dataclass(slots=True)
class _SampleState:
    index: int
    detokenizer: IncrementalDetokenizer
    num_logprobs: int | None
    # EOS (unless ignore_eos) and stop_token_ids: a reply ending on one drops its text.
    stop_token_ids: set[int] = field(default_factory=set)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_sent_logprobs: int = 0
    num_sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    samples: list[_SampleState]
    metrics: RequestMetrics
    num_prompt_logprobs: int | None
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        for sample in self.samples:  # a loop, not all(<genexpr>): once per request per step
            if sample.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}
        self._token_text_cache: dict[int, str] = {}

    def add_request(self, request_id: str, prompt: str | None,
                    children: list[EngineCoreRequest],
                    params: SamplingParams, output_kind: RequestOutputKind,
                    arrival_time: float) -> None:
        samples = []
        for index, child in enumerate(children):
            samples.append(_SampleState(
                index=index,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, child.prompt_token_ids, child.sampling_params,
                    incremental=output_kind != RequestOutputKind.FINAL_ONLY),
                num_logprobs=params.logprobs,
                stop_token_ids=child.sampling_params.all_stop_token_ids,
            ))
            self.child_to_parent[child.request_id] = (request_id, index)
        self.requests[request_id] = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=children[0].prompt_token_ids,
            output_kind=output_kind,
            samples=samples,
            metrics=RequestMetrics(arrival_time=arrival_time),
            num_prompt_logprobs=params.prompt_logprobs,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns the child ids the engine core must abort."""
        children = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            for sample in state.samples:
                child = child_request_id(request_id, sample.index, len(state.samples))
                self.child_to_parent.pop(child, None)
                children.append(child)
        return children

    def abort_requests_with_outputs(
        self, request_ids: list[str]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Abort requests from the front end: a last, finished RequestOutput for each (samples
        still going end with finish_reason "abort"), and the child ids the core must abort."""
        outputs = []
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is None:
                continue
            for sample in state.samples:
                if sample.finish_reason is None:
                    sample.detokenizer.flush()
                    sample.finish_reason = "abort"
            state.metrics.finished_time = time.time()
            outputs.append(self._make_output(state, finished=True))
        return outputs, self.abort_requests(request_ids)

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to hand out now, and the child ids that a stop string
        ended (the engine core must finish them)."""
        now = time.time()
        touched: dict[str, _RequestState] = {}
        stopped_children: list[str] = []
        for out in core_outputs:
            parent = self.child_to_parent.get(out.req_id)
            if parent is None:
                continue  # aborted meanwhile
            state = self.requests[parent[0]]
            sample = state.samples[parent[1]]
            touched[state.request_id] = state
            metrics = state.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = out.first_scheduled_time
            state.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            if out.new_prompt_logprobs is not None:
                state.prompt_logprobs.extend(
                    self._convert_logprobs(p) if p is not None else None
                    for p in out.new_prompt_logprobs)
            if out.new_token_ids:
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
            if out.new_logprobs:
                for token_id, position in zip(out.new_token_ids, out.new_logprobs):
                    sample.logprobs.append(self._convert_logprobs(position))
                    sample.cumulative_logprob += position[token_id][0]
            # A stop token's text is not shown; a reply whose grammar ended (structured
            # outputs without a stop token) ends on text.
            stop_terminated = (out.finish_reason == "stop"
                               and not isinstance(out.stop_reason, str)
                               and bool(out.new_token_ids)
                               and out.new_token_ids[-1] in sample.stop_token_ids)
            stop_string = sample.detokenizer.update(out.new_token_ids, stop_terminated)
            if stop_string is not None:
                # Before any other end in the same step (the tokens after it are dropped).
                sample.finish_reason = "stop"
                sample.stop_reason = stop_string
                if not out.finished:
                    stopped_children.append(out.req_id)
            elif out.finished:
                sample.detokenizer.flush()
                sample.finish_reason = out.finish_reason
                sample.stop_reason = out.stop_reason

        outputs = []
        for state in touched.values():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
                for sample in state.samples:
                    child = child_request_id(state.request_id, sample.index, len(state.samples))
                    self.child_to_parent.pop(child, None)
            if state.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            outputs.append(self._make_output(state, finished))
        return outputs, stopped_children

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        delta = state.output_kind == RequestOutputKind.DELTA
        completions = []
        for sample in state.samples:
            done = sample.finish_reason is not None
            token_ids = sample.detokenizer.token_ids
            logprobs = sample.logprobs if sample.num_logprobs is not None else None
            if delta:
                token_ids = token_ids[sample.num_sent_tokens:]
                if logprobs is not None:
                    logprobs = logprobs[sample.num_sent_logprobs:]
            sample.num_sent_tokens = len(sample.detokenizer.token_ids)
            sample.num_sent_logprobs = len(sample.logprobs)
            completions.append(CompletionOutput(
                index=sample.index,
                text=sample.detokenizer.get_next_output_text(done, delta),
                token_ids=list(token_ids),
                cumulative_logprob=(sample.cumulative_logprob
                                    if sample.num_logprobs is not None else None),
                logprobs=logprobs,
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
            ))
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=(state.prompt_logprobs
                             if state.num_prompt_logprobs is not None else None),
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            kv_transfer_params=state.kv_transfer_params,
        )

    def _convert_logprobs(self, position: PositionLogprobs) -> dict[int, Logprob]:
        return {token_id: Logprob(logprob, rank, self._decode(token_id))
                for token_id, (logprob, rank) in position.items()}

    def _decode(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = decode_token(self.tokenizer, token_id)
            self._token_text_cache[token_id] = text
        return text
