"""``POST /rl/sessions`` with an ``Idempotency-Key``: the route on a real store (SQLite).

The RL router runs in-process with the real auth dependencies, the real store and
staleness admission; nothing generates (the store records a completion directly
where one is needed). The store's side, on PostgreSQL too, is
``tests/proxy/store/test_store_idempotent_admission.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from proxima.proxy.api import rl
from proxima.proxy.api.error_handlers import install_error_handlers
from proxima.proxy.config import Settings
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.testing.app_state import install_test_state
from pydantic import SecretStr

from tests.proxy.store.factories import completion

ADMIN = {"Authorization": "Bearer admin-token"}


@pytest.fixture
async def proxy(
    tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Store]]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    store = await Store.open(url)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(rl.router)
    # B = 1, eta = 0: one admitted session uses up the capacity of version 0.
    settings = Settings(
        model=tiny_model_dir,
        admin_token=SecretStr("admin-token"),
        max_staleness=0,
        train_batch_size=1,
    )
    install_test_state(app, settings=settings, store=store)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")
    try:
        yield client, store
    finally:
        await client.aclose()
        await store.close()


async def _create(client: httpx.AsyncClient, key: str | None, **body: Any) -> httpx.Response:
    headers = dict(ADMIN) if key is None else {**ADMIN, "Idempotency-Key": key}
    return await client.post("/rl/sessions", json=body, headers=headers)


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_a_repeat_answers_the_same_session_with_a_new_key(
    proxy: tuple[httpx.AsyncClient, Store],
) -> None:
    client, store = proxy
    first = await _create(client, "run-7/sample-0", group_id="g", data_id="d")
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers
    # The answer was lost; the repeat gets the session although the capacity is used up.
    again = await _create(client, "run-7/sample-0", group_id="g", data_id="d")
    assert again.status_code == 200, again.text
    assert again.headers["idempotent-replayed"] == "true"
    opened, repeated = first.json(), again.json()
    assert repeated["session_id"] == opened["session_id"]
    assert repeated["api_key"] != opened["api_key"]
    assert repeated["base_url"] == opened["base_url"]
    assert (await store.admission_state()).admitted == 1  # counted once
    assert await store.count_sessions() == 1
    # The session answers to its new key only (the old one was never delivered).
    url = f"/rl/sessions/{opened['session_id']}"
    old = await client.get(url, headers={"Authorization": f"Bearer {opened['api_key']}"})
    assert _error(old, 401)["type"] == "authentication_error"
    new = await client.get(url, headers={"Authorization": f"Bearer {repeated['api_key']}"})
    assert new.status_code == 200 and new.json()["status"] == "open"
    # A new key (or none) is a new session, and goes through admission: full, a 429.
    full = await _create(client, "run-7/sample-1", group_id="other")
    assert _error(full, 429)["code"] == "staleness_capacity"
    assert _error(await _create(client, None), 429)["code"] == "staleness_capacity"


async def test_a_repeat_after_the_session_was_used_is_a_409(
    proxy: tuple[httpx.AsyncClient, Store],
) -> None:
    client, store = proxy
    opened = (await _create(client, "used")).json()
    await store.record_completions(completions=[completion(opened["session_id"])])
    error = _error(await _create(client, "used"), 409)
    assert error["code"] == "idempotency_key_reused" and error["param"] == "idempotency-key"
    assert opened["session_id"] in error["message"] and "new key" in error["message"]
    # The key it has keeps working: the 409 issued nothing.
    auth = {"Authorization": f"Bearer {opened['api_key']}"}
    finished = await client.post(f"/rl/sessions/{opened['session_id']}/finish", headers=auth)
    assert finished.status_code == 200, finished.text
    assert _error(await _create(client, "used"), 409)["code"] == "idempotency_key_reused"
    other_body = _error(await _create(client, "used", group_id="g2"), 409)
    assert "another body" in other_body["message"]


@pytest.mark.parametrize("key", ["", "k" * 201])
async def test_a_bad_key_is_a_400(proxy: tuple[httpx.AsyncClient, Store], key: str) -> None:
    client, store = proxy
    error = _error(await _create(client, key), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == "idempotency-key"
    assert "1 to 200 characters" in error["message"]
    assert await store.count_sessions() == 0
    assert (await _create(client, "k" * 200)).status_code == 200  # the longest key is fine


async def test_a_key_with_nul_is_a_400(proxy: tuple[httpx.AsyncClient, Store]) -> None:
    client, store = proxy
    # uvicorn's HTTP parsers refuse NUL in a header first; the route does not rely on them.
    error = _error(await _create(client, "a\x00b"), 400)
    assert error["param"] == "idempotency-key" and "NUL" in error["message"]
    assert await store.count_sessions() == 0
