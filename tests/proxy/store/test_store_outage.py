"""A database that does not answer is ``StoreUnavailable`` (a retryable 503), never a raw driver
error (an unhandled 500): PostgreSQL refusing connections or terminating them, a SQLite file
locked by another process past the busy timeout. Errors that are not outages stay what they
were (a conflict, a missing table).

Real databases throughout: a port nothing listens on, the test cluster's
``pg_terminate_backend``, a second SQLite connection holding the write lock.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from proxima.proxy.errors import KINDS, kind_of
from proxima.proxy.serving import free_port
from proxima.proxy.store import Store, database, ensure_schema
from proxima.proxy.store.errors import Conflict, StoreUnavailable, is_outage
from sqlalchemy.exc import IntegrityError

from tests.pg import PostgresCluster, create_test_database
from tests.proxy.store.factories import completion, key_hash


@pytest.fixture
def short_busy_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite's busy timeout at 0.2 s (30 s in production), read by every new connection."""
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 200)


@pytest.fixture
async def locked_sqlite(
    tmp_path: Path, short_busy_timeout: None
) -> AsyncIterator[tuple[str, sqlite3.Connection]]:
    """A migrated SQLite file and another connection (another process's, as far as SQLite
    knows) that can hold its write lock."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    other = sqlite3.connect(tmp_path / "store.db", isolation_level=None)
    try:
        yield url, other
    finally:
        other.close()


def test_the_outage_has_a_503_row_with_retry_after() -> None:
    exc = StoreUnavailable()
    assert KINDS[StoreUnavailable].status == 503 and exc.status_code == 503
    assert kind_of(exc).code == "store_unavailable" and exc.error_type == "service_unavailable"
    assert exc.headers() == {"Retry-After": "2"}
    assert not kind_of(exc).internal  # the client is told to retry, in plain words


async def test_sqlite_locked_past_the_busy_timeout_is_unavailable_then_recovers(
    locked_sqlite: tuple[str, sqlite3.Connection],
) -> None:
    url, other = locked_sqlite
    store = await Store.open(url)
    try:
        session = await store.create_session(api_key_hash=key_hash())
        other.execute("BEGIN IMMEDIATE")  # the write lock, held
        with pytest.raises(StoreUnavailable) as raised:
            await store.create_session(api_key_hash=key_hash())
        assert "locked" in str(raised.value.__cause__)
        # The completion insert goes to the driver directly (DirectSqlite): the same answer.
        with pytest.raises(StoreUnavailable):
            await store.record_completions(completions=[completion(session.id)])
        # A WAL reader does not wait for the writer: reads still answer.
        assert (await store.get_session(session_id=session.id)) is not None
        await store.ping()
        other.execute("COMMIT")
        await store.record_completions(completions=[completion(session.id)])
        assert len(await store.list_completions(session_id=session.id)) == 1
    finally:
        await store.close()


async def test_postgres_refusing_connections_is_unavailable() -> None:
    # Nothing listens on the port: asyncpg raises a bare ConnectionRefusedError.
    store = await Store.open(
        f"postgresql://postgres@127.0.0.1:{free_port()}/proxima", check_schema=False
    )
    try:
        with pytest.raises(StoreUnavailable) as raised:
            await store.create_session(api_key_hash=key_hash())
        assert isinstance(raised.value.__cause__, ConnectionRefusedError)
        for read in (store.ping(), store.get_session(session_id="s"), store.adapter_heads()):
            with pytest.raises(StoreUnavailable):
                await read
        with pytest.raises(StoreUnavailable):
            async with store.publish_lock():
                raise AssertionError("the lock was not taken")
    finally:
        await store.close()


@pytest.mark.parametrize("backend", ["postgres"])
async def test_postgres_terminating_connections_is_unavailable_once(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The server drops the pooled connections (a restart, a failover): the next statement is
    a 503, and the one after reconnects."""
    url = create_test_database(request)
    cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
    await ensure_schema(url)
    store = await Store.open(url)
    try:
        await store.create_session(api_key_hash=key_hash())  # a pooled connection now
        database_name = url.rsplit("/", 1)[1]
        cluster.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{database_name}' AND pid <> pg_backend_pid()"
        )
        with pytest.raises(StoreUnavailable):
            await store.create_session(api_key_hash=key_hash())
        session = await store.create_session(api_key_hash=key_hash())
        assert await store.get_session(session_id=session.id) == session
    finally:
        await store.close()


async def test_errors_that_are_not_outages_stay_what_they_are(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    store = await Store.open(url)
    try:
        taken = key_hash()
        await store.create_session(api_key_hash=taken)
        with pytest.raises(Conflict) as raised:
            await store.create_session(api_key_hash=taken)
        assert isinstance(raised.value.__cause__, IntegrityError)
        assert not is_outage(raised.value) and not is_outage(raised.value.__cause__)
    finally:
        await store.close()
    missing = sqlite3.connect(":memory:")
    with pytest.raises(sqlite3.OperationalError) as no_table:
        missing.execute("SELECT * FROM sessions")
    assert not is_outage(no_table.value)  # a bug, not an outage
    assert is_outage(ConnectionResetError(104, "Connection reset by peer"))
