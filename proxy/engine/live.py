"""Run the engine's HTTP server on a background thread of this process.

For in-process use where a real socket is wanted (the proxy's embedded
backend, live-server tests, benchmarks)::

    with EngineServer(model_dir) as server:
        httpx.post(f"{server.url}/generate", json={...})
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import uvicorn

from proxy.engine.app import create_engine_app

logger = logging.getLogger(__name__)


class EngineServer:
    """uvicorn serving :func:`create_engine_app` on a daemon thread.

    ``port=0`` picks a free port; :attr:`url` gives the address once started.
    ``engine_kwargs`` go to :func:`create_engine_app`.
    """

    def __init__(
        self, model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0, **engine_kwargs: Any
    ) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        bound_host, bound_port = self._socket.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        app = create_engine_app(model_dir, **engine_kwargs)
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="proxima-engine-http",
            daemon=True,
        )

    def start(self, timeout: float = 120.0) -> str:
        """Start serving; returns :attr:`url` once the model is loaded and the socket listens."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the engine server exited during start-up (see the log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine server did not start within {timeout:.0f}s")
            time.sleep(0.02)
        logger.info("engine serving at %s", self.url)
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        """Shut the server down (the lifespan stops the worker) and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> EngineServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
