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
import sqlite3
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from proxima.proxy.store.database import configure_sqlite
from sqlalchemy import Table, create_engine
from sqlalchemy.engine import URL, Connection, Dialect
from sqlalchemy.pool import StaticPool


class SqliteWriter:
    """Runs write transactions on a dedicated thread, on its raw ``sqlite3`` connection."""

    def __init__(self, url: URL):
        self._conn: Connection | None = None  # opened on the writer thread
        # One connection, used only by the writer thread (StaticPool keeps it open). The
        # engine opens and configures it (configure_sqlite's PRAGMAs); statements then go
        # to the driver directly: SQLAlchemy's execution layer cost 8x the SQLite work.
        self._engine = create_engine(
            url.set(drivername="sqlite+pysqlite"),
            poolclass=StaticPool,
            connect_args={"check_same_thread": False},
        )
        configure_sqlite(self._engine, begin_mode="IMMEDIATE")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-writer")
        self._inserts: dict[str, RawInsert] = {}

    @staticmethod
    def usable(url: URL) -> bool:
        """Whether ``url`` is a SQLite file another connection can open (not ``:memory:``)."""
        database = url.database or ""
        return url.get_backend_name() == "sqlite" and database not in ("", ":memory:")

    def insert(self, table: Table) -> RawInsert:
        """``table``'s INSERT for this database (built once)."""
        raw = self._inserts.get(table.name)
        if raw is None:
            raw = self._inserts[table.name] = RawInsert(table, self._engine.dialect)
        return raw

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(db, *args)`` in a ``BEGIN IMMEDIATE`` transaction, committed before this
        returns; ``db`` is the ``sqlite3.Connection`` (driver errors are ``sqlite3``'s)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._transaction, fn, args)

    def _transaction(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self._conn is None or self._conn.invalidated or self._conn.closed:
            self._conn = self._engine.connect()
        db: sqlite3.Connection = self._conn.connection.dbapi_connection  # type: ignore[assignment]
        db.execute("BEGIN IMMEDIATE")
        try:
            result = fn(db, *args)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return result

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


class RawInsert:
    """One table's ``INSERT`` as driver SQL, its values converted by SQLAlchemy's own types.

    Each column's bind processor for the dialect (JSON encoding, SQLite's timestamp format,
    UTC conversion, ...) turns a value into exactly what a Core insert would
    store, so rows written here read back through the ORM like any other.
    """

    def __init__(self, table: Table, dialect: Dialect):
        columns = list(table.columns)
        quote = dialect.identifier_preparer.quote
        self.keys = [c.key for c in columns]
        self._processors = [c.type.dialect_impl(dialect).bind_processor(dialect) for c in columns]
        self.sql = (
            f"INSERT INTO {quote(table.name)} ({', '.join(quote(c.name) for c in columns)}) "
            f"VALUES ({', '.join('?' * len(columns))})"
        )

    def params(self, row: Mapping[str, Any]) -> tuple[Any, ...]:
        """The positional parameters of ``row`` (a value for every column)."""
        return tuple(
            row[key] if process is None else process(row[key])
            for key, process in zip(self.keys, self._processors, strict=True)
        )
