"""The admin routes in-process, for the weight-push tests: a real store and the real pool.

``admin_app`` opens a fresh SQLite store under ``tmp_path`` (of ``store_type``, a ``Store`` or
a subclass that injects a fault), mounts ``backend`` (an ASGI app: the fake SGLang app, bare or
wrapped to record or delay what it is sent) at ``backend_url`` as the pool's only backend, and
serves ``routers`` (``/admin`` by default) with the admin principal already granted. It yields
a client of that app and the store, and closes the client, the backend's client and the store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import APIRouter, FastAPI
from proxima.proxy.api import admin
from proxima.proxy.api.deps import get_admin
from proxima.proxy.api.error_handlers import install_error_handlers
from proxima.proxy.auth import Principal, PrincipalKind
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.config import Settings
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.testing.app_state import install_test_state
from starlette.types import ASGIApp


@asynccontextmanager
async def admin_app(
    tmp_path: Path,
    model_dir: Path,
    backend: ASGIApp,
    *,
    backend_url: str,
    store_type: type[Store] = Store,
    routers: Sequence[APIRouter] = (admin.router,),
) -> AsyncIterator[tuple[httpx.AsyncClient, Store]]:
    """A client of the routes on a fresh store (see the module docstring), and that store."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    store = await store_type.open(url)
    http = httpx.AsyncClient(mounts={backend_url: httpx.ASGITransport(app=backend)})
    app = FastAPI()
    install_error_handlers(app)
    for router in routers:
        app.include_router(router)
    pool = BackendPool([backend_url], http=http)
    install_test_state(app, settings=Settings(model=model_dir), store=store, pool=pool)
    app.dependency_overrides[get_admin] = lambda: Principal(PrincipalKind.ADMIN)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")
    try:
        yield client, store
    finally:
        await client.aclose()
        await http.aclose()
        await store.close()
