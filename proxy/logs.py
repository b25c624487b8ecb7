"""Structured logging: one JSON object per line, with request and session ids.

``request_id`` and ``session_id`` live in context variables set by the
request middleware and the completion service, so every log line written
while serving a request carries them. Bearer keys are never logged: nothing
logs headers, and ``redact`` masks anything that looks like a key.

The request log (``proxima.access``, one line per request: written by
``proxima.proxy.api.middleware.AccessLogMiddleware``) collects what the layers
below the routes know about a request through :func:`note_request`: the
session, the policy, the tokens. The text format (``--log-format text``)
writes a record's extra fields as ``key=value`` after its message.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)
session_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "session_id", default=None
)

access_fields_var: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "access_fields", default=None
)
"""The fields of the current request's access-log line (None: no request, or the log is off)."""

_KEY = re.compile(r"sk-[A-Za-z0-9_\-]{8,}")
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def redact(text: str) -> str:
    """``text`` with anything that looks like a key masked."""
    return _KEY.sub("sk-***", text) if "sk-" in text else text


def note_request(**fields: Any) -> None:
    """Add ``fields`` (session_id, policy, prompt_tokens, ...) to the current request's
    access-log line; nothing outside a request or with the request log off. One dict
    update: cheap enough for the hot path."""
    found = access_fields_var.get()
    if found is not None:
        found.update(fields)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    """The fields passed with ``extra=``: the record's attributes a LogRecord lacks."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and k[0] != "_"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        if (rid := request_id_var.get()) is not None:
            out["request_id"] = rid
        if (sid := session_id_var.get()) is not None:
            out["session_id"] = sid
        for key, value in _extras(record).items():
            out[key] = value if isinstance(value, int | float | bool | None) else redact(str(value))
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        try:
            return orjson.dumps(out, default=str).decode()
        except TypeError:  # an integer past 64 bits
            return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``: for humans; the extra fields follow
    the message (a value with spaces or quotes as a JSON string; those a record names in
    its ``_in_message`` attribute are left out), keys masked."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = redact(super().format(record))
        fields = []
        shown = getattr(record, "_in_message", ())  # fields the message already says
        for key, value in _extras(record).items():
            if value is None or key in shown:
                continue
            text = redact(str(value))
            if not text or any(c in text for c in ' "=\n\t'):
                text = json.dumps(text, ensure_ascii=False)
            fields.append(f"{key}={text}")
        if not fields:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {' '.join(fields)}{sep}{tail}"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record is emitted, not as it was when the
    handler was made: a caller that swaps it (a test's capture, a daemon's redirect) gets
    the lines, and a closed stream from before is never written to."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # under the handler's lock, as emit always is
        super().emit(record)


def configure_logging(level: str = "info", *, json_logs: bool = True) -> None:
    """The root logger's one handler: JSON lines (else text) on standard error, at ``level``."""
    handler = _StderrHandler()
    if json_logs:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Per-request lines of the HTTP client would drown everything else.
    for noisy in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# The scope key of the send a streamed body's chunks go to, past the middlewares
# (``EventStreamResponse``): the server's own (``serving.server_config`` puts it there), else
# the one ``RequestIdMiddleware``, the outermost of the proxy's middlewares, was given.
BODY_SEND = "proxima.body_send"


class RequestIdMiddleware:
    """Takes ``X-Request-Id`` from the request (or makes one) and returns it.

    The outermost of the proxy's middlewares: unless the server put its own there, it
    also puts the send it was given in the scope (``BODY_SEND``), for a response whose body
    need not pass the middlewares inside, which all act on a response's start only
    (status, headers, the request log).
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next(
            (v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"), None
        )
        rid = incoming[:128] if incoming else uuid.uuid4().hex
        token = request_id_var.set(rid)
        session_token = session_id_var.set(None)
        own_send = BODY_SEND not in scope  # else the server's own is there
        if own_send:
            scope[BODY_SEND] = send

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            request_id_var.reset(token)
            session_id_var.reset(session_token)
            if own_send:  # a send in its own scope is a reference cycle (see _ServerSend)
                del scope[BODY_SEND]
