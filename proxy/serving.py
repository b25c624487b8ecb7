"""Listening sockets, uvicorn's configuration, and in-process uvicorn servers.

``bind_socket`` creates TCP sockets with ``proto=IPPROTO_TCP``: asyncio sets
``TCP_NODELAY`` only on such sockets, and without it Nagle's algorithm and
delayed ACKs add ~40 ms to responses written in more than one piece.

``server_config`` is uvicorn's configuration for every server here (``proxima serve``'s
through ``proxy_config``), with two deadlines on a connection that is not running a
request, which uvicorn alone does not have (it closes a connection idle after a response,
but never one that sent nothing, nor one that sends a request head a byte at a time):

- idle (``idle_timeout``, uvicorn's keep-alive timeout): a connection that sends nothing
  for that long, from its opening or from its last response, is closed;
- header (``header_timeout``): a request head (request line and headers) must be complete
  within that long of its first byte; else the connection is answered 408 and closed, so a
  client that dribbles headers (slowloris) holds a connection for that long at most.

A request whose head is complete runs as long as it takes (generations, event streams);
its body is read by the app.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import uvicorn
from proxima.proxy.logs import BODY_SEND
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 20.0
"""Default: seconds from a request head's first byte until it must be complete."""

IDLE_TIMEOUT_S = 75
"""Default: seconds a connection may stay silent outside a request. Above the 5 s idle expiry
of httpx and the OpenAI SDK's pools: otherwise a client may reuse a connection the server is
closing, and see a connection error under load."""

_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 39\r\nconnection: close\r\n\r\n"
    b"The request head took too long to send."
)


@dataclass(frozen=True, slots=True)
class Worker:
    """This process's place among the workers of ``proxima serve --workers N``."""

    index: int  # 0 .. workers - 1
    workers: int


_worker: Worker | None = None


def set_worker(worker: Worker) -> None:
    """Say which worker this process is (``proxima serve --workers``, at its start)."""
    global _worker
    _worker = worker


def this_worker() -> Worker | None:
    """This process's worker (None: a ``proxima serve`` of one process)."""
    return _worker


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class _HeadDeadlines:
    """Mixed into uvicorn's HTTP protocols: the idle and header deadlines (module docstring).

    A deadline runs only while the connection waits for a request head: from the opening,
    and from the end of each response; the head's first byte swaps the idle deadline for
    the header one, and the head's end (uvicorn starts a request cycle) stops it.
    """

    header_timeout: float = HEADER_TIMEOUT_S
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    timeout_keep_alive: int
    cycle: Any
    _deadline: asyncio.TimerHandle | None
    _waiting: bool  # for a request head: no request runs
    _head_started: bool  # a byte of that head came

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._deadline = None
        self._wait_for_head()

    def data_received(self, data: bytes) -> None:
        if self._waiting and not self._head_started and data:
            self._head_started = True
            self._arm(self.header_timeout, self._head_too_slow)
        before = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not before:  # a request head is complete: its request runs
            self._waiting = False
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._wait_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _wait_for_head(self) -> None:
        self._waiting = True
        self._head_started = False
        self._arm(self.timeout_keep_alive, self._idle)

    def _arm(self, seconds: float, then: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _idle(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _head_too_slow(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(_TIMED_OUT)
            self.transport.close()


class _GuardedHttpTools(_HeadDeadlines, HttpToolsProtocol):
    pass


class _GuardedH11(_HeadDeadlines, H11Protocol):
    pass


def guarded_protocol(
    header_timeout: float = HEADER_TIMEOUT_S, *, parser: str = "httptools"
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``parser``: httptools, as uvicorn's "auto" picks it, or
    h11) with the idle and header deadlines; ``header_timeout`` in seconds."""
    base = _GuardedHttpTools if parser == "httptools" else _GuardedH11
    return type(f"Guarded{base.__name__}", (base,), {"header_timeout": header_timeout})


class _ServerSend:
    """Puts the server's own ``send`` in an HTTP request's scope (``BODY_SEND``): an event
    stream writes its body with it, past every middleware (they act on a response's start,
    which still goes through them all)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[BODY_SEND] = send
        try:
            await self.app(scope, receive, send)
        finally:
            # ``send`` is bound to uvicorn's request cycle, which holds the scope: left in
            # it, the three make a reference cycle that only the garbage collector frees.
            # Every request's objects would then wait for a collection, and survive into
            # the older generations whose passes cost the most.
            del scope[BODY_SEND]


def server_config(
    app: Any,
    *,
    header_timeout: float = HEADER_TIMEOUT_S,
    idle_timeout: int = IDLE_TIMEOUT_S,
    parser: str = "httptools",
    **kwargs: Any,
) -> uvicorn.Config:
    """uvicorn's configuration of ``app`` with the idle and header deadlines (module
    docstring); ``kwargs`` go to ``uvicorn.Config``."""
    return uvicorn.Config(
        _ServerSend(app),
        http=guarded_protocol(header_timeout, parser=parser),
        timeout_keep_alive=idle_timeout,
        **kwargs,
    )


def proxy_config(app: Any, *, header_timeout: float, idle_timeout: int) -> uvicorn.Config:
    """``proxima serve``'s uvicorn configuration: the deadlines of ``--http-header-timeout``
    and ``--http-idle-timeout``; no uvicorn log config (the structured handler stays) and
    no uvicorn access log (the proxy writes its own)."""
    return server_config(
        app,
        header_timeout=header_timeout,
        idle_timeout=idle_timeout,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=30,
    )


class ThreadedServer:
    """uvicorn serving an ASGI app on a daemon thread (``port=0``: any free port);
    ``config``: more of ``server_config``'s arguments (``header_timeout``, ...)."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "proxima-http",
        **config: Any,
    ):
        self._socket = bind_socket(host, port)
        bound_host, bound_port = self._socket.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        config.setdefault("log_level", "warning")
        self._server = uvicorn.Server(server_config(app, lifespan="on", **config))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name=name, daemon=True
        )

    def start(self, timeout: float = 120.0) -> str:
        """Start serving; returns :attr:`url` once the app has started and the socket listens."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server exited during start-up (see the log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout:.0f}s")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ThreadedServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(
    proc: subprocess.Popen[bytes], url: str, *, timeout: float, name: str, log: Path | None = None
) -> None:
    """Wait until ``url``/health answers 200; raise if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; log: {log}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} not healthy on {url} after {timeout:.0f}s; log: {log}")
