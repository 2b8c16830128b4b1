"""The scheduler's structured-output decisions (the rules are in sluice/core/scheduler.py's
docstring): which constrained requests may be admitted (their grammar compiled), which wait for
a token in flight, the grammar masks of the requests that sample in a step, and what the tokens
that come back do to their grammars.

The grammars themselves are a GrammarBackend's (sluice/structured_output/manager.py is the
engine's): the scheduler knows it only through this interface, so the core imports nothing of
the structured-output package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from sluice.core.outputs import GrammarBitmask
from sluice.core.request import Request, RequestStatus

FailRequest = Callable[[Request, str], None]


class GrammarBackend(Protocol):
    @property
    def requests(self) -> Mapping[str, object]:
        """The constrained requests it holds, by id."""

    def add_request(self, request: Request) -> None: ...

    def remove(self, request_id: str) -> None: ...

    def is_ready(self, request_id: str) -> bool: ...

    def compile_error(self, request_id: str) -> str | None: ...

    def grammar_bitmask(self, request_ids: list[str]) -> GrammarBitmask: ...

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> int: ...

    def is_terminated(self, request_id: str) -> bool: ...


def is_constrained(request: Request) -> bool:
    return request.sampling_params.structured_outputs is not None


class GrammarGate:
    def __init__(self, backend: GrammarBackend | None) -> None:
        self.backend = backend

    def add_request(self, request: Request) -> None:
        if not is_constrained(request):
            return
        if self.backend is None:
            raise ValueError("structured_outputs: this engine has no structured-output backend")
        self.backend.add_request(request)

    def remove(self, request_id: str) -> None:
        if self.backend is not None:
            self.backend.remove(request_id)

    def active(self) -> bool:
        """Whether any request has structured outputs (else their per-request checks are
        skipped: steps without them do no extra work)."""
        return self.backend is not None and bool(self.backend.requests)

    def admits(self, request: Request, fail: FailRequest) -> bool:
        """Whether a waiting request may be admitted: unconstrained, or its grammar compiled.
        One whose compile failed is failed (`fail`) and not admitted."""
        if not is_constrained(request):
            return True
        if not self.backend.is_ready(request.request_id):
            return False
        error = self.backend.compile_error(request.request_id)
        if error is None:
            return True
        fail(request, error)
        return False

    def token_in_flight(self, running: list[Request]) -> bool:
        """Whether a running constrained request's last token is still in flight (async
        scheduling): it cannot be scheduled until its grammar has seen that token."""
        return any(request.num_output_placeholders and is_constrained(request)
                   for request in running)

    def bitmask(self, sampling: list[Request]) -> GrammarBitmask | None:
        """The masks of the constrained requests that sample in the step (None: there are
        none)."""
        if not self.active():
            return None
        constrained = [request.request_id for request in sampling if is_constrained(request)]
        return self.backend.grammar_bitmask(constrained) if constrained else None

    def accept(self, request: Request, sampled: list[int], fail: FailRequest) -> bool:
        """The matcher accepts the new tokens; False (the request failed) if one breaks the
        grammar, which the step's mask should have made impossible."""
        accepted = self.backend.accept_tokens(request.request_id, sampled)
        if accepted == len(sampled):
            return True
        fail(request, f"structured_outputs: token {sampled[accepted]} does not match the "
                      f"grammar of request {request.request_id!r}")
        return False

    def stop_if_terminated(self, request: Request) -> None:
        """A request whose grammar has ended stops there (it may have no EOS to sample)."""
        if not request.is_finished() and self.backend.is_terminated(request.request_id):
            request.status = RequestStatus.FINISHED_STOPPED
