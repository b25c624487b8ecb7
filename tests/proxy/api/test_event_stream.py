"""``EventStreamResponse`` against the ASGI contract: what it sends, and when.

The response is driven as uvicorn drives it (``send`` records each message,
``receive`` reports the disconnect); the pieces come from async generators
whose pauses stand in for a backend computing the next tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from proxima.proxy.api import event_stream
from proxima.proxy.api.event_stream import EventStreamResponse
from proxima.proxy.logs import BODY_SEND


class Client:
    """Records what the response sends; ``leave()`` makes ``receive`` report a disconnect."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.sent = asyncio.Event()
        self.gone = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.sent.set()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def until_sent(self, count: int) -> None:
        """Wait until ``count`` messages have been sent."""
        while len(self.messages) < count:
            self.sent.clear()
            await asyncio.wait_for(self.sent.wait(), 5)

    def leave(self) -> None:
        self.gone.set()

    def bodies(self) -> list[tuple[bytes, bool]]:
        return [(m["body"], m["more_body"]) for m in self.messages[1:]]


async def run(pieces: AsyncIterator[bytes], client: Client) -> None:
    response = EventStreamResponse(pieces, {"X-Proxima-Session-Id": "s1"})
    await response({"type": "http"}, client.receive, client.send)


async def test_pieces_ready_together_leave_in_one_send_with_the_end() -> None:
    async def pieces() -> AsyncIterator[bytes]:
        for piece in (b"a", b"b", b"c"):
            yield piece

    client = Client()
    await run(pieces(), client)
    start = client.messages[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"x-proxima-session-id"] == b"s1"
    assert client.bodies() == [(b"abc", False)]


async def test_the_first_piece_does_not_wait_for_later_ones() -> None:
    later = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        yield b"first"
        await later.wait()  # the backend is still computing
        yield b"second"
        yield b"third"

    client = Client()
    task = asyncio.create_task(run(pieces(), client))
    await client.until_sent(2)
    assert client.bodies() == [(b"first", True)]  # sent while the stream waits
    later.set()
    await asyncio.wait_for(task, 5)
    assert client.bodies() == [(b"first", True), (b"secondthird", False)]


async def test_pieces_made_together_mid_stream_leave_together() -> None:
    """After the first write, each wait of the stream ends a write of what came before it."""
    steps = [asyncio.Event() for _ in range(2)]

    async def pieces() -> AsyncIterator[bytes]:
        yield b"a"
        await steps[0].wait()
        yield b"b"
        yield b"c"
        await steps[1].wait()
        yield b"d"

    client = Client()
    task = asyncio.create_task(run(pieces(), client))
    await client.until_sent(2)
    steps[0].set()
    await client.until_sent(3)
    assert client.bodies() == [(b"a", True), (b"bc", True)]
    steps[1].set()
    await asyncio.wait_for(task, 5)
    assert client.bodies() == [(b"a", True), (b"bc", True), (b"d", False)]


class SlowClient(Client):
    """A client whose reads lag: a body send after the first waits until ``drained``."""

    def __init__(self) -> None:
        super().__init__()
        self.drained = asyncio.Event()
        self.waiting = asyncio.Event()  # a send waits

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and len(self.messages) >= 2:
            self.waiting.set()
            await self.drained.wait()  # the transport's buffer is full
        await super().send(message)


async def test_a_send_that_waits_is_finished_and_what_came_meanwhile_follows() -> None:
    more, made, last = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        yield b"a"
        await asyncio.sleep(0)
        yield b"b"  # its send waits for the client
        await more.wait()
        yield b"c"  # made while that send waits
        yield b"d"
        made.set()
        await last.wait()
        yield b"e"

    client = SlowClient()
    task = asyncio.create_task(run(pieces(), client))
    await asyncio.wait_for(client.waiting.wait(), 5)
    more.set()
    await asyncio.wait_for(made.wait(), 5)
    assert client.bodies() == [(b"a", True)]  # "b" waits, "cd" behind it
    client.drained.set()
    await client.until_sent(4)
    assert client.bodies() == [(b"a", True), (b"b", True), (b"cd", True)]
    last.set()
    await asyncio.wait_for(task, 5)
    assert client.bodies() == [(b"a", True), (b"b", True), (b"cd", True), (b"e", False)]


async def test_a_send_that_fails_mid_stream_ends_the_response_and_the_stream() -> None:
    cleaned_up = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        try:
            yield b"a"
            await asyncio.sleep(0)
            yield b"b"
            await asyncio.Event().wait()
        finally:
            cleaned_up.set()

    class Broken(Client):
        async def send(self, message: dict[str, Any]) -> None:
            if len(self.messages) >= 2:
                raise OSError("the connection broke")
            await super().send(message)

    client = Broken()
    with pytest.raises(OSError, match="the connection broke"):
        await asyncio.wait_for(run(pieces(), client), 5)
    assert cleaned_up.is_set()
    assert client.bodies() == [(b"a", True)]


async def test_a_client_that_leaves_cancels_the_stream_and_ends_nothing() -> None:
    cleaned_up = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        try:
            yield b"first"
            await asyncio.Event().wait()  # a generation that would run on
        finally:
            cleaned_up.set()  # the driver aborts its backend request here

    client = Client()
    task = asyncio.create_task(run(pieces(), client))
    await client.until_sent(2)
    client.leave()
    await asyncio.wait_for(task, 5)
    assert cleaned_up.is_set()
    assert client.bodies() == [(b"first", True)]  # no end of body for a client that is gone


async def test_a_client_that_leaves_before_the_first_piece_cancels_the_stream() -> None:
    started = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        started.set()
        await asyncio.Event().wait()
        yield b"never"

    client = Client()
    task = asyncio.create_task(run(pieces(), client))
    await asyncio.wait_for(started.wait(), 5)
    client.leave()
    await asyncio.wait_for(task, 5)
    assert client.bodies() == []


async def test_a_failing_stream_sends_what_it_produced_then_raises() -> None:
    async def pieces() -> AsyncIterator[bytes]:
        yield b"first"
        raise RuntimeError("a bug in a builder")

    client = Client()
    with pytest.raises(RuntimeError, match="a bug in a builder"):
        await run(pieces(), client)
    assert client.bodies() == [(b"first", True)]  # never a complete-looking body


async def test_the_head_waits_for_the_first_piece_and_leaves_before_it() -> None:
    later = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        await later.wait()  # the backend computes the first token
        yield b"first"
        yield b"second"

    client = Client()
    task = asyncio.create_task(run(pieces(), client))
    await asyncio.sleep(0.02)  # well within HEAD_WAIT
    assert client.messages == []  # no head alone while the first token is near
    later.set()
    await asyncio.wait_for(task, 5)
    assert client.messages[0]["type"] == "http.response.start"
    assert client.bodies() == [(b"firstsecond", False)]


async def test_the_head_leaves_alone_when_the_first_piece_is_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(event_stream, "HEAD_WAIT", 0.01)
    later = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        await later.wait()  # a long prefill
        yield b"first"

    client = Client()
    task = asyncio.create_task(run(pieces(), client))
    await client.until_sent(1)
    assert client.messages[0]["type"] == "http.response.start"
    assert client.bodies() == []  # the head went alone, and no empty body with it
    later.set()
    await asyncio.wait_for(task, 5)
    assert client.bodies() == [(b"first", False)]


async def test_the_body_goes_to_the_outer_send_when_the_scope_has_one() -> None:
    """The head through the middlewares (``send``); the body past them (``BODY_SEND``)."""

    async def pieces() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    inner, outer = Client(), Client()
    response = EventStreamResponse(pieces())
    scope = {"type": "http", BODY_SEND: outer.send}
    await response(scope, inner.receive, inner.send)
    assert [m["type"] for m in inner.messages] == ["http.response.start"]
    assert [(m["body"], m["more_body"]) for m in outer.messages] == [(b"ab", False)]


def test_a_served_stream_passes_the_middlewares_once_whatever_its_length() -> None:
    """Served as ``proxima serve`` serves (``server_config``): each middleware sees the
    response's start, and none sees its 40 writes (the request log adds nothing per chunk)."""
    import httpx
    from proxima.proxy.api.middleware import AccessLogMiddleware
    from proxima.proxy.logs import RequestIdMiddleware
    from proxima.proxy.serving import ThreadedServer
    from starlette.applications import Starlette
    from starlette.routing import Route

    seen: list[str] = []

    class Counting:  # an inner middleware: what it sees of the response
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def counted(message: Any) -> None:
                if scope["type"] == "http":
                    seen.append(message["type"])
                await send(message)

            await self.app(scope, receive, counted)

    async def endpoint(request: Any) -> EventStreamResponse:
        async def pieces() -> AsyncIterator[bytes]:
            for i in range(40):
                yield b"data: %d\n\n" % i
                await asyncio.sleep(0.001)  # each its own write

        return EventStreamResponse(pieces())

    app = Starlette(routes=[Route("/s", endpoint, methods=["GET"])])
    app.add_middleware(Counting)
    app.add_middleware(AccessLogMiddleware)
    app.add_middleware(RequestIdMiddleware)
    with ThreadedServer(app) as server:
        body = httpx.get(server.url + "/s", timeout=10).content
    assert body == b"".join(b"data: %d\n\n" % i for i in range(40))
    assert seen == ["http.response.start"]
