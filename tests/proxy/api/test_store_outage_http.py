"""A SQLite store locked by another process past its busy timeout, over real HTTP: ``POST
/rl/sessions`` is a 503 with ``Retry-After`` in OpenAI's envelope (was an unhandled 500), and
the client's keep-alive connection stays open (an unhandled 500 made uvicorn close it, so a
pooled client's next request failed with a reset). Sessions open again once the lock is gone.

The RL and health routers run under uvicorn on 127.0.0.1 with the real store and auth; the
lock is a second ``sqlite3`` connection's ``BEGIN IMMEDIATE``, and the busy timeout is
shortened to 0.2 s (30 s in production) so the test takes seconds.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from proxima.proxy.api import health, rl
from proxima.proxy.api.error_handlers import install_error_handlers
from proxima.proxy.config import Settings
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.store import Store, database, ensure_schema
from proxima.proxy.testing.app_state import install_test_state
from pydantic import SecretStr

ADMIN = {"Authorization": "Bearer admin-token"}


def _app(db_url: str, model: Path) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await Store.open(db_url)  # on the server's event loop
        settings = Settings(model=model, admin_token=SecretStr("admin-token"))
        install_test_state(app, settings=settings, store=store)
        yield
        await store.close()

    app = FastAPI(lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(rl.router)
    app.include_router(health.router)
    return app


@pytest.fixture
def served(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, Path]]:
    """The server's URL and its SQLite file."""
    import asyncio

    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 200)
    path = tmp_path / "store.db"
    asyncio.run(ensure_schema(f"sqlite:///{path}"))
    with ThreadedServer(_app(f"sqlite:///{path}", tiny_model_dir)) as server:
        yield server.url, path


def _local_port(response: httpx.Response) -> int:
    """The client side's port of the connection that carried ``response``."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_a_locked_store_is_a_503_with_retry_after_on_a_connection_that_stays_open(
    served: tuple[str, Path],
) -> None:
    url, path = served
    other = sqlite3.connect(path, isolation_level=None)
    with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as client:
        opened = client.post("/rl/sessions", json={})
        assert opened.status_code == 200, opened.text
        port = _local_port(opened)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            refused = client.post("/rl/sessions", json={})
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "2"
            assert refused.headers.get("connection") != "close"
            error = refused.json()["error"]
            assert error["type"] == "service_unavailable" and error["code"] == "store_unavailable"
            assert "locked" in error["message"]
            live = client.get("/health/live")
            assert live.status_code == 200 and _local_port(live) == port  # the same connection
        finally:
            other.execute("ROLLBACK")
            other.close()
        again = client.post("/rl/sessions", json={})
        assert again.status_code == 200, again.text
        assert _local_port(again) == port
        assert again.json()["session_id"] != opened.json()["session_id"]
