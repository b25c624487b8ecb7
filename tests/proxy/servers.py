"""ASGI apps served on real loopback sockets, for tests of the backend client.

The generation client speaks HTTP/1.1 over its own sockets, so backends in
tests are real servers (uvicorn on 127.0.0.1), never in-process transports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from typing import Any

import httpx
from proxima.proxy.serving import ThreadedServer


@asynccontextmanager
async def served(apps: dict[str, Any]) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    """Serve each app; yields an admin client and each name's base URL."""
    with ExitStack() as stack:
        urls = {name: stack.enter_context(ThreadedServer(app)).url for name, app in apps.items()}
        async with httpx.AsyncClient() as http:
            yield http, urls
