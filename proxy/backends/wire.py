"""A lean HTTP/1.1 client for the generation hot path: keep-alive connections over asyncio streams.

``/generate`` streams are the proxy's hottest I/O: every token crosses one
chunk of one response. A general client (httpx) spends more CPU per chunk
than the rest of the relay, so generation requests go through this one, and
admin calls (weights, health) stay on httpx.

What it does, and nothing more:

- one pool of keep-alive connections per backend (``WirePool``), at most
  ``max_connections`` open at once; idle ones the server has closed are
  dropped before use;
- a request is written in one write (``POST`` with a ``Content-Length``
  body); the status line and headers are parsed; the body is read as
  ``Transfer-Encoding: chunked``, ``Content-Length`` or up to EOF;
- ``WireResponse.lines`` splits the body into lines as bytes, so a chunk
  boundary inside a line or a UTF-8 character never matters;
  ``WireResponse.data_batches`` gives a server-sent event stream's ``data:``
  fields, those of each read found by one regular expression;
- timeouts: connecting, writing, and each read (a slow first token is
  not a dead backend: the read timeout is long);
- a connection goes back to the pool only when its response was read to
  the end and the server keeps it alive; a response left early (a client
  disconnect) closes its connection, which tells the server to stop;
- retries: ``/generate`` is not idempotent, so a request is retried only
  when it went out on a reused idle connection that failed before any
  response byte (the server closed it while idle), and only once.

Every failure is a ``BackendConnectionError``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

from proxima.proxy.backends.errors import BackendConnectionError
from proxima.proxy.backends.wire_body import DataStream, dechunk
from proxima.proxy.backends.wire_conn import Conn

_MAX_HEAD = 64 * 1024


class _NoResponse(Exception):
    """A connection failed before any byte of the response arrived."""


class WirePool:
    """Keep-alive HTTP/1.1 connections to one server (``http://host:port`` or ``https``)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        write_timeout: float = 30.0,
        pool_timeout: float = 30.0,
        max_connections: int = 4096,
        max_idle: int = 1024,
    ):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend URL must be http(s)://host[:port], got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        netloc = self.host if parts.port is None else f"{self.host}:{parts.port}"
        self._host_header = f"Host: {netloc}\r\n".encode()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.pool_timeout = pool_timeout
        self.max_idle = max_idle
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[Conn] = []

    @property
    def idle(self) -> int:
        """Connections kept open for reuse."""
        return len(self._idle)

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> WireResponse:
        """Send ``POST path`` with a JSON body; returns once the response's head has arrived.

        ``headers`` are added to the request's own (``Authorization``, for a server
        that wants a key). The caller must ``close()`` the response (``async with`` does).
        """
        extra = b""
        for name, value in (headers or {}).items():
            if ":" in name or "\r" in name + value or "\n" in name + value:
                raise ValueError(f"header {name!r}: a colon in its name or a line break")
            extra += f"{name}: {value}\r\n".encode("latin-1")
        head = (
            f"POST {self._prefix}{path} HTTP/1.1\r\n".encode()
            + self._host_header
            + b"Content-Type: application/json\r\nAccept: */*\r\n"
            + extra
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        request = head + body
        try:
            if self._slots.locked():  # a free slot is taken at once, without a timer
                async with asyncio.timeout(self.pool_timeout):
                    await self._slots.acquire()
            else:
                await self._slots.acquire()
        except TimeoutError as exc:
            raise BackendConnectionError(
                f"POST {path}: no free connection within {self.pool_timeout}s",
                url=self._url(),
            ) from exc
        try:
            conn = self._take_idle() or await self._connect()
            try:
                return await self._send(conn, request)
            except _NoResponse:
                if not conn.reused:
                    raise
            # A reused connection the server had closed: once more on a new one.
            return await self._send(await self._connect(), request)
        except _NoResponse as exc:
            self._slots.release()
            raise BackendConnectionError(
                f"POST {path} failed: {exc.__cause__!r}", url=self._url()
            ) from exc
        except BaseException:
            self._slots.release()
            raise

    def close(self) -> None:
        """Close the idle connections (responses in flight close theirs when done)."""
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    # -- internals ----------------------------------------------------------------
    def _url(self) -> str:
        return f"{'https' if self._ssl else 'http'}://{self.host}:{self.port}"

    def _take_idle(self) -> Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        return None

    async def _connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Conn(loop), self.host, self.port, ssl=self._ssl
                )
        except (OSError, TimeoutError) as exc:
            raise BackendConnectionError(
                f"cannot connect to {self._url()}: {exc!r}", url=self._url()
            ) from exc
        return conn

    async def _send(self, conn: Conn, request: bytes) -> WireResponse:
        """Write the request and read the response head; ``_NoResponse`` if nothing came."""
        try:
            conn.write(request)
            assert conn.transport is not None
            if conn.transport.get_write_buffer_size():  # the socket did not take it all
                async with asyncio.timeout(self.write_timeout):
                    await conn.drain()
            # A plain timer, not asyncio.timeout (which costs more than the read): when it
            # fires, the waiting read fails with TimeoutError.
            timer = asyncio.get_running_loop().call_later(
                self.read_timeout, conn.fail, TimeoutError()
            )
            try:
                head = await conn.readuntil(b"\r\n\r\n", _MAX_HEAD)
            finally:
                timer.cancel()
        except asyncio.IncompleteReadError as exc:
            conn.close()
            if exc.partial:
                raise BackendConnectionError(
                    "the backend closed the connection inside a response head", url=self._url()
                ) from exc
            raise _NoResponse() from exc
        except TimeoutError as exc:  # before OSError, its base class
            conn.close()
            raise BackendConnectionError(
                f"the backend did not answer within {self.read_timeout}s", url=self._url()
            ) from exc
        except asyncio.LimitOverrunError as exc:
            conn.close()
            raise BackendConnectionError("response head too large", url=self._url()) from exc
        except OSError as exc:
            conn.close()
            raise _NoResponse() from exc
        except BaseException:
            conn.close()
            raise
        return WireResponse(self, conn, head)

    def _release(self, conn: Conn | None) -> None:
        if conn is not None:
            if conn.usable() and len(self._idle) < self.max_idle:
                self._idle.append(conn)
            else:
                conn.close()
        self._slots.release()


class WireResponse:
    """A response whose head has arrived; read its body with ``read`` or ``lines``."""

    def __init__(self, pool: WirePool, conn: Conn, head: bytes):
        self._pool = pool
        self._conn: Conn | None = conn
        self._source = conn  # what the body is read from, also once the response is closed
        self._complete = False
        self._keep_alive = False
        self._waiting_since: float | None = None
        self._watch: asyncio.TimerHandle | None = None
        lines = head[:-4].split(b"\r\n")
        try:
            version, code = lines[0].split(b" ", 2)[:2]
            self.status = int(code)
        except ValueError:
            self.close()
            raise BackendConnectionError(
                f"malformed status line {lines[0][:80]!r}", url=pool._url()
            ) from None
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            self.headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        self._length = int(length) if length is not None and not self._chunked else None
        close = "close" in self.headers.get("connection", "").lower()
        self._keep_alive = version == b"HTTP/1.1" and not close
        if self.status in (204, 304) or self.status < 200:
            self._length = 0

    async def __aenter__(self) -> WireResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Give the connection back when the body was read to its end, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if not (self._complete and self._keep_alive):
            conn.close()
            conn = None
        self._pool._release(conn)

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.pieces()])

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines without their line ends (``\\n`` or ``\\r\\n``), as they arrive."""
        async for batch in self.line_batches():
            for line in batch:
                yield line

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        """The body's lines as they arrive, grouped: each batch holds every line one read completed.

        A consumer that keeps up gets one line per batch; one that falls behind gets
        what piled up meanwhile in one batch, and can handle it in one go.
        """
        rest = b""
        async for piece in self.pieces():
            if rest:
                piece = rest + piece
            *complete, rest = piece.split(b"\n")
            if complete:
                yield [line[:-1] if line.endswith(b"\r") else line for line in complete]
        if rest:
            yield [rest]

    async def data_batches(self) -> AsyncIterator[list[bytes]]:
        """A server-sent event stream's ``data:`` fields as they arrive, grouped: each batch
        holds those of the lines one read completed (other lines are skipped); the
        generator form of ``data_stream``."""
        stream = self.data_stream()
        try:
            while True:
                fields = stream.take()
                if fields:
                    yield fields
                if stream.ended:
                    return
                waiter = stream.waiter()
                if waiter is not None:
                    await waiter
        finally:
            stream.close()

    def data_stream(self) -> DataStream:
        """A server-sent event stream's ``data:`` fields, read by the caller's own loop
        (``DataStream``: no generator between the connection and the reader)."""
        return DataStream(self)

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, framing removed: one piece per read, whatever it completed.

        A chunked body is decoded from whole reads, not one ``readuntil`` and one
        ``readexactly`` per chunk: when the backend's chunks pile up (the proxy is busy),
        one read takes them all and they leave as one piece.
        """
        conn = self._source
        self._watch_reads()
        try:
            while True:
                piece, ended = self._taken(conn.buf)
                if piece:
                    yield piece
                if ended:
                    break
                waiter = self._waiter()
                if waiter is not None:
                    await waiter
        finally:
            self._stop_watch()
        self._complete = True

    def _watch_reads(self) -> None:
        # One watchdog timer per response, not one per read (a timer per chunk costs more
        # than parsing it): it fails the read that has waited longer than the read timeout.
        loop = asyncio.get_running_loop()
        self._watch = loop.call_later(self._pool.read_timeout, self._check_stalled)

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._waiting_since = None

    def _waiter(self) -> asyncio.Future[None] | None:
        """The connection's future for more bytes (None at its end), the wait timed."""
        waiter = self._source.waiter()
        if waiter is not None:
            self._waiting_since = waiter.get_loop().time()
        return waiter

    def _taken(self, buf: bytearray) -> tuple[bytes, bool]:
        """``_take`` of what arrived since the last wait, its failures as
        ``BackendConnectionError``."""
        self._waiting_since = None
        conn = self._source
        try:
            if conn.error is not None:
                raise conn.error
            return self._take(buf, conn.eof)
        except asyncio.IncompleteReadError as exc:
            raise BackendConnectionError(
                "the backend closed the connection mid-response", url=self._pool._url()
            ) from exc
        except TimeoutError as exc:  # before OSError, its base class
            raise BackendConnectionError(
                f"no data from the backend for {self._pool.read_timeout}s", url=self._pool._url()
            ) from exc
        except (OSError, ValueError) as exc:
            raise BackendConnectionError(
                f"the response broke: {exc!r}", url=self._pool._url()
            ) from exc

    def _take(self, buf: bytearray, eof: bool) -> tuple[bytes, bool]:
        """What the buffer holds of the body (taken out of it), and whether the body ended;
        at the end of the stream before the end of the body, what broke it (the transport's
        error, else ``IncompleteReadError``)."""
        if self._chunked:
            payloads, used, ended = dechunk(buf)
            del buf[:used]
            if ended and buf:  # bytes past the end of the response: the stream is broken
                self._keep_alive = False
            if not ended and eof:
                raise asyncio.IncompleteReadError(bytes(buf), None)
            return b"".join(payloads), ended
        if self._length is not None:
            if len(buf) < self._length:
                if eof:
                    raise asyncio.IncompleteReadError(bytes(buf), self._length)
                return b"", False
            piece = bytes(buf[: self._length])
            del buf[: self._length]
            return piece, True
        self._keep_alive = False  # the body ends when the server closes
        piece = bytes(buf)
        buf.clear()
        return piece, eof

    def _check_stalled(self) -> None:
        """The watchdog: fail a read that has waited ``read_timeout``, else look again later."""
        timeout = self._pool.read_timeout
        since = self._waiting_since
        now = asyncio.get_running_loop().time()
        if since is not None and now - since >= timeout:
            self._source.fail(TimeoutError())
            return
        self._watch = asyncio.get_running_loop().call_later(
            timeout if since is None else since + timeout - now, self._check_stalled
        )
