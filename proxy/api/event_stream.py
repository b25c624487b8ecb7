"""``EventStreamResponse``: a lean ASGI response for server-sent events.

Every streamed token costs the proxy one socket write, and on loopback a
write is tens of microseconds of kernel time: the largest single cost of a
streamed request. This response writes in one ``send`` every piece that is
ready, and only what is ready:

- the pieces are pulled from their iterator by a producer task, which runs
  until the iterator has to wait (for the backend's next tokens), appending
  to a buffer;
- the whole buffer is sent as soon as the producer waits (a ``call_soon`` the
  first piece after a send schedules, and a send run to its end at once when it
  does not wait: no task wakes per piece). The first piece never waits for later
  ones; pieces that arrived together (a backend read that held several tokens,
  the finish and ``[DONE]``) leave together;
- the last pieces go out with the end of the body, in the same write;
- the head (status and headers) waits for the first pieces, up to ``HEAD_WAIT``.

A client that disconnects cancels the producer, which cancels the stream's
work (the driver aborts the backend request and records nothing), as with
Starlette's ``StreamingResponse``; the disconnect is watched from the first
write on (or from ``HEAD_WAIT``), so a response that ends in its first write
costs no watcher task. A failure of the iterator itself (a bug:
the builders report errors as events) is raised after what was produced
before it has been sent.

The head goes through every middleware (status, headers, the request log); the body
goes to the send that the outermost of the proxy's middlewares was given
(``BODY_SEND``, put in the scope by ``RequestIdMiddleware``), past the middlewares
inside it, which look at a response's start only: a streamed token costs no call
per middleware. Without it in the scope (an app built without that middleware), the
body takes the same way as the head.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Generator, Mapping
from typing import Any, cast

from proxima.proxy.logs import BODY_SEND
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

# How long the response head waits for the first pieces, to be written right before
# them (the client reads both together rather than waking for the head alone); past
# it the head goes alone, so a client or a load balancer sees the response begin
# while a long prompt is prefilled.
HEAD_WAIT = 0.1

_BASE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx and friends: do not buffer the stream
]


class EventStreamResponse(Response):
    """``text/event-stream`` of encoded ``pieces``, in as few sends as streaming allows.

    A ``Response`` for FastAPI's sake (it returns those as they are); only
    ``__call__`` is its own.
    """

    def __init__(self, pieces: AsyncIterator[bytes], headers: Mapping[str, str] | None = None):
        self.pieces = pieces
        self.status_code = 200
        self.background: BackgroundTask | None = None
        self.raw_headers = _BASE_HEADERS + [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in (headers or {}).items()
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        buffer = _Buffer()
        producer = asyncio.ensure_future(buffer.fill(self.pieces))
        producer.add_done_callback(buffer.end)  # also when cancelled before it ran
        watcher: asyncio.Future[None] | None = None
        # The head leaves with the first pieces, or alone once HEAD_WAIT has passed.
        timer = asyncio.get_running_loop().call_later(HEAD_WAIT, buffer.wake)
        body_send = send
        try:
            data, done = await buffer.take()
            timer.cancel()
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            body_send = scope.get(BODY_SEND, send)
            if not done:
                if data:  # empty when the timer ended the wait for the head
                    await body_send({"type": "http.response.body", "body": data, "more_body": True})
                # The stream goes on: from now on a client that leaves cancels it. Not
                # before (a task per request, for the many that end in their first write):
                # a client gone during the first HEAD_WAIT is seen at its end.
                watcher = asyncio.ensure_future(_until_disconnected(receive))
                watcher.add_done_callback(lambda _: producer.cancel())
                # The rest is written as it comes by the buffer itself (``_Buffer.stream``);
                # this task wakes once more, at the end.
                data = await buffer.stream(body_send)
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()  # not awaited: it only ever waits on ``receive``
            for task in (buffer.writing, producer):  # this task was cancelled itself
                if task is not None and not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        if producer.cancelled():
            return  # the client went away
        failure = producer.exception()
        if failure is not None:
            if data:
                await body_send({"type": "http.response.body", "body": data, "more_body": True})
            raise failure
        await body_send({"type": "http.response.body", "body": data, "more_body": False})
        if self.background is not None:
            await self.background()


class _Buffer:
    """Pieces produced but not yet sent.

    Before the head, ``take`` waits for some, or for the end. Once streaming (``stream``),
    the first piece after a send schedules the next one (``loop.call_soon``): it runs once
    the producer waits for the backend, and sends every piece produced meanwhile in one
    ``send``, run to its end at once when the send does not wait (the transport takes the
    bytes; the common case), else finished by a task, while later pieces wait for it. No
    task wakes per piece: the producer's own wake-up ends in the write.
    """

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.done = False
        self.writing: asyncio.Future[None] | None = None  # a send that had to wait
        self.failure: BaseException | None = None  # what a send raised
        self._waiter: asyncio.Future[None] | None = None
        self._send: Send | None = None  # streaming: the body's send
        self._pending = False  # streaming: a send is scheduled or in flight

    async def fill(self, pieces: AsyncIterator[bytes]) -> None:
        parts = self.parts
        async for piece in pieces:
            parts.append(piece)
            if not self._pending:
                if self._send is not None:
                    self._pending = True
                    asyncio.get_running_loop().call_soon(self._flush)
                else:
                    self.wake()
        # Now, not in the task's done callback (which runs a loop turn later): the last
        # pieces and the end of the body leave in one write.
        self.end()

    def wake(self) -> None:
        """Let the waiting request task go on (the head's timer: maybe with nothing)."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def end(self, _: object = None) -> None:
        self.done = True
        if not self._pending:  # else the scheduled or running send wakes it when done
            self.wake()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    def _taken(self) -> bytes:
        parts = self.parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return data

    async def take(self) -> tuple[bytes, bool]:
        """Everything buffered, and whether the producer has ended (nothing more will come);
        waits while neither (or until ``wake``)."""
        if not self.parts and not self.done:
            await self._wait()
        return self._taken(), self.done

    async def stream(self, send: Send) -> bytes:
        """Send what the producer makes as it comes; returns what it made last, once it ended
        (sent by the caller with the end of the body, in the same write)."""
        self._send = send
        if self.parts and not self.done:
            self._pending = True
            self._flush()
        while (self._pending or not self.done) and self.failure is None:
            await self._wait()
        if self.failure is not None:
            raise self.failure
        return self._taken()

    def _flush(self) -> None:
        if self.done or self.failure is not None or not self.parts:
            self._pending = False  # the request task sends the rest with the end of the body
            self.wake()
            return
        assert self._send is not None
        message = {"type": "http.response.body", "body": self._taken(), "more_body": True}
        send = cast(Coroutine[Any, Any, None], self._send(message))
        try:
            waits_on = send.send(None)
        except StopIteration:
            self._pending = False
            return
        except BaseException as exc:  # noqa: BLE001 (handed to the request task)
            self._failed(exc)
            return
        # The send waits (a client that reads slowly): a task finishes it.
        self.writing = asyncio.ensure_future(_Started(send, waits_on))
        self.writing.add_done_callback(self._written)

    def _written(self, task: asyncio.Future[None]) -> None:
        self.writing = None
        if task.cancelled():
            return
        failure = task.exception()
        if failure is not None:
            self._failed(failure)
        elif self.parts and not self.done:
            self._flush()  # what came meanwhile
        else:
            self._pending = False
            self.wake()

    def _failed(self, exc: BaseException) -> None:
        self.failure = exc
        self._pending = False
        self.wake()


class _Started:
    """An awaitable that finishes a coroutine already run up to its first wait (on
    ``waits_on``): awaited by a task, it waits on that future, then runs the rest."""

    def __init__(self, coro: Coroutine[Any, Any, None], waits_on: Any):
        self.coro = coro
        self.waits_on = waits_on

    def __await__(self) -> Generator[Any, None, None]:
        try:
            yield self.waits_on
        except BaseException:
            self.coro.close()
            raise
        return (yield from self.coro.__await__())


async def _until_disconnected(receive: Receive) -> None:
    # The request body has been read: the next message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
