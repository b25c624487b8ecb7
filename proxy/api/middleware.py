"""Pure ASGI middleware (no ``BaseHTTPMiddleware``: it splits responses into
separate writes and re-wraps streams, which costs latency on every request)."""

from __future__ import annotations

import json
from typing import Any

from proxima.proxy.api.error_handlers import envelope_for
from proxima.proxy.errors import error_envelope
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
