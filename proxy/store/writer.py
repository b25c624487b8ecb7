"""SQLite's write path for completions: one dedicated thread, one plain connection.

Through aiosqlite every statement of a transaction (begin, status query,
insert, commit) is a hop to its worker thread and back to the event loop;
on the proxy's hot path those hops cost more CPU than the writes. Here a
whole batch runs as one call on one thread with SQLAlchemy's synchronous
driver (the stdlib ``sqlite3`` module): one hop per batch. The thread keeps
one connection open, so a transaction costs no pool checkout or reset.

The connection is set up like the async engine's (``database.py``): WAL,
``synchronous=NORMAL``, foreign keys, the busy timeout, and every
transaction is ``BEGIN IMMEDIATE``, so it queues behind other writers (this
process's async engine, a trainer in another process) instead of failing.
A call returns after its commit. What that commit gives, in WAL mode:

- ``synchronous=NORMAL`` (this writer, like the async engine): the commit is
  atomic and survives the proxy process crashing or being killed the moment
  it returns; the WAL is fsynced at checkpoints, so a power loss or an OS
  crash can roll back the last transactions (never corrupt the database);
- ``synchronous=FULL``: each commit also fsyncs the WAL, so it survives a
  power loss too, at the cost of one fsync (milliseconds on most disks) per
  group commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from proxima.proxy.store.database import configure_sqlite
from sqlalchemy import create_engine
from sqlalchemy.engine import URL, Connection
from sqlalchemy.pool import StaticPool


class SqliteWriter:
    """Runs write transactions on a dedicated thread."""

    def __init__(self, url: URL):
        self._conn: Connection | None = None  # opened on the writer thread
        # One connection, used only by the writer thread (StaticPool keeps it open).
        self._engine = create_engine(
            url.set(drivername="sqlite+pysqlite"),
            poolclass=StaticPool,
            connect_args={"check_same_thread": False},
        )
        configure_sqlite(self._engine, begin_mode="IMMEDIATE")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-writer")

    @staticmethod
    def usable(url: URL) -> bool:
        """Whether ``url`` is a SQLite file another connection can open (not ``:memory:``)."""
        database = url.database or ""
        return url.get_backend_name() == "sqlite" and database not in ("", ":memory:")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(conn, *args)`` in a write transaction, committed before this returns."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._transaction, fn, args)

    def _transaction(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self._conn is None or self._conn.invalidated or self._conn.closed:
            self._conn = self._engine.connect()
        with self._conn.begin():
            return fn(self._conn, *args)

    def _dispose(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._engine.dispose()

    async def close(self) -> None:
        """Close the connection on the writer thread, then stop the thread."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._dispose)
        self._executor.shutdown(wait=True)
