"""``DirectSqlite``: the store's two hot statements on a SQLite file, run on the stdlib
``sqlite3`` driver instead of SQLAlchemy's async engine.

- The completion insert (``Store.record_completions``): committed on the event loop when
  the lock is free, else on one dedicated thread.
- The key lookup of a session's first request (``read_one``), read on the event loop, a
  worker's check of a session's status and count before each turn (``read_row``), and the
  turns another worker added to a session it holds (``read_keys``, ``read_among``).

Everything else the store does goes through the async engine. The completion insert is
therefore written twice (``store/completions.py``: ``insert_completions`` in SQLAlchemy
Core for PostgreSQL and a SQLite file opened by URI, ``insert_completions_sqlite`` here);
the driver-level path costs 0.19 ms of CPU per completion where the Core path cost 0.86 ms
(docs/benchmarks.md, "Proxy overhead"), and a test pins that both store the same bytes
(``tests/proxy/store/test_direct_sqlite.py``).

Through aiosqlite every statement of a transaction (begin, status query,
insert, commit) is a hop to its worker thread and back to the event loop;
on the proxy's hot path those hops cost more CPU than the writes. Here a
whole batch is one call on the stdlib ``sqlite3`` driver:

- first on the event loop's own connection, whose busy timeout is zero: a
  transaction of a few completions takes a fraction of a millisecond and
  no thread hop (two wake-ups, each a scheduler's delay on a loaded host);
- when another writer holds the lock (this process's async engine, a trainer
  in another process), ``BEGIN IMMEDIATE`` fails at once and the same call
  goes to the writer thread, whose connection queues on the busy timeout.

The event loop's connection never checkpoints (``wal_autocheckpoint=0``: a
checkpoint fsyncs the database file, which must not stall the loop); the
writer thread runs a passive checkpoint every ``CHECKPOINT_EVERY`` commits
made on the loop.

Both connections are set up like the async engine's (``database.py``): WAL,
``synchronous=NORMAL``, foreign keys. A call returns after its commit. What
that commit gives, in WAL mode:

- ``synchronous=NORMAL`` (these connections, like the async engine): the commit is
  atomic and survives the proxy process crashing or being killed the moment
  it returns; the WAL is fsynced at checkpoints, so a power loss or an OS
  crash can roll back the last transactions (never corrupt the database);
- ``synchronous=FULL``: each commit also fsyncs the WAL, so it survives a
  power loss too, at the cost of one fsync (milliseconds on most disks) per
  group commit.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from proxima.proxy.store.database import configure_sqlite, is_sqlite_busy
from proxima.proxy.store.errors import is_outage, unavailable
from sqlalchemy import Table, create_engine
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import URL, Connection, Dialect
from sqlalchemy.orm import Mapper
from sqlalchemy.pool import StaticPool

logger = logging.getLogger(__name__)

MAX_PARAMS = 500
"""Keys per ``IN (...)``: under SQLite's oldest limit on parameters (999); the ORM read of a
busy SQLite file chunks by it too."""

CHECKPOINT_EVERY = 200
"""Commits on the event loop between two passive checkpoints on the writer thread."""


class DirectSqlite:
    """A SQLite file's driver connections: the event loop's own (never waits for the lock)
    and a writer thread's (queues on the busy timeout, runs checkpoints)."""

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
        self._selects: dict[tuple[str, str], RawSelect] = {}
        self._path = url.database
        # A plain file path; URI filenames and options (``?mode=...``) stay with the engine.
        self._loop_path = not url.query
        self._loop_db: sqlite3.Connection | None = None  # the event loop's own connection
        self._loop_commits = 0
        self._checkpoint: asyncio.Future[tuple[int, int, int] | None] | None = None
        self.thread_commits = 0  # transactions that had to wait for another writer

    @staticmethod
    def usable(url: URL) -> bool:
        """Whether ``url`` is a SQLite file another connection can open (not ``:memory:``)."""
        database = url.database or ""
        return url.get_backend_name() == "sqlite" and database not in ("", ":memory:")

    def read_one(self, model: type, attribute: str, value: Any) -> SimpleNamespace | None:
        """The row of ``model`` whose ``attribute`` equals ``value``, on the event loop's
        connection: a WAL reader never waits for writers, so a point lookup takes tens
        of microseconds where aiosqlite's thread hops take a millisecond. Attributes are
        the mapped column keys, values converted by SQLAlchemy's column types.

        Raises ``SqliteBusy`` when the database cannot be read without waiting.
        """
        raw = self._select(model, attribute)
        row = self.read_row(raw.sql, (value,))
        return None if row is None else raw.values(row)

    def _select(self, model: type, attribute: str) -> RawSelect:
        """``model``'s select by ``attribute`` (built once); ``SqliteBusy`` when reads
        cannot go through the event loop's connection (a URI filename)."""
        if not self._loop_path:
            raise SqliteBusy()
        raw = self._selects.get((model.__name__, attribute))
        if raw is None:
            raw = self._selects[(model.__name__, attribute)] = RawSelect(
                model, attribute, self._engine.dialect
            )
        return raw

    def read_keys(
        self, model: type, attribute: str, value: Any, key: str, order: list[str]
    ) -> list[Any]:
        """The ``key`` attribute of every row of ``model`` whose ``attribute`` equals
        ``value``, in ``order``, on the event loop's connection, as the driver gives it (a
        text or integer key; ``SqliteBusy`` as ``read_one``)."""
        raw = self._select(model, attribute)
        sql = (
            f"SELECT {raw.column(key)} FROM {raw.table} WHERE {raw.column(attribute)} = ? "
            f"ORDER BY {', '.join(map(raw.column, order))}"
        )
        return [row[0] for row in self.read_rows(sql, (value,))]

    def read_among(
        self, model: type, attribute: str, value: Any, key: str, keys: list[Any]
    ) -> list[SimpleNamespace]:
        """The rows of ``model`` whose ``attribute`` equals ``value`` and whose ``key`` is one
        of ``keys``, on the event loop's connection (``read_one``'s conversions)."""
        raw = self._select(model, attribute)
        rows: list[tuple[Any, ...]] = []
        for at in range(0, len(keys), MAX_PARAMS):  # SQLite's limit on parameters
            part = keys[at : at + MAX_PARAMS]
            sql = f"{raw.sql} AND {raw.column(key)} IN ({', '.join('?' * len(part))})"
            rows += self.read_rows(sql, (value, *part))
        return [raw.values(row) for row in rows]

    def read_row(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The first row of ``read_rows``, or None."""
        rows = self.read_rows(sql, params)
        return rows[0] if rows else None

    def read_rows(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """The rows of the read-only driver ``sql`` (``?`` parameters), read on the event
        loop's connection, values as the driver gives them; ``SqliteBusy`` when it cannot
        be read without waiting."""
        if not self._loop_path:
            raise SqliteBusy()
        try:
            # fetchall: the statement runs to its end, so no read transaction stays open.
            rows = self._loop_connection().execute(sql, params).fetchall()
        except sqlite3.OperationalError as exc:
            if is_sqlite_busy(exc):
                raise SqliteBusy() from exc
            if is_outage(exc):  # the file cannot be read (I/O error, removed): not a bug
                raise unavailable(exc) from exc
            raise
        return [tuple(row) for row in rows]

    def insert(self, table: Table) -> RawInsert:
        """``table``'s INSERT for this database (built once)."""
        raw = self._inserts.get(table.name)
        if raw is None:
            raw = self._inserts[table.name] = RawInsert(table, self._engine.dialect)
        return raw

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(db, *args)`` in a ``BEGIN IMMEDIATE`` transaction, committed before this
        returns; ``db`` is a ``sqlite3.Connection`` (driver errors are ``sqlite3``'s).

        ``fn`` may run twice: on the loop's connection, rolled back because another
        writer held the lock at its commit, then on the writer thread.
        """
        if self._loop_path:
            try:
                return self._on_loop(fn, args)
            except SqliteBusy:
                pass
        loop = asyncio.get_running_loop()
        self.thread_commits += 1
        return await loop.run_in_executor(self._executor, self._transaction, fn, args)

    def _on_loop(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        result = _transact(self._loop_connection(), fn, args)
        self._loop_commits += 1
        if self._loop_commits % CHECKPOINT_EVERY == 0 and (
            self._checkpoint is None or self._checkpoint.done()
        ):
            loop = asyncio.get_running_loop()
            self._checkpoint = loop.run_in_executor(self._executor, self._passive_checkpoint)
        return result

    def _loop_connection(self) -> sqlite3.Connection:
        if self._loop_db is None:
            self._loop_db = _connect(self._path)
        return self._loop_db

    def _thread_db(self) -> sqlite3.Connection:
        if self._conn is None or self._conn.invalidated or self._conn.closed:
            self._conn = self._engine.connect()
        return self._conn.connection.dbapi_connection  # type: ignore[return-value]

    def _transaction(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        try:
            return _transact(self._thread_db(), fn, args)
        except SqliteBusy as exc:  # the busy timeout ran out: the driver's own error
            raise exc.__cause__ from None  # type: ignore[misc]

    def _passive_checkpoint(self) -> tuple[int, int, int] | None:
        """``(busy, frames in the WAL, frames checkpointed)``, ``None`` if it failed."""
        try:
            row: tuple[int, int, int] | None = (
                self._thread_db().execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            )
            return row
        except sqlite3.Error as exc:  # the next one tries again; other connections also do
            logger.warning("SQLite checkpoint failed: %s", exc)
            return None

    def _dispose(self) -> None:
        if self._loop_db is not None:
            self._loop_db.close()  # the loop waits in close(): nothing else uses it now
            self._loop_db = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._engine.dispose()

    async def close(self) -> None:
        """Close the connection on the writer thread, then stop the thread."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._dispose)
        self._executor.shutdown(wait=True)


class SqliteBusy(Exception):
    """Another connection holds the lock (or the event loop's connection is not used)."""


def _connect(path: str | None) -> sqlite3.Connection:
    """The event loop's connection: never waits for the lock, never checkpoints."""
    assert path, "DirectSqlite serves SQLite files only (see DirectSqlite.usable)"
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    for pragma in (
        "busy_timeout = 0",
        "foreign_keys = ON",
        "journal_mode = WAL",
        "synchronous = NORMAL",
        "wal_autocheckpoint = 0",
    ):
        db.execute(f"PRAGMA {pragma}")
    return db


def _transact(db: sqlite3.Connection, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``fn(db, *args)`` between ``BEGIN IMMEDIATE`` and ``COMMIT``; ``SqliteBusy`` when the lock
    is taken (only a connection without a busy timeout sees that: nothing was written)."""
    try:
        db.execute("BEGIN IMMEDIATE")
        result = fn(db, *args)
        db.execute("COMMIT")
    except BaseException as exc:
        if db.in_transaction:
            db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.OperationalError) and is_sqlite_busy(exc):
            raise SqliteBusy() from exc
        raise
    return result


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


class RawSelect:
    """``SELECT`` of a mapped class's rows by one attribute, as driver SQL; values converted
    back by SQLAlchemy's own column types (the result processors a Core select would use)
    and named as the class's attributes."""

    def __init__(self, model: type[Any], attribute: str, dialect: Dialect):
        mapper: Mapper[Any] = sa_inspect(model)
        attrs = [(prop.key, prop.columns[0]) for prop in mapper.column_attrs]
        quote = dialect.identifier_preparer.quote
        self.keys = [key for key, _ in attrs]
        self._processors = [
            c.type.dialect_impl(dialect).result_processor(dialect, None) for _, c in attrs
        ]
        self._names = {key: quote(c.name) for key, c in attrs}
        self.table = quote(model.__tablename__)
        self.sql = (
            f"SELECT {', '.join(self._names.values())} "
            f"FROM {self.table} WHERE {self._names[attribute]} = ?"
        )

    def column(self, attribute: str) -> str:
        """The quoted column name of a mapped attribute."""
        return self._names[attribute]

    def values(self, row: tuple[Any, ...]) -> SimpleNamespace:
        return SimpleNamespace(
            **{
                key: value if process is None else process(value)
                for key, value, process in zip(self.keys, row, self._processors, strict=True)
            }
        )
