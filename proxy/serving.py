"""Listening sockets and in-process uvicorn servers.

``bind_socket`` creates TCP sockets with ``proto=IPPROTO_TCP``: asyncio sets
``TCP_NODELAY`` only on such sockets, and without it Nagle's algorithm and
delayed ACKs add ~40 ms to responses written in more than one piece.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import uvicorn


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class ThreadedServer:
    """uvicorn serving an ASGI app on a daemon thread (``port=0``: any free port)."""

    def __init__(
        self, app: Any, *, host: str = "127.0.0.1", port: int = 0, name: str = "proxima-http"
    ):
        self._socket = bind_socket(host, port)
        bound_host, bound_port = self._socket.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
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
