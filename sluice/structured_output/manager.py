"""The engine core's side of structured outputs: grammars compiled off the hot path, one matcher
per constrained request, and each step's packed token bitmask.

Lifecycle of a constrained request (its sampling params carry `structured_outputs`):
- `add_request` (when the scheduler takes it): its grammar's compile is looked up in a cache
  keyed by GrammarKey, or submitted to a thread pool. The first one also loads the tokenizer
  (in the pool too): nothing here runs for an engine that never sees a constrained request.
- `is_ready` (admission): False while compiling: the scheduler passes it over and takes the
  requests behind it, asking again next step (`wait_for_compiles` sleeps on the compiles when
  nothing else can run). Once compiled, its matcher is made (stop tokens: its EOS and
  stop_token_ids; with neither, it terminates where the grammar ends). A failed compile makes
  `compile_error` say why, and the scheduler fails the request.
- `grammar_bitmask` (each schedule): for the constrained requests that sample this step, one
  row each of ceil(V / 32) int32 words (bit v of a row set: token v allowed), the rows packed
  as bytes into SchedulerOutput.grammar_bitmask: the mask reaches the sampler in the typed step
  message, in this process or a worker's. A request's row is filled from its matcher, which has
  accepted every token the request has (the scheduler never schedules a constrained request
  while its last token is still in flight).
- `accept_tokens` (each update): the matcher advances over the new tokens; `is_terminated`
  says the grammar has ended (the request stops).
- `remove` (the request finished).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.core.outputs import GrammarBitmask
from sluice.structured_output.grammar import GrammarKey, compile_grammar, grammar_key

if TYPE_CHECKING:
    import xgrammar

    from sluice.core.request import Request

logger = logging.getLogger("sluice")

# Compiled grammars kept (most recently used); the requests using one keep it alive anyway.
_CACHE_SIZE = 256


@dataclass(slots=True)
class StructuredOutputRequest:
    """One request's grammar and, once compiled, its matcher."""

    key: GrammarKey
    compiled: Future
    stop_token_ids: list[int]
    matcher: Any = None  # xgrammar.GrammarMatcher


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str, vocab_size: int, max_workers: int = 2) -> None:
        """vocab_size: the model's (the logits' width), which may exceed the tokenizer's."""
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.num_words = math.ceil(vocab_size / 32)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="sluice-grammar")
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._bitmask: Any = None  # torch int32 [rows, num_words], grown as needed
        self.requests: dict[str, StructuredOutputRequest] = {}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        key = grammar_key(params.structured_outputs)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._pool.submit(self._compile, key)
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        stops = sorted(set(request.eos_token_ids) | set(params.stop_token_ids))
        self.requests[request.request_id] = StructuredOutputRequest(key, compiled, stops)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def is_ready(self, request_id: str) -> bool:
        """Whether the request's grammar is compiled (True also when the compile failed: see
        compile_error)."""
        state = self.requests[request_id]
        if state.matcher is not None:
            return True
        if not state.compiled.done():
            return False
        if state.compiled.exception() is None:
            import xgrammar as xgr

            state.matcher = xgr.GrammarMatcher(
                state.compiled.result(), override_stop_tokens=state.stop_token_ids or None,
                terminate_without_stop_token=not state.stop_token_ids)
        return True

    def compile_error(self, request_id: str) -> str | None:
        compiled = self.requests[request_id].compiled
        if not compiled.done() or compiled.exception() is None:
            return None
        return f"structured_outputs: {compiled.exception()}"

    def has_pending_compiles(self) -> bool:
        return any(state.matcher is None and not state.compiled.done()
                   for state in self.requests.values())

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Sleep until a compile ends (or the timeout): the engine had nothing else to run."""
        pending = [s.compiled for s in self.requests.values() if not s.compiled.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ---- steps ---------------------------------------------------------------------------

    def grammar_bitmask(self, request_ids: list[str]) -> GrammarBitmask:
        """The allowed next tokens of these requests (each compiled, not terminated)."""
        import torch

        num_rows = len(request_ids)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.empty((max(num_rows, 16), self.num_words), dtype=torch.int32)
        bitmask = self._bitmask
        for row, request_id in enumerate(request_ids):
            self.requests[request_id].matcher.fill_next_token_bitmask(bitmask, row)
        return GrammarBitmask(req_ids=request_ids,
                              bitmask=bitmask[:num_rows].numpy().tobytes())

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> int:
        """Advance the matcher; returns how many tokens it accepted (fewer: the rest broke the
        grammar, which the masks should make impossible)."""
        matcher = self.requests[request_id].matcher
        for i, token_id in enumerate(token_ids):
            if not matcher.accept_token(token_id):
                return i
        return len(token_ids)

    def is_terminated(self, request_id: str) -> bool:
        return self.requests[request_id].matcher.is_terminated()

    # ---- compiling (in the pool) ---------------------------------------------------------

    def _compile(self, key: GrammarKey) -> xgrammar.CompiledGrammar:
        return compile_grammar(self._get_compiler(), key)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        # The first compile builds the compiler (loads the tokenizer); others wait for it.
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def _make_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr

        from sluice.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=1)


def unpack_bitmask(bitmask: bytes, num_rows: int, num_words: int) -> np.ndarray:
    """[num_rows, num_words] int32 view of a packed GrammarBitmask."""
    return np.frombuffer(bitmask, dtype=np.int32).reshape(num_rows, num_words)
