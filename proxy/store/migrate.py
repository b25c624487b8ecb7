"""Run the Alembic migrations programmatically.

Sync entry points for the CLI (``proxima db upgrade --db URL``): ``upgrade``,
``downgrade``, ``current_revision``. The server calls ``await
ensure_schema(url)`` at start-up; it upgrades to head and is a no-op on an
up-to-date database.

Concurrent migrators (several proxy replicas starting at once) are serialized:
on PostgreSQL by a transaction-scoped advisory lock, on SQLite by running the
migration in a ``BEGIN IMMEDIATE`` transaction. All DDL of one run is one
transaction on both, so a failed migration leaves no half-built schema.

A new SQLite file is switched to WAL before any of that (``prepare_sqlite_file``:
concurrent first connections would otherwise fail "database is locked").
Migrations in one process run one at a time, since Alembic's ``context`` is a
module global that two interleaved runs would share.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from proxima.migrations import SCRIPT_LOCATION
from proxima.proxy.store.database import (
    begin_immediate,
    create_engine,
    normalize_db_url,
    prepare_sqlite_file,
)
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

logger = logging.getLogger(__name__)

_PG_MIGRATION_LOCK_ID = 0x50524F58  # "PROX": advisory lock key held while migrating


def alembic_config(url: str | None = None) -> Config:
    """An Alembic ``Config`` pointing at the packaged migration scripts."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    if url is not None:
        config.set_main_option("sqlalchemy.url", normalize_db_url(url).replace("%", "%%"))
    return config


def head_revision() -> str | None:
    """The newest revision among the packaged migration scripts."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


_in_process: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


def _migration_lock() -> asyncio.Lock:
    """This event loop's lock around migration runs."""
    loop = asyncio.get_running_loop()
    lock = _in_process.get(loop)
    if lock is None:
        lock = _in_process[loop] = asyncio.Lock()
    return lock


async def run_on_new_connection(url: str, fn: Callable[[Connection], Any]) -> Any:
    """Open a locked migration transaction on ``url``, run sync ``fn`` in it, commit."""
    async with _migration_lock():
        await asyncio.to_thread(prepare_sqlite_file, url)
        engine = create_engine(url, poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                conn = await begin_immediate(conn)
                async with conn.begin():
                    if conn.dialect.name == "postgresql":
                        await conn.execute(
                            text("SELECT pg_advisory_xact_lock(:key)"),
                            {"key": _PG_MIGRATION_LOCK_ID},
                        )
                    return await conn.run_sync(fn)
        finally:
            await engine.dispose()


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def _migrate(url: str, direction: str, revision: str) -> None:
    config = alembic_config(url)

    def run(connection: Connection) -> None:
        before = _current(connection)
        config.attributes["connection"] = connection
        if direction == "upgrade":
            command.upgrade(config, revision)
        else:
            command.downgrade(config, revision)
        after = _current(connection)
        if before != after:
            logger.info(
                "database migrated",
                extra={"direction": direction, "from_rev": before, "to_rev": after},
            )

    await run_on_new_connection(url, run)


async def upgrade_async(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision``."""
    await _migrate(url, "upgrade", revision)


async def downgrade_async(url: str, revision: str = "base") -> None:
    """Downgrade the database at ``url`` to ``revision`` (``base`` drops every table)."""
    await _migrate(url, "downgrade", revision)


async def current_revision_async(url: str) -> str | None:
    """The revision the database at ``url`` is at (``None`` when unmigrated)."""
    revision: str | None = await run_on_new_connection(url, _current)
    return revision


async def ensure_schema(url: str) -> None:
    """Bring the database at ``url`` to the newest schema; safe when already there."""
    await upgrade_async(url, "head")


def upgrade(url: str, revision: str = "head") -> None:
    """Sync ``upgrade_async`` for the CLI (must not be called from a running event loop)."""
    asyncio.run(upgrade_async(url, revision))


def downgrade(url: str, revision: str = "base") -> None:
    """Sync ``downgrade_async`` for the CLI (must not be called from a running event loop)."""
    asyncio.run(downgrade_async(url, revision))


def current_revision(url: str) -> str | None:
    """Sync ``current_revision_async`` for the CLI."""
    return asyncio.run(current_revision_async(url))
