"""Database URLs and async engines.

``normalize_db_url`` turns what users type (``x.db``, ``sqlite:///x.db``,
``postgres://...``) into an async SQLAlchemy URL. ``create_engine`` builds the
engine; for SQLite it turns on WAL, a busy timeout and foreign keys on every
connection, and lets SQLAlchemy emit ``BEGIN`` itself so that a write
transaction can ask for ``BEGIN IMMEDIATE`` (see ``begin_immediate``).
``prepare_sqlite_file`` creates a new SQLite file's directory and switches it
to WAL once, before its first concurrent connections.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

logger = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite connection waits for another writer before failing."""

BEGIN_MODE_OPTION = "proxima_sqlite_begin"
"""Connection execution option naming the SQLite BEGIN mode (DEFERRED/IMMEDIATE)."""

_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+pysqlite": "sqlite+aiosqlite",
    "postgres": "postgresql+asyncpg",
    "postgresql": "postgresql+asyncpg",
    "postgresql+psycopg2": "postgresql+asyncpg",
    "postgresql+psycopg": "postgresql+asyncpg",
}


def normalize_db_url(url: str | os.PathLike[str] | URL) -> str:
    """Return the async-driver form of a database URL.

    ``sqlite:///x.db`` -> ``sqlite+aiosqlite:///x.db``; ``postgres://`` and
    ``postgresql://`` -> ``postgresql+asyncpg://``; a bare path such as
    ``x.db`` or ``/tmp/x.db`` -> ``sqlite+aiosqlite:///<path>``. URLs that
    already name an async driver are returned unchanged.
    """
    if isinstance(url, URL):
        text = url.render_as_string(hide_password=False)
    else:
        text = os.fspath(url).strip()
    if not text:
        raise ValueError("empty database URL")
    if "://" not in text:
        return f"sqlite+aiosqlite:///{text}"
    scheme, rest = text.split("://", 1)
    return f"{_ASYNC_DRIVERS.get(scheme.lower(), scheme)}://{rest}"


def is_sqlite(url: str | os.PathLike[str] | URL) -> bool:
    """Whether ``url`` (normalized or not) points at SQLite."""
    return make_url(normalize_db_url(url)).get_backend_name() == "sqlite"


def create_engine(url: str | os.PathLike[str] | URL, **kwargs: Any) -> AsyncEngine:
    """Create an async engine for ``url`` with Proxima's connection settings."""
    engine = create_async_engine(normalize_db_url(url), **kwargs)
    if engine.dialect.name == "sqlite":
        configure_sqlite(engine.sync_engine)
    return engine


async def begin_immediate(conn: AsyncConnection) -> AsyncConnection:
    """Make the next transaction on ``conn`` a SQLite write transaction.

    ``BEGIN IMMEDIATE`` takes the database write lock up front, so concurrent
    writers (also in other processes) queue on the busy timeout instead of
    failing when they upgrade a read lock. No effect on other databases.
    """
    return await conn.execution_options(**{BEGIN_MODE_OPTION: "IMMEDIATE"})


def configure_sqlite(sync_engine: Engine, *, begin_mode: str = "DEFERRED") -> None:
    """Proxima's SQLite settings on every connection of ``sync_engine``.

    Transactions begin in ``begin_mode`` unless a connection's
    ``BEGIN_MODE_OPTION`` execution option names another.
    """

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # SQLAlchemy, not the sqlite3 module, emits BEGIN (see _on_begin).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(BEGIN_MODE_OPTION, begin_mode)
        if mode not in ("DEFERRED", "IMMEDIATE", "EXCLUSIVE"):
            raise ValueError(f"invalid SQLite BEGIN mode {mode!r}")
        conn.exec_driver_sql(f"BEGIN {mode}")


def is_sqlite_busy(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY, or one of its extended codes."""
    return exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY


def _sqlite_file(url: str) -> Path | None:
    """The file of a SQLite ``url``; ``None`` for other databases, memory and ``file:`` URIs."""
    parsed = make_url(normalize_db_url(url))
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    if database.startswith("file:"):
        return None
    return Path(database).expanduser()


def prepare_sqlite_file(url: str, timeout_s: float = SQLITE_BUSY_TIMEOUT_MS / 1000) -> None:
    """Create a SQLite database's directory and switch the file to WAL, waiting out other
    connections for up to ``timeout_s`` (a no-op for other databases).

    SQLite does not wait on its busy timeout for the switch (it upgrades a read lock to an
    exclusive one), so concurrent first connections to a new file fail "database is locked"
    with ``configure_sqlite``'s PRAGMA alone; once the file is in WAL, that PRAGMA is a no-op
    under a read lock, which does wait. ``ensure_schema`` calls this before migrating.
    """
    path = _sqlite_file(url)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while True:
        db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if not is_sqlite_busy(exc) or time.monotonic() > deadline:
                raise
        finally:
            db.close()
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
