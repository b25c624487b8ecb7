"""Run the engine's HTTP server on a background thread of this process.

For in-process use where a real socket is wanted (the proxy's embedded
backend, live-server tests, benchmarks)::

    with EngineServer(model_dir) as server:
        httpx.post(f"{server.url}/generate", json={...})
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from proxima.proxy.embedded.app import create_engine_app
from proxima.proxy.serving import ThreadedServer

logger = logging.getLogger(__name__)


class EngineServer(ThreadedServer):
    """uvicorn serving :func:`create_engine_app` on a daemon thread.

    ``port=0`` picks a free port; :attr:`url` gives the address once started.
    ``engine_kwargs`` go to :func:`create_engine_app`.
    """

    def __init__(
        self, model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0, **engine_kwargs: Any
    ) -> None:
        super().__init__(
            create_engine_app(model_dir, **engine_kwargs),
            host=host,
            port=port,
            name="proxima-engine-http",
        )
