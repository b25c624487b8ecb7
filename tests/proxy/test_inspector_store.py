"""The inspector's pages over HTTP on a store of 10,000 sessions written straight into SQLite.

The ``/ui`` router runs in-process with the real sign-in, the real store and the tiny model's
tokenizer. What is asserted is behaviour (who gets in, which rows in which order, how many SQL
statements a page costs); how fast the pages answer on 100k sessions is ``bench/inspector.py``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from proxima.proxy.api.error_handlers import install_error_handlers
from proxima.proxy.config import Settings
from proxima.proxy.inspector.auth import COOKIE, cookie_value
from proxima.proxy.inspector.queries import parse_filter
from proxima.proxy.inspector.routes import router
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.store.models import CompletionRow
from proxima.proxy.testing.app_state import install_test_state
from proxima.proxy.testing.inspector_store import fill_store
from pydantic import SecretStr
from sqlalchemy import event, select

from tests.proxy.store.test_inspector_queries import everything, expected

TOKEN = "inspector-admin-token"
SESSIONS = 10_000
ROW = re.compile(r'<tr data-id="([^"]+)">')


@pytest.fixture(scope="module")
def store_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite store of ``SESSIONS`` sessions (one turn each), built once for the module."""
    url = f"sqlite:///{tmp_path_factory.mktemp('inspector') / 'store.db'}"

    async def build() -> None:
        await ensure_schema(url)
        store = await Store.open(url)
        try:
            await fill_store(store.engine, SESSIONS, turns=1, batch=256)
        finally:
            await store.close()

    asyncio.run(build())
    return url


class Statements:
    """The SQL statements the store's engine runs, as they run."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, conn: object, cursor: object, statement: str, *args: object) -> None:
        if not statement.lstrip().upper().startswith(("BEGIN", "COMMIT", "ROLLBACK", "PRAGMA")):
            self.seen.append(statement)  # a query, not the transaction around it

    def reading(self, table: str) -> list[str]:
        return [s for s in self.seen if f"FROM {table}" in s]


@pytest.fixture
async def ui(
    store_file: str, tiny_model_dir: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Store, Statements]]:
    store = await Store.open(store_file)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    settings = Settings(model=tiny_model_dir, admin_token=SecretStr(TOKEN))
    install_test_state(app, settings=settings, store=store)
    statements = Statements()
    event.listen(store.engine.sync_engine, "before_cursor_execute", statements)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")
    try:
        yield client, store, statements
    finally:
        await client.aclose()
        await store.close()


@pytest.fixture
def signed_in(
    ui: tuple[httpx.AsyncClient, Store, Statements],
) -> Iterator[tuple[httpx.AsyncClient, Store, Statements]]:
    client, store, statements = ui
    client.headers["cookie"] = f"{COOKIE}={cookie_value(TOKEN)}"  # what the browser sends back
    yield client, store, statements


async def test_only_the_admin_token_opens_the_pages(
    ui: tuple[httpx.AsyncClient, Store, Statements],
) -> None:
    client, _, _ = ui
    for path in ("/ui", "/ui/sessions?status=open", "/ui/sessions/s00000001", "/ui/run"):
        resp = await client.get(path)
        assert resp.status_code == 303, path
        assert resp.headers["location"].startswith("/ui/login?next=%2Fui")
    assert (await client.get("/ui/sessions?token=wrong")).status_code == 401
    assert "That is not the admin token" in (await client.get("/ui/login?token=no")).text
    bad = await client.post("/ui/login", content="token=nope&next=%2Fui%2Frun")
    assert bad.status_code == 401 and COOKIE not in bad.headers.get("set-cookie", "")

    # The token as a query parameter: a redirect to the same page without it, and the cookie.
    resp = await client.get(f"/ui/sessions?status=open&token={TOKEN}")
    assert resp.status_code == 303 and resp.headers["location"] == "/ui/sessions?status=open"
    cookie = resp.headers["set-cookie"]
    assert f"{COOKIE}={cookie_value(TOKEN)}" in cookie and TOKEN not in cookie
    for attribute in ("HttpOnly", "SameSite=strict", "Path=/ui"):
        assert attribute in cookie
    client.cookies.clear()  # from here on, each request says itself what it sends
    cookies = {"cookie": f"{COOKIE}={cookie_value(TOKEN)}"}
    opened = await client.get("/ui/sessions?status=open", headers=cookies)
    assert opened.status_code == 200 and '<table id="sessions">' in opened.text
    # Nothing but the page's own inline style and its one script (by nonce) may run or load.
    policy = opened.headers["content-security-policy"]
    nonce = re.search(r"'nonce-([^']+)'", policy)
    assert nonce and f'<script nonce="{nonce.group(1)}">' in opened.text
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    assert opened.headers["cache-control"] == "no-store"

    # The form: back to ``next`` when it is an inspector page, else to the sessions.
    good = await client.post("/ui/login", content=f"token={TOKEN}&next=%2Fui%2Frun")
    assert good.status_code == 303 and good.headers["location"] == "/ui/run"
    elsewhere = await client.post("/ui/login", content=f"token={TOKEN}&next=%2F%2Fevil.example")
    assert elsewhere.headers["location"] == "/ui/sessions"
    client.cookies.clear()
    assert (await client.get("/ui/run", headers={"cookie": f"{COOKIE}=forged"})).status_code == 303

    # A bearer header is checked as the /admin routes check it.
    bearer = await client.get("/ui/run", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bearer.status_code == 200
    other = await client.get("/ui/run", headers={"Authorization": "Bearer sk-proxima-s-unknown"})
    assert other.status_code == 303
    out = await client.post("/ui/logout")
    assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]


async def test_without_an_admin_token_the_inspector_is_closed(
    store_file: str, tiny_model_dir: Path
) -> None:
    store = await Store.open(store_file)
    try:
        app = FastAPI()
        app.include_router(router)
        install_test_state(app, settings=Settings(model=tiny_model_dir), store=store)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy"
        ) as client:
            form = await client.get("/ui/login")
            assert form.status_code == 403 and "no admin token" in form.text
            assert (await client.post("/ui/login", content="token=x")).status_code == 403
            assert (await client.get("/ui/run?token=x")).status_code == 403
    finally:
        await store.close()


async def test_the_list_is_one_statement_a_page_in_order(
    signed_in: tuple[httpx.AsyncClient, Store, Statements],
) -> None:
    client, store, statements = signed_in
    rows, timeline = await everything(store.engine)
    newest = expected(rows, timeline, parse_filter({}))
    url: str | None = "/ui/sessions"
    shown: list[str] = []
    for _ in range(3):
        assert url is not None
        statements.seen.clear()
        resp = await client.get(url)
        assert resp.status_code == 200, resp.text
        assert len(statements.seen) == 1  # the page: one statement, no query per row
        ids = ROW.findall(resp.text)
        assert len(ids) == 50
        shown += ids
        found = re.search(r'<a href="([^"]+)" id="next">', resp.text)
        url = found.group(1).replace("&amp;", "&") if found else None
    assert shown == newest[:150]  # newest first, pages continue without a gap or a repeat


@pytest.mark.parametrize(
    "params",
    [
        {"status": "failed", "run": "run1", "limit": "200"},
        {"reward_min": "1", "sort": "reward", "adapter": "tenant-a", "limit": "100"},
        {"version": "7", "sort": "old", "limit": "200"},
        {"group": "item1234@run0"},
        {"since": "2026-01-01T01:00:00", "until": "2026-01-01T01:02:00", "limit": "200"},
    ],
    ids=["status+run", "reward+adapter", "version", "group", "time"],
)
async def test_filters_select_the_matching_sessions(
    signed_in: tuple[httpx.AsyncClient, Store, Statements], params: dict[str, str]
) -> None:
    client, store, statements = signed_in
    rows, timeline = await everything(store.engine)
    want = expected(rows, timeline, parse_filter(params))
    statements.seen.clear()
    resp = await client.get("/ui/sessions", params=params)
    assert resp.status_code == 200
    assert len(statements.seen) == 1
    assert ROW.findall(resp.text) == want[: int(params.get("limit", 50))]
    assert want  # each of these selects something


async def test_a_bad_filter_is_a_400_page_naming_the_field(
    signed_in: tuple[httpx.AsyncClient, Store, Statements],
) -> None:
    client, _, _ = signed_in
    for query, field in [
        ("reward_min=lots", "reward_min"),
        ("version=-2", "version"),
        ("sort=sideways", "sort"),
        ("since=tomorrow", "since"),
        ("after=%00", "after"),
        ("adapter=..", "adapter"),
    ]:
        resp = await client.get(f"/ui/sessions?{query}")
        assert resp.status_code == 400, query
        assert resp.headers["content-type"].startswith("text/html")
        assert f'<p class="error" id="filter-error">{field}:' in resp.text
    assert (await client.get("/ui/run?adapter=..")).status_code == 400


async def test_a_session_page_reads_its_completions_once(
    signed_in: tuple[httpx.AsyncClient, Store, Statements],
) -> None:
    client, store, statements = signed_in
    async with store.engine.connect() as conn:
        found = await conn.execute(select(CompletionRow.session_id, CompletionRow.output_versions))
        interrupted = next(
            sid for sid, packed in found if len(set(np.frombuffer(packed, "<i4").tolist())) > 1
        )
    statements.seen.clear()
    resp = await client.get(f"/ui/sessions/{interrupted}")
    assert resp.status_code == 200
    assert len(statements.reading("completions")) == 1
    assert len(statements.seen) <= 3  # the session, its completions, its group's rewards
    assert 'class="vchg"' in resp.text and "interrupted: version" in resp.text
    assert resp.text.count('class="t o"') == 16  # every generated token, with its data
    missing = await client.get("/ui/sessions/no-such-session")
    assert missing.status_code == 404 and "No session" in missing.text
    assert (await client.get("/ui/sessions/" + "x" * 300)).status_code == 404


async def test_the_run_page_costs_a_fixed_number_of_statements(
    signed_in: tuple[httpx.AsyncClient, Store, Statements],
) -> None:
    client, _, statements = signed_in
    for query in ("", "?run=run0", "?adapter=tenant-a"):
        statements.seen.clear()
        resp = await client.get(f"/ui/run{query}")
        assert resp.status_code == 200
        assert resp.text.count("<svg") == 6
        assert '<table id="production">' in resp.text and '<table id="versions">' in resp.text
        assert len(statements.seen) < 16  # aggregates, whatever the number of sessions
