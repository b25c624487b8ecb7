"""SQLite's completion writer thread: it queues behind other writers and stops with the store."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest
from proxima.proxy.store import Conflict, Store, ensure_schema

from tests.proxy.store.factories import completion, key_hash


@pytest.fixture
async def sqlite_store(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    store = await Store.open(url)
    yield store, tmp_path / "store.db"
    await store.close()


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sqlite-writer")]


async def test_record_waits_for_another_writer_then_commits(sqlite_store) -> None:
    store, path = sqlite_store
    session = await store.create_session(api_key_hash=key_hash())
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    record = asyncio.create_task(store.record_completion(completion=completion(session.id)))
    await asyncio.sleep(0.3)
    assert not record.done()  # queued on the busy timeout, not failed
    other.execute("COMMIT")
    other.close()
    await asyncio.wait_for(record, 30)
    assert len(await store.list_completions(session_id=session.id)) == 1
    # Committed: a fresh connection (another process) sees the row.
    fresh = sqlite3.connect(path)
    assert fresh.execute("select count(*) from completions").fetchone()[0] == 1
    fresh.close()


async def test_failed_batch_leaves_nothing_and_the_writer_goes_on(sqlite_store) -> None:
    store, _ = sqlite_store
    session = await store.create_session(api_key_hash=key_hash())
    first = completion(session.id)
    await store.record_completion(completion=first)
    with pytest.raises(Conflict):
        await store.record_completions(completions=[completion(session.id), first])
    assert [c.id for c in await store.list_completions(session_id=session.id)] == [first.id]
    await store.record_completion(completion=completion(session.id, seconds=1))
    assert len(await store.list_completions(session_id=session.id)) == 2


async def test_close_stops_the_writer_thread(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    before = set(_writer_threads())  # other tests' stores, if any
    store = await Store.open(url)
    session = await store.create_session(api_key_hash=key_hash())
    await store.record_completion(completion=completion(session.id))
    assert set(_writer_threads()) - before
    await store.close()
    assert not set(_writer_threads()) - before
