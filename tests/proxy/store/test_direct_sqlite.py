"""SQLite's completion writer thread: it queues behind other writers, stores what SQLAlchemy
would, and stops with the store."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from proxima.proxy.store import Conflict, Store, ensure_schema
from proxima.proxy.store import direct_sqlite as direct_sqlite_module
from proxima.proxy.store.completions import insert_completions
from proxima.proxy.store.convert import completion_values
from sqlalchemy import create_engine

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
    assert store._direct_sqlite.thread_commits == 1  # it waited on the writer thread
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


async def test_a_free_lock_commits_on_the_loop_and_checkpoints_on_the_thread(
    sqlite_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, path = sqlite_store
    monkeypatch.setattr(direct_sqlite_module, "CHECKPOINT_EVERY", 3)
    writer = store._direct_sqlite
    session = await store.create_session(api_key_hash=key_hash())
    for i in range(3):
        await store.record_completion(completion=completion(session.id, seconds=i))
        fresh = sqlite3.connect(path)  # committed when the call returned
        assert fresh.execute("select count(*) from completions").fetchone()[0] == i + 1
        fresh.close()
    assert writer.thread_commits == 0  # no hop: the lock was free every time
    # The loop's connection never checkpoints; every third commit the thread does.
    busy, frames, done = await asyncio.wait_for(writer._checkpoint, 30)
    assert busy == 0 and frames > 0 and done == frames


async def test_close_stops_the_writer_thread(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    before = set(_writer_threads())  # other tests' stores, if any
    store = await Store.open(url)
    session = await store.create_session(api_key_hash=key_hash())
    path = tmp_path / "store.db"
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the lock is taken: the record goes to the thread
    record = asyncio.create_task(store.record_completion(completion=completion(session.id)))
    await asyncio.sleep(0.2)
    other.execute("COMMIT")
    other.close()
    await asyncio.wait_for(record, 30)
    assert set(_writer_threads()) - before
    await store.close()
    assert not set(_writer_threads()) - before


async def test_driver_rows_equal_what_a_core_insert_stores(sqlite_store, tmp_path: Path) -> None:
    """The writer's driver-level insert stores byte for byte what SQLAlchemy Core would."""
    store, path = sqlite_store
    session = await store.create_session(api_key_hash=key_hash())
    # The same database before any completion, for the Core insert.
    core_path = tmp_path / "core.db"
    with sqlite3.connect(path) as src, sqlite3.connect(core_path) as dst:
        src.backup(dst)
    paris = timezone(timedelta(hours=2))
    records = [
        completion(session.id),  # the optional JSON and float columns left None
        completion(
            session.id,
            seconds=1.5,
            created_at=datetime(2025, 6, 1, 12, 0, 0, 123456, tzinfo=paris),
            finished_at=datetime(2025, 6, 1, 12, 0, 1, tzinfo=paris),
            request_messages=[{"role": "user", "content": "héllo \u0000 🙂"}],
            request_tools=[{"type": "function", "function": {"name": "f"}}],
            response_message={"role": "assistant", "content": None},
            response_text="nul \u0000 and é",
            sampling={"temperature": 0.7, "stop": ["\n"]},
            model="m",
            reward=0.5,
            choice_index=1,
            time_to_first_token=0.001,
            duration=1.0 / 3.0,
            backend="http://127.0.0.1:1",
        ),
    ]
    await store.record_completions(completions=records)
    engine = create_engine(f"sqlite:///{core_path}")
    with engine.begin() as conn:
        insert_completions(conn, records, [completion_values(r) for r in records])
    engine.dispose()

    def rows(db_path: Path) -> list[dict[str, tuple]]:
        with sqlite3.connect(db_path) as db:
            columns = [r[1] for r in db.execute("PRAGMA table_info(completions)")]
            typed = ", ".join(f"{c}, typeof({c})" for c in columns)
            return [
                {c: (row[2 * i], row[2 * i + 1]) for i, c in enumerate(columns)}
                for row in db.execute(f"SELECT {typed} FROM completions ORDER BY id")
            ]

    driver, core = rows(path), rows(core_path)
    assert len(driver) == len(core) == 2
    for ours, theirs in zip(driver, core, strict=True):
        assert {k: v for k, v in ours.items() if theirs[k] != v} == {}, theirs
    # And the ORM reads them back as they were recorded.
    got = {c.id: c for c in await store.list_completions(session_id=session.id)}
    for record in records:
        assert got[record.id].created_at == record.created_at
        assert got[record.id].request_messages == record.request_messages
        assert got[record.id].response_text == record.response_text


async def test_key_lookup_on_the_loop_reads_what_the_orm_reads(
    sqlite_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session found by its key hash on the loop's connection equals the ORM's record."""
    store, path = sqlite_store
    plain = await store.create_session(api_key_hash=key_hash("plain"))
    full = await store.create_session(
        api_key_hash=key_hash("full"),
        group_id="g-1",
        data_id="d-é",
        metadata={"task": "naïve 🙂", "n": 3, "nested": {"x": [1, None]}},
    )
    await store.set_session_reward(session_id=full.id, reward=0.25)
    await store.finish_session(session_id=full.id)
    expected = {s.id: await store.get_session(session_id=s.id) for s in (plain, full)}

    def no_orm_read() -> None:
        raise AssertionError("the key lookup went through the async engine")

    monkeypatch.setattr(store, "_read", no_orm_read)
    for session, raw in ((plain, "plain"), (full, "full")):
        found = await store.get_session_by_key_hash(api_key_hash=key_hash(raw))
        assert found == expected[session.id]
        assert found is not None and found.created_at.tzinfo is not None
    assert await store.get_session_by_key_hash(api_key_hash=key_hash("nobody")) is None
    # Another connection's commit is seen at once: no read transaction is left open.
    other = sqlite3.connect(path)
    other.execute(
        "UPDATE sessions SET api_key_hash = ? WHERE id = ?", (key_hash("moved"), plain.id)
    )
    other.commit()
    other.close()
    assert await store.get_session_by_key_hash(api_key_hash=key_hash("plain")) is None
    moved = await store.get_session_by_key_hash(api_key_hash=key_hash("moved"))
    assert moved is not None and moved.id == plain.id
