"""The embedded engine as a child process of ``proxima serve``.

The engine runs in its own process (``python -m proxy.engine``), exactly like a
separate SGLang server: the proxy's event loop never competes with model
compute for the interpreter, and the proxy talks to it over HTTP with the same
client it uses for SGLang.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


class EngineProcess:
    def __init__(self, model: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 max_running_requests: int = 32, weight_version: str = "0"):
        self.model = model
        self.host = host
        self.port = port or free_port(host)
        self.max_running_requests = max_running_requests
        self.weight_version = weight_version
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "proxy.engine",
            "--model", str(self.model), "--host", self.host, "--port", str(self.port),
            "--max-running-requests", str(self.max_running_requests),
            "--weight-version", self.weight_version,
        ]
        logger.info("starting embedded engine: %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    async def wait_healthy(self, timeout: float = 180.0) -> None:
        assert self.proc is not None, "start() first"
        await asyncio.to_thread(
            wait_healthy, self.proc, self.url, timeout=timeout, name="embedded engine"
        )

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
