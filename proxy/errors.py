"""Domain errors of the proxy and their mapping to OpenAI's error envelope.

Services raise these; one exception handler (``install_error_handlers``) turns
them into ``{"error": {"message", "type", "param", "code"}}`` with the right
HTTP status, so no route formats errors by hand.

    ProximaError                      500 api_error
    ├── BadRequest                    400 invalid_request_error
    │   └── ContextTooLong            400 invalid_request_error / context_length_exceeded
    ├── AuthenticationFailed          401 authentication_error / invalid_api_key
    ├── PermissionDenied              403 permission_error
    ├── NotFound                      404 not_found_error (model_not_found for models)
    ├── Conflict                      409 conflict_error (reward twice, finished session)
    ├── PayloadTooLarge               413 invalid_request_error
    ├── RateLimited                   429 rate_limit_error (+ Retry-After)
    ├── ClientDisconnected            499 client_disconnected (nobody reads the answer)
    └── BackendUnavailable            503 service_unavailable (no healthy backend)

Request validation errors (bad JSON, wrong types) become 400s that name the
offending parameter; they never leak a raw pydantic dump. Store errors
(``proxima.proxy.store.errors``) map to 404 / 409. Once a stream has started,
``as_proxima_error`` picks the error event that ends it.

Under ``/v1/messages`` every error this module answers (a 404 or 405 of the
router, a 500 of a bug) is in Anthropic's envelope ``{"type": "error",
"error": {"type", "message"}}`` instead: the Messages routes' own errors are
turned into it by their route class, and this is the edge for the rest.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class ProximaError(Exception):
    status_code = 500
    error_type = "api_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.message, self.error_type, param=self.param, code=self.code)

    def headers(self) -> dict[str, str] | None:
        return None


class BadRequest(ProximaError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextTooLong(BadRequest):
    """The prompt, or the prompt plus ``max_tokens``, exceeds the context window.

    The numbers let each API word the error as its own server does (Anthropic's
    Messages API: ``input length and `max_tokens` exceed context limit: ...``).
    """

    default_code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        context_length: int | None = None,
    ):
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length


class AuthenticationFailed(ProximaError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDenied(ProximaError):
    status_code = 403
    error_type = "permission_error"


class NotFound(ProximaError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(ProximaError):
    status_code = 409
    error_type = "conflict_error"


class PayloadTooLarge(ProximaError):
    status_code = 413
    error_type = "invalid_request_error"


class RateLimited(ProximaError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None):
        super().__init__(message, code=code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class ClientDisconnected(ProximaError):
    """The client went away before its answer was ready (nginx's 499); nothing is sent."""

    status_code = 499
    error_type = "client_disconnected"


class BackendUnavailable(ProximaError):
    status_code = 503
    error_type = "service_unavailable"


def error_envelope(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def as_proxima_error(exc: Exception) -> ProximaError:
    """The API error for a failure: a store error keeps its status, anything else is a 500."""
    from proxima.proxy.store import errors as store_errors

    if isinstance(exc, ProximaError):
        return exc
    if isinstance(exc, store_errors.RewardAlreadySet):
        return Conflict(str(exc), param="reward", code="reward_already_set")
    if isinstance(exc, store_errors.SessionClosed):
        return Conflict(str(exc), code="session_closed")
    if isinstance(exc, store_errors.Conflict):
        return Conflict(str(exc))
    if isinstance(exc, store_errors.NotFound):
        return NotFound(str(exc))
    return ProximaError("The server had an error while processing your request.")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence for the first validation error, and its parameter.

    A validator that knows the exact field (``param`` on the raised error, e.g.
    ``messages[0].content``) names it; the alternatives of a union (``prompt``
    as a string or token ids) are reported at the union's own field.
    """
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    param = getattr(cause, "param", None)
    if isinstance(param, str):
        return str(cause), param
    if first.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request: " + first.get("msg", ""), None
    loc = _common_prefix([_field_path(e.get("loc", ())) for e in errors if e.get("loc")])
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if param:
        return f"Invalid value for '{param}': {msg}.", param
    return f"Invalid request body: {msg}.", None


def _field_path(loc: Any) -> list[str]:
    return [str(p) for p in loc if p not in ("body", "header", "query", "path")]


def _common_prefix(paths: list[list[str]]) -> list[str]:
    """The path every error of the first field shares (a union's member tags drop out)."""
    if not paths:
        return []
    first = paths[0]
    same_field = [p for p in paths if p[:1] == first[:1]]
    prefix = first
    for path in same_field[1:]:
        n = 0
        while n < min(len(prefix), len(path)) and prefix[n] == path[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


ANTHROPIC_PATH = "/v1/messages"
"""Requests under this path are answered in Anthropic's error envelope."""


def _answer(
    request: Request,
    status: int,
    envelope: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """``envelope`` (OpenAI's) as the response, in Anthropic's shape on the Messages routes."""
    if request.url.path.startswith(ANTHROPIC_PATH):
        from proxima.proxy.service.builders.messages import error_body

        error = envelope["error"]
        message = error["message"]
        if error.get("param"):
            message = f"{error['param']}: {message}"
        envelope = error_body(status, message)
    return JSONResponse(envelope, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    from proxima.proxy.store import errors as store_errors

    @app.exception_handler(ProximaError)
    async def _proxima(request: Request, exc: ProximaError) -> JSONResponse:
        return _answer(request, exc.status_code, exc.envelope(), exc.headers())

    @app.exception_handler(store_errors.NotFound)
    async def _store_not_found(request: Request, exc: Exception) -> JSONResponse:
        return _answer(request, 404, error_envelope(str(exc), "not_found_error"))

    @app.exception_handler(store_errors.RewardAlreadySet)
    async def _reward_twice(request: Request, exc: Exception) -> JSONResponse:
        return _answer(
            request,
            409,
            error_envelope(str(exc), "conflict_error", param="reward", code="reward_already_set"),
        )

    @app.exception_handler(store_errors.SessionClosed)
    async def _session_closed(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_envelope(str(exc), "conflict_error", code="session_closed"), status_code=409
        )

    @app.exception_handler(store_errors.Conflict)
    async def _store_conflict(request: Request, exc: Exception) -> JSONResponse:
        return _answer(request, 409, error_envelope(str(exc), "conflict_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _answer(request, 400, error_envelope(message, "invalid_request_error", param=param))

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return _answer(
            request,
            400,
            error_envelope(f"Malformed JSON body: {exc.msg}.", "invalid_request_error"),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug: log it with its traceback, answer in the envelope (never a bare text 500).
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _answer(
            request,
            500,
            error_envelope("The server had an error while processing your request.", "api_error"),
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "api_error"
        )
        return _answer(
            request,
            exc.status_code,
            error_envelope(str(exc.detail), kind),
            getattr(exc, "headers", None),
        )
