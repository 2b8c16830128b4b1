"""Every failure as OpenAI's error body `{"error": {"message", "type", "param", "code"}}`.

`OpenAIError` is what the serving code raises; `install_error_handlers` maps it, pydantic's
validation errors (malformed JSON included), sluice's ValueErrors, a dead engine and Starlette's
own HTTP errors (unknown route, wrong method) to that shape, so no client ever sees a bare 500
for its own mistake. Types and codes follow vLLM: the type names the HTTP error class, the code
is the status.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from sluice.errors import EngineDeadError

logger = logging.getLogger("sluice")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """A request that fails with `status`; `param` names the request field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @classmethod
    def from_value_error(cls, exc: ValueError, params: frozenset[str] | set[str]) -> OpenAIError:
        """sluice's ValueErrors start with the bad field's name ("top_p must be in (0, 1],
        got 7"); name it as the param when it is one of the request's `params`."""
        message = str(exc)
        first_word = message.split(" ", 1)[0].rstrip(":")
        return cls(message, 400, first_word if first_word in params else None)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "Error"), param=param,
                     code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """One line per problem, `field.sub: what was wrong`; the first field is the param."""
    lines = []
    param = None
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            lines.append(f"the request body is not valid JSON: {error.get('msg')}")
            continue
        field = ".".join(loc)
        if not field and error.get("type") in ("model_attributes_type", "dict_type"):
            lines.append("the request body must be a JSON object (and sent with "
                         "Content-Type: application/json)")
            continue
        if param is None and loc:
            param = loc[0]
        lines.append(f"{field}: {error.get('msg')}" if field else str(error.get("msg")))
    return error_response(400, "; ".join(lines) or "invalid request", param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_openai_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return error_response(exc.status, exc.message, exc.param)

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc)

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail))

    async def on_engine_dead(_: Request, exc: Exception) -> JSONResponse:
        return error_response(503, str(exc))

    async def on_value_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(400, str(exc))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(EngineDeadError, on_engine_dead)
    app.add_exception_handler(ValueError, on_value_error)
    app.add_exception_handler(Exception, on_unexpected)
