"""Every error the proxy raises on purpose, and the one table of their statuses.

One root, as httpx's ``_exceptions.py`` has it; the store and the backend
layer raise their own subtrees (re-exported by ``proxima.proxy.store.errors``
and ``proxima.proxy.backends.errors``), and no layer below the edge knows
HTTP::

    ProximaError                      500 api_error
    ├── BadRequest                    400 invalid_request_error
    │   └── ContextTooLong            400 invalid_request_error / context_length_exceeded
    ├── AuthenticationFailed          401 authentication_error / invalid_api_key
    ├── PermissionDenied              403 permission_error
    ├── NotFound                      404 not_found_error (a model, a session, a key...)
    ├── Conflict                      409 conflict_error
    │   ├── RewardAlreadySet          409 conflict_error / reward_already_set   (store)
    │   ├── SessionClosed             409 conflict_error / session_closed       (store)
    │   └── NotAdmitted               409 conflict_error (the /rl route: a 429)  (store)
    ├── PayloadTooLarge               413 invalid_request_error
    ├── RateLimited                   429 rate_limit_error (+ Retry-After)
    ├── ClientDisconnected            499 client_disconnected (nobody reads the answer)
    ├── StoreError                    500 api_error, message withheld (the store's own failure)
    │   └── StoreUnavailable          503 service_unavailable / store_unavailable (+ Retry-After)
    └── BackendError                  503 service_unavailable
        ├── BackendUnavailable        no healthy backend; generation interrupted too often
        ├── BackendConnectionError    unreachable or died mid-request (the pool fails over)
        ├── BackendRejected           the backend refused the request (its 4xx)
        └── BackendOperationFailed    an admin call answered ``success: false`` or a 5xx

:data:`KINDS` is the table: an error's status, type and code are its nearest
class's row (:func:`kind_of`). Each API surface writes the error in its own
envelope from that row (OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` by :func:`openai_envelope`, Anthropic's in
``proxima.proxy.surfaces.messages.errors``: each surface's ``ErrorEnvelope``);
``proxima.proxy.api.error_handlers`` is the HTTP edge that answers them in the envelope of
the surface the path belongs to, and ``as_proxima_error`` picks the error that ends a stream
that has started. Request validation errors (bad JSON, wrong types) become
400s that name the offending parameter; they never leak a raw pydantic dump.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.exceptions import RequestValidationError

logger = logging.getLogger(__name__)

INTERNAL_MESSAGE = "The server had an error while processing your request."


class ProximaError(Exception):
    """The root. ``param`` names the request field at fault; ``code`` overrides the table's."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else kind_of(self).code

    @property
    def status_code(self) -> int:
        return kind_of(self).status

    @property
    def error_type(self) -> str:
        return kind_of(self).type

    def envelope(self) -> dict[str, Any]:
        """OpenAI's error envelope of this error."""
        return openai_envelope(self)

    def headers(self) -> dict[str, str] | None:
        return None


# ----------------------------------------------------------------- the request's fault


class BadRequest(ProximaError):
    pass


class ContextTooLong(BadRequest):
    """The prompt, or the prompt plus ``max_tokens``, exceeds the context window.

    The numbers let each API word the error as its own server does (Anthropic's
    Messages API: ``input length and `max_tokens` exceed context limit: ...``).
    """

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
    pass


class PermissionDenied(ProximaError):
    pass


class NotFound(ProximaError):
    """The addressed thing does not exist (or is not visible to the caller)."""


class Conflict(ProximaError):
    """The operation is not allowed in the current state."""


class PayloadTooLarge(ProximaError):
    pass


class RateLimited(ProximaError):
    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None):
        super().__init__(message, code=code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class ClientDisconnected(ProximaError):
    """The client went away before its answer was ready (nginx's 499); nothing is sent."""


# ----------------------------------------------------------------- the store


class RewardAlreadySet(Conflict):
    """A reward was already posted; rewards are write-once."""

    def __init__(self, message: str, *, param: str | None = "reward", code: str | None = None):
        super().__init__(message, param=param, code=code)


class SessionClosed(Conflict):
    """The session is not OPEN: it takes no more completions."""


class NotAdmitted(Conflict):
    """Admission refused a new training session; ``reason`` says which limit."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StoreError(ProximaError):
    """The store cannot do what it was asked (schema not current, a broken chain)."""


STORE_RETRY_AFTER_S = 2.0
"""The ``Retry-After`` of a store outage: a restarting database or a released lock is
back within seconds."""


class StoreUnavailable(StoreError):
    """The database does not answer now: connection refused or reset, the server shutting
    down or starting up, a SQLite file locked past its busy timeout. Retryable: the request
    may be sent again after ``Retry-After`` (a connection lost during a commit leaves the
    commit's outcome unknown: ``POST /rl/sessions`` with an ``Idempotency-Key`` is safe to
    repeat)."""

    def __init__(
        self,
        message: str = "The trajectory store is unavailable (the database is unreachable or "
        "locked); retry the request shortly.",
        *,
        retry_after: float = STORE_RETRY_AFTER_S,
    ):
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))}


# ----------------------------------------------------------------- the backends


class BackendError(ProximaError):
    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url


class BackendUnavailable(BackendError):
    """No healthy backend serves the request, or generation was interrupted too often;
    ``retry_after``: when to try again, where that is known (a ``Retry-After`` header)."""

    def __init__(
        self, message: str, *, url: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, url=url)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str] | None:
        if self.retry_after is None:
            return None
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class BackendConnectionError(BackendError):
    pass


class BackendRejected(BackendError):
    def __init__(self, message: str, *, url: str | None = None, backend_status: int = 400):
        super().__init__(message, url=url)
        self.backend_status = backend_status


class BackendOperationFailed(BackendError):
    pass


# ----------------------------------------------------------------- the table


@dataclass(frozen=True, slots=True)
class Kind:
    """How an error is answered: HTTP status, error type, default code.

    ``internal``: the message is the server's own business (logged, never sent).
    """

    status: int
    type: str
    code: str | None = None
    internal: bool = False


KINDS: dict[type[ProximaError], Kind] = {
    ProximaError: Kind(500, "api_error"),
    BadRequest: Kind(400, "invalid_request_error"),
    ContextTooLong: Kind(400, "invalid_request_error", "context_length_exceeded"),
    AuthenticationFailed: Kind(401, "authentication_error", "invalid_api_key"),
    PermissionDenied: Kind(403, "permission_error"),
    NotFound: Kind(404, "not_found_error"),
    Conflict: Kind(409, "conflict_error"),
    RewardAlreadySet: Kind(409, "conflict_error", "reward_already_set"),
    SessionClosed: Kind(409, "conflict_error", "session_closed"),
    PayloadTooLarge: Kind(413, "invalid_request_error"),
    RateLimited: Kind(429, "rate_limit_error"),
    ClientDisconnected: Kind(499, "client_disconnected"),
    StoreError: Kind(500, "api_error", internal=True),
    StoreUnavailable: Kind(503, "service_unavailable", "store_unavailable"),
    BackendError: Kind(503, "service_unavailable"),
}


def kind_of(exc: ProximaError) -> Kind:
    """The row of ``exc``'s nearest class in :data:`KINDS`."""
    for cls in type(exc).__mro__:
        kind = KINDS.get(cls)
        if kind is not None:
            return kind
    raise AssertionError("ProximaError has a row")  # pragma: no cover


def public_message(exc: ProximaError) -> str:
    """What the client is told: the message, unless the table keeps it internal."""
    return INTERNAL_MESSAGE if kind_of(exc).internal else exc.message


def error_envelope(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def openai_envelope(exc: ProximaError) -> dict[str, Any]:
    """``exc`` in OpenAI's envelope (Chat Completions, Completions, Responses, /rl, /admin)."""
    return error_envelope(public_message(exc), exc.error_type, param=exc.param, code=exc.code)


def as_proxima_error(exc: Exception) -> ProximaError:
    """The error to answer for a failure: ours as it is, anything else a 500 (a bug)."""
    if isinstance(exc, ProximaError):
        return exc
    return ProximaError(INTERNAL_MESSAGE)


# ----------------------------------------------------------------- validation messages


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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


# ----------------------------------------------------------------- the edge


class ErrorEnvelope(Protocol):
    """How a surface writes an error: one of ours, a validation failure, or the edge's own
    (a router's 404, a body too large, a bug's 500) given in OpenAI's envelope."""

    def of(self, exc: ProximaError) -> dict[str, Any]: ...

    def of_validation(self, exc: RequestValidationError) -> dict[str, Any]: ...

    def of_status(self, status: int, openai: dict[str, Any]) -> dict[str, Any]: ...


class OpenAIEnvelope:
    """``{"error": {"message", "type", "param", "code"}}``: the OpenAI surfaces, /rl, /admin."""

    def of(self, exc: ProximaError) -> dict[str, Any]:
        return openai_envelope(exc)

    def of_validation(self, exc: RequestValidationError) -> dict[str, Any]:
        message, param = validation_message(exc)
        return error_envelope(message, "invalid_request_error", param=param)

    def of_status(self, status: int, openai: dict[str, Any]) -> dict[str, Any]:
        return openai


OPENAI_ENVELOPE = OpenAIEnvelope()
