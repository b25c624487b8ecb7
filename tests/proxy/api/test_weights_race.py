"""Concurrent ``POST /admin/weights``: one critical section from check to record.

The route runs in-process on the real pool and a real store; the backend is
the fake SGLang app behind a delay on ``/update_weights_from_disk``, as real
SGLang takes seconds to load weights. That delay is the window in which two
pushes used to both pass the "newer than current" check and both load.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from proxima.proxy.api import admin, health
from proxima.proxy.store import Store
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from starlette.types import Receive, Scope, Send

from tests.proxy.api.admin_app import admin_app

LOAD_SECONDS = 0.3
BACKEND = "http://slow-sglang"


class SlowLoads:
    """ASGI wrapper: weight loads take ``LOAD_SECONDS``; remembers the paths loaded, in order."""

    def __init__(self, app: FastAPI):
        self.app = app
        self.loaded: list[str] = []
        self.loads_started = 0
        self.load_started = asyncio.Condition()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/update_weights_from_disk":
            await self.app(scope, receive, send)
            return
        message = await receive()
        body = message.get("body", b"")
        async with self.load_started:
            self.loads_started += 1
            self.load_started.notify_all()
        await asyncio.sleep(LOAD_SECONDS)
        self.loaded.append(json.loads(body)["model_path"])

        async def replay() -> dict[str, object]:
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@pytest.fixture
async def setup(
    tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, SlowLoads, Store]]:
    backend = SlowLoads(create_fake_app(FakeBackend()))
    routers = (admin.router, health.router)
    async with admin_app(
        tmp_path, tiny_model_dir, backend, backend_url=BACKEND, routers=routers
    ) as (client, store):
        yield client, backend, store


async def _push_together(
    client: httpx.AsyncClient, backend: SlowLoads, pushes: list[dict[str, object]]
) -> list[httpx.Response]:
    """Push ``i`` starts once the backend has begun its ``i``-th load: inside the window of
    the load before it (a fixed delay was not enough on a loaded machine, where the second
    push could reach the route before the first)."""

    async def push(i: int, body: dict[str, object]) -> httpx.Response:
        async with backend.load_started:
            await asyncio.wait_for(
                backend.load_started.wait_for(lambda: backend.loads_started >= i), timeout=30
            )
        return await client.post("/admin/weights", json=body)

    return list(await asyncio.gather(*(push(i, b) for i, b in enumerate(pushes))))


async def _state(client: httpx.AsyncClient, store: Store) -> tuple[int, list[int | None], list]:
    health = (await client.get("/health")).json()
    versions = [(v.version, v.path) for v in await store.list_policy_versions()]
    return health["version"], [b["version"] for b in health["backends"]], versions


async def test_an_older_version_pushed_during_a_load_is_refused(
    setup: tuple[httpx.AsyncClient, SlowLoads, Store],
) -> None:
    client, backend, store = setup
    newer, older = await _push_together(
        client, backend, [{"version": 10, "path": "/w/ten"}, {"version": 5, "path": "/w/five"}]
    )
    assert newer.status_code == 200, newer.text
    assert older.status_code == 409, older.text
    assert older.json()["error"]["code"] == "version_not_newer"
    assert await _state(client, store) == (10, [10], [(10, "/w/ten")])
    assert backend.loaded == ["/w/ten"]  # v5 never reached the backend


async def test_one_version_number_names_one_set_of_weights(
    setup: tuple[httpx.AsyncClient, SlowLoads, Store],
) -> None:
    client, backend, store = setup
    first, second = await _push_together(
        client, backend, [{"version": 3, "path": "/w/a"}, {"version": 3, "path": "/w/b"}]
    )
    assert first.status_code == 200, first.text
    assert second.status_code == 409, second.text
    assert second.json()["error"]["param"] == "version"
    assert await _state(client, store) == (3, [3], [(3, "/w/a")])
    assert backend.loaded == ["/w/a"]


async def test_pushes_in_order_all_load(
    setup: tuple[httpx.AsyncClient, SlowLoads, Store],
) -> None:
    client, backend, store = setup
    answers = await _push_together(
        client, backend, [{"version": v, "path": f"/w/{v}"} for v in (1, 2, 3)]
    )
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert await _state(client, store) == (3, [3], [(1, "/w/1"), (2, "/w/2"), (3, "/w/3")])
    assert backend.loaded == ["/w/1", "/w/2", "/w/3"]
