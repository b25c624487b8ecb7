"""Connections that send nothing, or a request head a byte at a time (slowloris), are closed:
the idle and header deadlines of ``proxima.proxy.serving`` (``--http-idle-timeout``,
``--http-header-timeout``). Before them, uvicorn kept both kinds open for good.

A real uvicorn server on 127.0.0.1 with the configuration ``proxima serve`` uses
(``server_config``), its deadlines shortened to 0.5 s (header) and 1 s (idle) so the test
takes seconds; clients are raw sockets, timed by the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from proxima.proxy.config import Settings, flags_of
from proxima.proxy.serving import ThreadedServer, proxy_config
from starlette.types import Receive, Scope, Send

from proxima.cli import build_parser

HEADER_S = 0.5
IDLE_S = 1
REQUEST = b"GET / HTTP/1.1\r\nHost: proxy\r\nX-Padding: " + b"x" * 40 + b"\r\n\r\n"


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":  # longer than both deadlines
        await asyncio.sleep(IDLE_S * 1.5)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    with ThreadedServer(_app, header_timeout=HEADER_S, idle_timeout=IDLE_S) as served:
        host, port = served.url.removeprefix("http://").split(":")
        yield host, int(port)


def _connect(address: tuple[str, int]) -> socket.socket:
    return socket.create_connection(address, timeout=10)


def _closed_after(
    sock: socket.socket, *, dribble: bytes = b"", every: float = 0.2
) -> tuple[float, bytes]:
    """Seconds until the server closed ``sock`` (sending ``dribble`` a byte every ``every``
    seconds meanwhile), and what it answered; at most 10 s."""
    started = time.monotonic()
    answer = b""
    sent = 0
    while time.monotonic() - started < 10:
        if sent < len(dribble):
            with contextlib.suppress(OSError):  # closed under us: read what came
                sock.sendall(dribble[sent : sent + 1])
            sent += 1
        readable, _, _ = select.select([sock], [], [], every)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return time.monotonic() - started, answer
            answer += chunk
    raise AssertionError(f"still open after 10 s (sent {sent} bytes, answered {answer!r})")


def _served(sock: socket.socket) -> bytes:
    """One response to a request already sent, read to its end (``content-length: 2``)."""
    answer = b""
    while not answer.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(65536)
        assert chunk, f"closed before the response ended: {answer!r}"
        answer += chunk
    return answer


def test_silent_and_dribbling_connections_are_closed(server: tuple[str, int]) -> None:
    results: dict[str, list[tuple[float, bytes]]] = {"silent": [], "dribbling": []}

    errors: list[BaseException] = []

    def client(kind: str) -> None:
        try:
            with _connect(server) as sock:
                dribble = REQUEST if kind == "dribbling" else b""
                results[kind].append(_closed_after(sock, dribble=dribble))
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in ("silent", "dribbling") * 5]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors, errors
    assert len(results["silent"]) == len(results["dribbling"]) == 5
    for seconds, answer in results["silent"]:
        assert IDLE_S * 0.8 <= seconds < IDLE_S + 2, seconds  # the idle deadline
        assert answer == b""
    for seconds, answer in results["dribbling"]:
        # The header deadline, counted from the first byte; the whole head would take 14 s.
        assert HEADER_S * 0.8 <= seconds < HEADER_S + 2, seconds
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer


def test_requests_in_time_are_served_however_long_they_run(server: tuple[str, int]) -> None:
    with _connect(server) as sock:
        # A head in three pieces within the header deadline.
        for piece in (REQUEST[:10], REQUEST[10:30], REQUEST[30:]):
            sock.sendall(piece)
            time.sleep(HEADER_S / 5)
        assert _served(sock).startswith(b"HTTP/1.1 200 OK")
        # A request that runs longer than both deadlines, on the same connection.
        sock.sendall(REQUEST.replace(b"GET / ", b"GET /slow "))
        assert _served(sock).startswith(b"HTTP/1.1 200 OK")
        # Keep-alive: a request sent again within the idle deadline is served.
        time.sleep(IDLE_S / 2)
        sock.sendall(REQUEST)
        assert _served(sock).startswith(b"HTTP/1.1 200 OK")
        # Then silence: closed at the idle deadline.
        seconds, answer = _closed_after(sock)
        assert answer == b"" and IDLE_S * 0.8 <= seconds < IDLE_S + 2


def test_proxima_serve_takes_the_deadlines_from_its_flags(tiny_model_dir: Path) -> None:
    argv = ["serve", "--model", str(tiny_model_dir)]
    args = build_parser().parse_args([*argv, "--http-header-timeout", "2.5"])
    settings = Settings.load(flags_of(args) | {"http_idle_timeout": 9})
    assert (settings.http_header_timeout, settings.http_idle_timeout) == (2.5, 9)
    config: uvicorn.Config = proxy_config(
        _app, header_timeout=settings.http_header_timeout, idle_timeout=settings.http_idle_timeout
    )
    config.load()
    protocol: Any = config.http_protocol_class
    assert protocol.header_timeout == 2.5 and config.timeout_keep_alive == 9
    defaults = Settings.load(flags_of(build_parser().parse_args(argv)))
    assert (defaults.http_header_timeout, defaults.http_idle_timeout) == (20.0, 75)
