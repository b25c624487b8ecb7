"""One connection of the lean HTTP/1.1 client (``wire.py``): an asyncio protocol and its buffer.

The bytes that arrived and were not consumed yet are in ``Conn.buf``, which the response
reader parses in place (no ``StreamReader``: its Python calls per read, and the copy out
of its buffer, cost more than parsing a token's chunk). ``wait`` returns when more bytes
arrived, at the end of the stream (``eof``), or raises what broke it: the transport's error,
or the exception given to ``fail`` (the read timeout's). Reading pauses while more than
``_HIGH`` bytes wait unread and resumes when the reader waits again; writes pause with the
transport's buffer (``drain``).
"""

from __future__ import annotations

import asyncio
from typing import cast

_HIGH = 256 * 1024  # bytes unread before the transport stops reading


class Conn(asyncio.Protocol):
    """A keep-alive connection, used by one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.reused = False
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._read_paused = False
        self._write_paused = False

    # -- the transport's callbacks --------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > _HIGH and not self._read_paused and self.transport is not None:
            self.transport.pause_reading()
            self._read_paused = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if exc is not None and self.error is None:
            self.error = exc
        self._wake()
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    # -- for the reader ---------------------------------------------------------------
    def usable(self) -> bool:
        """Whether an idle connection may carry a request (the server has not closed it,
        and sent nothing since its last response)."""
        transport = self.transport
        return (
            transport is not None
            and not transport.is_closing()
            and not self.eof
            and self.error is None
            and not self.buf
        )

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        """Until the transport's write buffer has room again (or the connection is lost)."""
        if self._write_paused and not self.eof:
            self._drained = self.loop.create_future()
            await self._drained
        if self.error is not None:
            raise self.error

    async def wait(self) -> None:
        """Until more bytes arrive or the stream ends; raises what broke it."""
        waiter = self.waiter()
        if waiter is not None:
            await waiter
            if self.error is not None:
                raise self.error

    def waiter(self) -> asyncio.Future[None] | None:
        """``wait``'s future, for a reader that awaits it itself (one coroutine less per
        read), and then checks ``error``; None at the end of the stream. Raises what
        broke the stream."""
        if self.error is not None:
            raise self.error
        if self.eof:
            return None
        if self._read_paused and self.transport is not None:
            self.transport.resume_reading()  # the reader took what it could
            self._read_paused = False
        self._waiter = waiter = self.loop.create_future()
        return waiter

    async def readuntil(self, separator: bytes, limit: int) -> bytes:
        """The bytes up to and with ``separator``, taken from the buffer; ``LimitOverrunError``
        past ``limit`` bytes without it, ``IncompleteReadError`` at the end of the stream."""
        start = 0
        while True:
            at = self.buf.find(separator, start)
            if at >= 0:
                end = at + len(separator)
                data = bytes(self.buf[:end])
                del self.buf[:end]
                return data
            if len(self.buf) > limit:
                raise asyncio.LimitOverrunError("separator not found within the limit", limit)
            if self.eof:
                raise asyncio.IncompleteReadError(bytes(self.buf), None)
            start = max(0, len(self.buf) - len(separator) + 1)
            await self.wait()

    def fail(self, exc: BaseException) -> None:
        """Make the waiting read (and every later one) raise ``exc`` (a timeout's): the
        waiter wakes (its future is not failed) and the reader finds ``error`` set."""
        self.error = exc
        self._wake()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
