"""A served request leaves no reference cycle behind: its objects are freed by their counts
when it ends, not by a pass of the garbage collector.

The server's ``send`` is bound to uvicorn's request cycle, which holds the scope; the proxy
puts that ``send`` in the scope (``BODY_SEND``) for event streams. Left there, the three made
a cycle, so every request's objects waited for a collection and, under load, survived into
the older generations whose passes cost the most. A real uvicorn server on 127.0.0.1 with
``proxima serve``'s configuration (``ThreadedServer``), the collector off while it serves.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from proxima.proxy.logs import BODY_SEND, RequestIdMiddleware
from proxima.proxy.serving import ThreadedServer
from starlette.types import Receive, Scope, Send

served_cycles: list[weakref.ref[Any]] = []


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body_send = scope[BODY_SEND]
    served_cycles.append(weakref.ref(body_send.__self__))  # uvicorn's request cycle
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await body_send({"type": "http.response.body", "body": b"ok", "more_body": True})
    await body_send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_served_request_is_freed_without_the_collector(collector_off: None) -> None:
    served_cycles.clear()
    with ThreadedServer(_app) as served:
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"0\r\n\r\n")
        assert len(served_cycles) == 1
        deadline = time.monotonic() + 5
        while served_cycles[0]() is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the server's thread finishes the request after the last byte
        assert served_cycles[0]() is None, "the request's objects are held by a reference cycle"


def test_the_request_id_middleware_takes_its_send_out_of_the_scope() -> None:
    """Outside ``proxima serve``'s server the outermost middleware puts its own ``send`` in
    the scope; it leaves the scope as it found it."""
    seen: list[Any] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope[BODY_SEND])

    async def send(message: Any) -> None:
        pass

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    scope: dict[str, Any] = {"type": "http", "headers": []}
    asyncio.run(RequestIdMiddleware(inner)(scope, receive, send))
    assert seen == [send]
    assert BODY_SEND not in scope
