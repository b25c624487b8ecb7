"""Anthropic's error envelope: ``{"type": "error", "error": {"type", "message"}}``.

Anthropic's clients read only this shape, so every error answered under
``/v1/messages`` is written in it: the service's errors, validation failures,
the router's 404 and 405, a body over the size limit, a bug's 500. The status
is the one error table's (``proxima.proxy.errors.KINDS``); the ``type`` is
Anthropic's name for that status.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from proxima.proxy.errors import ContextTooLong, ProximaError, public_message

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error envelope for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_of(exc: ProximaError) -> dict[str, Any]:
    """``exc`` in Anthropic's envelope."""
    if isinstance(exc, ContextTooLong) and exc.max_tokens is not None:
        # Anthropic's own wording for a prompt plus max_tokens over the context window.
        message = (
            f"input length and `max_tokens` exceed context limit: {exc.prompt_tokens} + "
            f"{exc.max_tokens} > {exc.context_length}, decrease input length or `max_tokens` "
            "and try again (or serve with --clamp-max-tokens)"
        )
        return error_body(exc.status_code, message)
    message = public_message(exc)
    if exc.param is not None:
        message = f"{exc.param}: {message}"
    return error_body(exc.status_code, message)


def validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "Invalid request body."
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error")
        return f"The request body is not valid JSON: {why}." if why else "The body is not JSON."
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg"))


class AnthropicEnvelope:
    """The Messages surface's ``ErrorEnvelope``."""

    def of(self, exc: ProximaError) -> dict[str, Any]:
        return error_of(exc)

    def of_validation(self, exc: RequestValidationError) -> dict[str, Any]:
        return error_body(400, validation_message(exc))

    def of_status(self, status: int, openai: dict[str, Any]) -> dict[str, Any]:
        error = openai["error"]
        message = error["message"]
        if error.get("param"):
            message = f"{error['param']}: {message}"
        return error_body(status, message)


ANTHROPIC = AnthropicEnvelope()
