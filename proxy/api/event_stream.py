"""``EventStreamResponse``: a lean ASGI response for server-sent events.

Every streamed token costs the proxy one socket write, and on loopback a
write is tens of microseconds of kernel time: the largest single cost of a
streamed request. This response writes in one ``send`` every piece that is
ready, and only what is ready:

- the pieces are pulled from their iterator by a producer task, which runs
  until the iterator has to wait (for the backend's next tokens), appending
  to a buffer;
- the writer sends the whole buffer as soon as it holds anything. The first
  piece never waits for later ones; pieces that arrived together (a backend
  read that held several tokens, the finish and ``[DONE]``) leave together;
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
from collections.abc import AsyncIterator, Mapping

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
        writer: asyncio.Future[bytes] | None = None
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
                # The rest is written by a task of its own: waking it for each write resumes
                # its one frame, not this task's chain of server and middleware frames.
                writer = asyncio.ensure_future(_write_until_done(buffer, body_send))
                data = await writer
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()  # not awaited: it only ever waits on ``receive``
            for task in (writer, producer):  # this task was cancelled itself
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


async def _write_until_done(buffer: _Buffer, body_send: Send) -> bytes:
    """Send what the producer makes as it comes; returns what it made last, once it ended
    (sent by the caller with the end of the body, in the same write)."""
    while True:
        data, done = await buffer.take()
        if done:
            return data
        await body_send({"type": "http.response.body", "body": data, "more_body": True})


class _Buffer:
    """Pieces produced but not yet sent; ``take`` waits for some, or for the end.

    The writer waits on a bare future, set by the first piece after it began waiting
    (no ``asyncio.Event``: its bookkeeping ran once per piece).
    """

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.done = False
        self._waiter: asyncio.Future[None] | None = None

    async def fill(self, pieces: AsyncIterator[bytes]) -> None:
        parts = self.parts
        async for piece in pieces:
            parts.append(piece)
            waiter = self._waiter
            if waiter is not None:  # wake, inline: the writer takes what there is
                self._waiter = None
                if not waiter.done():
                    waiter.set_result(None)
        # Now, not in the task's done callback (which runs a loop turn later, after the
        # writer): the last pieces and the end of the body leave in one write.
        self.end()

    def wake(self) -> None:
        """Let the writer take what there is (the head's timer: maybe nothing)."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def end(self, _: object = None) -> None:
        self.done = True
        self.wake()

    async def take(self) -> tuple[bytes, bool]:
        """Everything buffered, and whether the producer has ended (nothing more will come);
        waits while neither (or until ``wake``)."""
        if not self.parts and not self.done:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        parts = self.parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return data, self.done


async def _until_disconnected(receive: Receive) -> None:
    # The request body has been read: the next message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
