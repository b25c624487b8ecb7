"""Pure ASGI middleware (no ``BaseHTTPMiddleware``: it splits responses into
separate writes and re-wraps streams, which costs latency on every request).

``BodyLimitMiddleware`` refuses bodies over the limit (413); ``AccessLogMiddleware``
writes the request log, one line per request.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from proxima.proxy.api.error_handlers import envelope_for
from proxima.proxy.errors import error_envelope
from proxima.proxy.logs import access_fields_var, redact, request_id_var
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413, declared or streamed."""

    def __init__(self, app: ASGIApp, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send: Send, size: Any, path: str) -> None:
        message = f"Request body of {size} bytes exceeds the limit of {self.max_bytes}."
        # In the path's surface's envelope: Anthropic's clients read only their own shape.
        envelope = envelope_for(path).of_status(
            413, error_envelope(message, "invalid_request_error")
        )
        body = json.dumps(envelope).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(send, int(value), scope.get("path", ""))
                return
        received = 0
        limit = self.max_bytes

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _TooLarge(received, limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge as exc:
            await self._reject(send, f"more than {exc.args[0]}", scope.get("path", ""))


class _TooLarge(HTTPException):
    """A streamed (chunked) body passed the limit while it was read.

    An ``HTTPException`` so that FastAPI, which turns any other error raised
    while reading the body into a 400, passes it on: the answer is 413.
    """

    def __init__(self, received: int, limit: int):
        super().__init__(
            413, f"Request body of more than {received} bytes exceeds the limit of {limit}."
        )
        self.args = (received,)


access_logger = logging.getLogger("proxima.access")

# Probes a load balancer or Prometheus sends every few seconds: their successes are
# logged at debug level, so that the request log at info is the traffic.
QUIET_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/metrics"})
MAX_ERROR_CHARS = 300  # of an error's message in the log
_MAX_ERROR_BODY = 65536  # bytes of an error response read for its message
_IN_MESSAGE = ("method", "route", "status", "latency_ms")  # the text format's message says them


class AccessLogMiddleware:
    """The request log: one line per request, on the ``proxima.access`` logger.

    A line has the method, the route (its template: ``/rl/sessions/{session_id}``; the
    path when no route matched), the status, the latency (until the response ended, in
    ms) and, where known, the session id, the policy (``base`` or the adapter), the
    deployment and version that generated, the prompt and output tokens (noted by the
    completion service with :func:`proxima.proxy.logs.note_request`), and on a 4xx/5xx
    the error's message (read from the error response's JSON envelope: error responses
    only, never a success's body). A stream's status is its start's; a stream that ends
    with an error event notes that error. Headers and request bodies are never read, so
    neither a key nor a prompt reaches the log; messages are cut to ``MAX_ERROR_CHARS``
    and keys masked.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        fields: dict[str, Any] = {}
        token = access_fields_var.set(fields)
        status = 0
        error_body: list[bytes] | None = None  # the body of an error response, read

        async def send_wrapper(message: Message) -> None:
            nonlocal status, error_body
            if message["type"] == "http.response.start":
                status = message["status"]
                if status >= 400:
                    error_body = []
            elif (
                error_body is not None
                and message["type"] == "http.response.body"
                and sum(map(len, error_body)) < _MAX_ERROR_BODY
            ):
                error_body.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException as exc:
            fields.setdefault("error", f"{type(exc).__name__}: {exc}")
            raise
        finally:
            access_fields_var.reset(token)
            self._log(scope, status or 500, started, fields, error_body)

    @staticmethod
    def _log(
        scope: Scope,
        status: int,
        started: float,
        fields: dict[str, Any],
        error_body: list[bytes] | None,
    ) -> None:
        path = scope.get("path", "")
        level = logging.INFO if status < 500 else logging.WARNING
        if status < 400 and path in QUIET_PATHS:
            level = logging.DEBUG
        if not access_logger.isEnabledFor(level):
            return
        route: Any = scope.get("route")
        template = getattr(route, "path", None) or path[:200]
        method = scope.get("method", "")
        if "session_id" not in fields:
            session = (scope.get("path_params") or {}).get("session_id")
            if isinstance(session, str):
                fields["session_id"] = session[:64]
        if error_body is not None and "error" not in fields:
            fields["error"] = _error_message(b"".join(error_body))
        if "error" in fields:
            fields["error"] = redact(str(fields["error"]))[:MAX_ERROR_CHARS]
        extra = {
            "method": method,
            "route": template,
            "status": status,
            "latency_ms": round((time.perf_counter() - started) * 1000, 1),
            "request_id": request_id_var.get(),
            **{k: v for k, v in fields.items() if v is not None},
        }
        extra["_in_message"] = _IN_MESSAGE
        args = (method, template, status, extra["latency_ms"])
        # makeRecord + handle: what ``log`` does, less its walk of the stack for the caller.
        record = access_logger.makeRecord(
            access_logger.name, level, __file__, 0, "%s %s %d %.1fms", args, None, extra=extra
        )
        access_logger.handle(record)


def _error_message(body: bytes) -> str:
    """The message of an error response: its envelope's ``error.message`` (OpenAI and
    Anthropic alike), a ``detail``, else the body's text."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()
    if isinstance(parsed, dict):
        error = parsed.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            return message
        if isinstance(error, str):
            return error
        if "detail" in parsed:
            return str(parsed["detail"])
    return body.decode("utf-8", "replace").strip()
