"""Shared plumbing of the ``Store`` mixins: the engine and transaction scopes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from proxima.proxy.policies.adapters import policy_label
from proxima.proxy.store.database import BEGIN_MODE_OPTION
from proxima.proxy.store.direct_sqlite import DirectSqlite
from proxima.proxy.store.errors import Conflict, NotFound, outages
from proxima.proxy.store.models import SessionRow
from sqlalchemy import ColumnElement, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import InstrumentedAttribute


def new_id() -> str:
    """A fresh random identifier (128 bits, hex)."""
    return uuid.uuid4().hex


def of_policy(
    column: InstrumentedAttribute[str | None], adapter: str | None
) -> ColumnElement[bool]:
    """SQL condition: ``column`` names the policy ``adapter`` (``None``, the base: NULL)."""
    return column.is_(None) if adapter is None else column == adapter


async def check_group_policy(db: AsyncSession, group_id: str | None, adapter: str | None) -> None:
    """Raise ``Conflict`` if group ``group_id`` holds a session of another policy than ``adapter``.

    A group's sessions are compared with each other in one trainer batch, and a
    trainer trains one policy: a session joins only a group of its own policy
    (and a group of another policy's sessions never lets it past admission).
    """
    if group_id is None:
        return
    other = (
        select(SessionRow.adapter)
        .where(SessionRow.group_id == group_id, SessionRow.adapter.is_distinct_from(adapter))
        .limit(1)
    )
    found = (await db.execute(other)).first()
    if found is not None:
        raise Conflict(
            f"group {group_id!r} holds sessions of {policy_label(found[0])}, not of "
            f"{policy_label(adapter)}: a group is one policy's sessions; give this session "
            "another group_id",
            param="group_id",
            code="group_of_another_policy",
        )


class StoreBase:
    """Holds the engine and opens read and write transactions."""

    def __init__(self, engine: AsyncEngine, *, shared: bool | None = None) -> None:
        self._engine = engine
        # Whether several processes serve from this database (None: PostgreSQL's are taken
        # to; ``proxima serve --workers`` says so for its workers on one SQLite file).
        self._shared = shared
        self._sessionmaker = async_sessionmaker(engine, expire_on_commit=False)
        # SQLite files: the completion insert and the session-key lookup go to the driver
        # (direct_sqlite.py).
        usable = DirectSqlite.usable(engine.url)
        self._direct_sqlite = DirectSqlite(engine.url) if usable else None

    @property
    def engine(self) -> AsyncEngine:
        """The underlying async engine (for tests and diagnostics)."""
        return self._engine

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncSession]:
        """A read-only transaction; rolled back at exit. An outage is ``StoreUnavailable``."""
        with outages():
            async with self._sessionmaker() as db:
                yield db

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncSession]:
        """A write transaction, committed at exit unless an exception escapes.

        On SQLite it starts with ``BEGIN IMMEDIATE``, so writers (in any
        process) serialize on the database lock instead of failing midway.
        An outage (the database unreachable, or locked past the busy timeout) is
        ``StoreUnavailable``.
        """
        with outages():
            async with self._sessionmaker() as db, db.begin():
                await db.connection(execution_options={BEGIN_MODE_OPTION: "IMMEDIATE"})
                yield db

    async def ping(self) -> None:
        """One round trip to the database; ``StoreUnavailable`` when it does not answer
        (the readiness check: ``GET /health/ready``)."""
        async with self._read() as db:
            await db.execute(text("SELECT 1"))

    @staticmethod
    async def _session_row(
        db: AsyncSession, session_id: str, *, lock: bool = False, share: bool = False
    ) -> SessionRow:
        """Load a session row, optionally row-locked (PostgreSQL), or raise ``NotFound``."""
        query = select(SessionRow).where(SessionRow.id == session_id)
        if lock or share:
            query = query.with_for_update(read=share and not lock)
        row = (await db.execute(query)).scalar_one_or_none()
        if row is None:
            raise NotFound(f"session {session_id} not found")
        return row
