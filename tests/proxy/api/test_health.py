"""The health routes: liveness that no dependency fails, readiness that follows the store and
the backends, and ``/health`` that never answers 500 and keeps its details to the admin
token under ``private_observability``.

The routes run in-process on a real store (a SQLite file, or PostgreSQL on a port nothing
listens on: a database that is down); the backend is marked failed as a health check would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from proxima.proxy.api import health
from proxima.proxy.api.error_handlers import install_error_handlers
from proxima.proxy.config import Settings
from proxima.proxy.serving import free_port
from proxima.proxy.state import AppState
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.testing.app_state import install_test_state
from pydantic import SecretStr

ADMIN = {"Authorization": "Bearer admin-token"}
DETAILS = {"store", "version", "adapters", "updating", "backends", "deployments"}

Proxy = Callable[..., AbstractAsyncContextManager[tuple[httpx.AsyncClient, AppState]]]


@pytest.fixture
def proxy(tmp_path: Path, tiny_model_dir: Path) -> Proxy:
    """``proxy(down=..., private=...)``: the health routes on a store that answers, or on
    PostgreSQL that refuses connections (``down``)."""

    @asynccontextmanager
    async def open_proxy(
        *, down: bool = False, private: bool = False
    ) -> AsyncIterator[tuple[httpx.AsyncClient, AppState]]:
        if down:
            url = f"postgresql://postgres@127.0.0.1:{free_port()}/proxima"
            store = await Store.open(url, check_schema=False)
        else:
            url = f"sqlite:///{tmp_path / 'store.db'}"
            await ensure_schema(url)
            store = await Store.open(url)
        app = FastAPI()
        install_error_handlers(app)
        app.include_router(health.router)
        settings = Settings(
            model=tiny_model_dir,
            admin_token=SecretStr("admin-token"),
            private_observability=private,
        )
        state = install_test_state(app, settings=settings, store=store)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                yield client, state
        finally:
            await store.close()

    return open_proxy


async def test_ready_and_live_while_everything_answers(proxy: Proxy) -> None:
    async with proxy() as (client, _):
        live = await client.get("/health/live")
        assert (live.status_code, live.json()) == (200, {"status": "alive"})
        ready = await client.get("/health/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json() == {"status": "ready", "store": "ok", "backends": "ok"}
        answer = await client.get("/health")
        assert answer.status_code == 200 and answer.json()["status"] == "ok"
        assert set(answer.json()) >= DETAILS  # no private observability: open, as /metrics
        assert answer.json()["store"] == "ok" and answer.json()["adapters"] == {}


async def test_no_healthy_backend_is_not_ready_but_alive(proxy: Proxy) -> None:
    async with proxy() as (client, state):
        for backend in state.pool.backends:
            state.pool.mark_failed(backend, ConnectionRefusedError("health check failed"))
        ready = await client.get("/health/ready")
        assert ready.status_code == 503
        assert ready.json() == {"status": "unavailable", "store": "ok", "backends": "unavailable"}
        assert (await client.get("/health/live")).status_code == 200
        answer = await client.get("/health")
        assert answer.status_code == 200 and answer.json()["status"] == "degraded"


async def test_a_store_outage_is_not_ready_alive_and_never_a_500(proxy: Proxy) -> None:
    async with proxy(down=True) as (client, _):
        ready = await client.get("/health/ready")
        assert ready.status_code == 503
        assert ready.json() == {"status": "unavailable", "store": "unavailable", "backends": "ok"}
        assert (await client.get("/health/live")).status_code == 200
        answer = await client.get("/health")
        assert answer.status_code == 200, answer.text  # was a 500: ConnectionRefusedError
        body = answer.json()
        assert body["status"] == "degraded" and body["store"] == "unavailable"
        assert body["adapters"] is None and body["version"] == 0


async def test_private_observability_keeps_the_details_to_the_admin_token(proxy: Proxy) -> None:
    async with proxy(private=True) as (client, state):
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"x-api-key": "nope"}):
            anonymous = await client.get("/health", headers=headers)
            assert anonymous.status_code == 200
            assert anonymous.json() == {"status": "ok"}, headers  # no tenants, URLs, versions
        admin = await client.get("/health", headers=ADMIN)
        assert admin.status_code == 200 and set(admin.json()) >= DETAILS
        assert admin.json()["backends"][0]["url"] == state.pool.backends[0].url
        by_key = await client.get("/health", headers={"x-api-key": "admin-token"})
        assert set(by_key.json()) >= DETAILS
        # The probes say alive and ready, nothing more, to anyone.
        assert (await client.get("/health/ready")).json() == {
            "status": "ready",
            "store": "ok",
            "backends": "ok",
        }
