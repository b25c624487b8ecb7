"""The publish lock of workers on one SQLite file: an flock beside the database, one holder
at a time (two stores on the file, as two workers have), freed when the holder leaves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.store.file_lock import file_lock, sqlite_lock_path


async def test_one_holder_at_a_time(tmp_path: Path) -> None:
    path = str(tmp_path / "lock")
    order: list[str] = []

    async def hold(name: str, seconds: float) -> None:
        async with file_lock(path):
            order.append(f"{name} in")
            await asyncio.sleep(seconds)
            order.append(f"{name} out")

    first = asyncio.create_task(hold("a", 0.1))
    await asyncio.sleep(0.02)
    await asyncio.gather(first, hold("b", 0))
    assert order == ["a in", "a out", "b in", "b out"]


async def test_a_cancelled_waiter_leaves_the_lock_free(tmp_path: Path) -> None:
    path = str(tmp_path / "lock")
    async with file_lock(path):
        waiter = asyncio.create_task(asyncio.wait_for(_take(path), 0.1))
        with pytest.raises(TimeoutError):
            await waiter
    await asyncio.wait_for(_take(path), 1)  # free again


async def _take(path: str) -> None:
    async with file_lock(path):
        pass


async def test_workers_stores_on_one_sqlite_file_share_the_publish_lock(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    a, b, alone = (
        await Store.open(url, shared=True),
        await Store.open(url, shared=True),
        await Store.open(url),
    )
    try:
        assert a.shared and not a.postgres and not alone.shared
        async with a.publish_lock():
            blocked = asyncio.create_task(_publish(b))
            await asyncio.sleep(0.1)
            assert not blocked.done()  # the other worker waits
            async with alone.publish_lock():  # one process alone takes no lock
                pass
        await asyncio.wait_for(blocked, 1)
        assert Path(sqlite_lock_path(str(tmp_path / "store.db"))).exists()
    finally:
        for store in (a, b, alone):
            await store.close()


async def _publish(store: Store) -> None:
    async with store.publish_lock():
        pass


def test_an_in_memory_database_has_no_lock_file() -> None:
    with pytest.raises(ValueError, match="in-memory"):
        sqlite_lock_path(":memory:")
