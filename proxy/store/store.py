"""The trajectory store: one async facade over sessions, completions, keys, versions.

Build it with ``store = await Store.open(url)`` and ``await store.close()`` it.
Every method is keyword-only and returns frozen records (``records.py``),
never ORM objects. The schema must already exist: run the migrations first
(``proxima.proxy.store.migrate.ensure_schema`` or ``proxima db upgrade``).
"""

from __future__ import annotations

import logging
from typing import Any

from alembic.runtime.migration import MigrationContext
from proxima.proxy.store.claims import ClaimsMixin
from proxima.proxy.store.completions import CompletionsMixin
from proxima.proxy.store.database import create_engine, normalize_db_url
from proxima.proxy.store.errors import StoreError
from proxima.proxy.store.fleet import FleetMixin
from proxima.proxy.store.keys import ApiKeysMixin
from proxima.proxy.store.migrate import head_revision
from proxima.proxy.store.registry import RegistryMixin
from proxima.proxy.store.sessions import SessionsMixin
from proxima.proxy.store.versions import PolicyVersionsMixin
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

logger = logging.getLogger(__name__)


class Store(
    SessionsMixin,
    CompletionsMixin,
    ApiKeysMixin,
    PolicyVersionsMixin,
    ClaimsMixin,
    RegistryMixin,
    FleetMixin,
):
    """Async repository of the trajectory database (SQLite or PostgreSQL)."""

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        check_schema: bool = True,
        shared: bool | None = None,
        **engine_kwargs: Any,
    ) -> Store:
        """Connect to the database at ``url`` (any form ``normalize_db_url`` accepts).

        With ``check_schema`` (default), raises ``StoreError`` unless the
        database is migrated to the newest revision. ``shared``: whether other processes
        serve from it too (``FleetMixin.shared``; None: on PostgreSQL).
        """
        engine = create_engine(url, **engine_kwargs)
        try:
            if check_schema:
                await _check_schema(engine, url)
        except BaseException:
            await engine.dispose()
            raise
        logger.info("store opened", extra={"dialect": engine.dialect.name})
        return cls(engine, shared=shared)

    async def close(self) -> None:
        """Close every pooled connection (and SQLite's writer thread)."""
        if self._direct_sqlite is not None:
            await self._direct_sqlite.close()
        await self._engine.dispose()


async def _check_schema(engine: AsyncEngine, url: str) -> None:
    async with engine.connect() as conn:
        current = await conn.run_sync(
            lambda sync_conn: MigrationContext.configure(sync_conn).get_current_revision()
        )
    head = head_revision()
    if current != head:
        shown = make_url(normalize_db_url(url)).render_as_string(hide_password=True)
        raise StoreError(
            f"database schema is at revision {current}, expected {head}: "
            f"run `proxima db upgrade --db {shown}`"
        )
