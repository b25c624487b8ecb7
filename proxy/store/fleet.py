"""What proxy replicas share through the store: admission, session state, change notices.

Several ``proxima serve`` processes on one PostgreSQL database behave as one
proxy only if what each decides comes from the database, not from its memory:

- **admission** (``admit_train_session``) is one transaction under a lock
  every replica takes (a PostgreSQL transaction-level advisory lock): it reads
  the session's policy's admitted-session counter row (kept by triggers,
  migrations 0005 and 0006), the open sessions (an index range) and the
  policy's newest version, decides, and inserts. N creates spread over any number of replicas admit exactly the
  capacity, in time independent of how many sessions were ever created.
- **idempotent admission**: a session opened with an idempotency key keeps
  it (``sessions.external_id``; the admin's own sessions have no
  ``api_key_id``), and a repeat of the key is answered from the row found
  under the same lock (never a second session, never counted twice).
- **session state** (``session_state``): a session's status and number of
  completions in one indexed read, which a replica asks before rendering a
  turn (its cached history is still whole iff the count matches).
- **change notices** (``notify_change``): a new policy version or production
  state is announced with ``pg_notify`` on ``FLEET_CHANNEL`` inside the
  transaction that records it (delivered at commit); replicas listen (see
  ``proxima.proxy.policies.fleet``) and poll as a floor.
- **publish lock** (``publish_lock``): one weight push at a time across the
  fleet (a session-level advisory lock on a connection of its own).

SQLite is the single-process default: the same calls work there (its write
lock, taken by ``BEGIN IMMEDIATE``, serializes admission and the status check of
a completion's insert across processes too). Replicas on one SQLite file are
the workers of one ``proxima serve --workers N`` on one host (``shared=True``):
they follow the store by polling (no change notices), and the publish lock is
a lock on a file beside the database.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from proxima.proxy.policies.adapters import check_adapter
from proxima.proxy.store import values
from proxima.proxy.store._base import StoreBase, check_group_policy, new_id
from proxima.proxy.store.convert import session_record
from proxima.proxy.store.direct_sqlite import SqliteBusy
from proxima.proxy.store.errors import Conflict, NotAdmitted, NotFound, outages
from proxima.proxy.store.file_lock import file_lock, sqlite_lock_path
from proxima.proxy.store.models import (
    AdapterVersionRow,
    CompletionRow,
    FleetCounterRow,
    PolicyVersionRow,
    PromotionRow,
    SessionRow,
    utcnow,
)
from proxima.proxy.store.records import SessionKind, SessionRecord, SessionStatus
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession

logger = logging.getLogger(__name__)

FLEET_CHANNEL = "proxima_fleet"
"""The PostgreSQL NOTIFY channel of policy-version and production-state changes."""

ADMITTED_COUNTER = "admitted_train_sessions"

# Advisory lock keys (any 64-bit numbers, fixed): admission, and weight publishing.
_ADMISSION_LOCK = 0x50524F58494D4101
_PUBLISH_LOCK = 0x50524F58494D4102

# ``session_state``'s query for the driver (SQLite): status and completion count of one session.
_SESSION_STATE_SQL = (
    f'SELECT s."status", (SELECT count(*) FROM "{CompletionRow.__tablename__}" c '
    f'WHERE c."session_id" = s."id") FROM "{SessionRow.__tablename__}" s WHERE s."id" = ?'
)

_NOT_ADMITTED = (SessionStatus.FAILED.value, SessionStatus.DROPPED.value)


@dataclass(frozen=True, slots=True)
class AdmissionState:
    """What admission decides on, read in the admitting transaction.

    ``admitted`` and ``version`` are the session's policy's (the base's, or its
    adapter's): sessions of one adapter count against that adapter's versions
    only. ``open`` counts every policy's open sessions (they share the backends).
    """

    admitted: int  # the policy's training sessions admitted so far (not FAILED, not DROPPED)
    open: int  # training sessions OPEN now, every policy's
    version: int  # the policy's newest recorded version
    joins_admitted_group: bool  # the session's group already has an admitted session
    adapter: str | None = None  # the policy: an adapter, or None for the base


@dataclass(frozen=True, slots=True)
class SessionState:
    status: SessionStatus
    completions: int


@dataclass(frozen=True, slots=True)
class FleetState:
    """The shared state replicas follow: newest policy version and production change."""

    version: int
    path: str | None
    promotion_id: int  # id of the newest production change (0: none)


class FleetMixin(StoreBase):
    @property
    def shared(self) -> bool:
        """Whether several processes serve from this database (replicas on PostgreSQL, the
        workers of ``proxima serve --workers``): each follows what the others record."""
        return self._shared if self._shared is not None else self.postgres

    @property
    def postgres(self) -> bool:
        """Whether the database is PostgreSQL (advisory locks, ``NOTIFY``)."""
        return bool(self._engine.dialect.name == "postgresql")

    async def admit_train_session(
        self,
        *,
        decide: Callable[[AdmissionState], str | None],
        api_key_hash: str,
        group_id: str | None = None,
        data_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        adapter: str | None = None,
        idempotency_key: str | None = None,
    ) -> SessionRecord:
        """Create a training session of the policy ``adapter`` (``None``: the base) if
        ``decide`` admits it, atomically across replicas.

        ``decide`` gets the ``AdmissionState`` read under the fleet-wide
        admission lock and returns ``None`` to admit or the reason to refuse
        (raised as ``NotAdmitted``). The insert commits before the lock is
        released, so the next decision (in any replica) counts it. A ``group_id``
        of another policy's group is a ``Conflict`` (checked under the same lock,
        so two replicas cannot start one group with two policies).

        With ``idempotency_key``, the session keeps the key; a later call with the
        same key returns that session instead (``decide`` is not asked: it was
        admitted once) with its key hash replaced by ``api_key_hash`` (the caller
        never got the first key), if it is still OPEN with no completion and no
        reward and was opened with the same group, data id, metadata and policy.
        Otherwise the repeat is a ``Conflict`` (code ``idempotency_key_reused``).
        """
        values.text(group_id, "group_id")
        values.text(data_id, "data_id")
        values.text(idempotency_key, "idempotency-key")
        values.json_value(metadata, "metadata")
        async with self._write() as db:
            if self.postgres:  # SQLite: BEGIN IMMEDIATE holds the database's write lock
                await db.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ADMISSION_LOCK})
            if idempotency_key is not None:
                opened = await _session_of_key(db, idempotency_key)
                if opened is not None:
                    expected = (group_id, data_id, dict(metadata or {}), adapter)
                    return await _reissue(db, opened, api_key_hash, expected)
            await check_group_policy(db, group_id, check_adapter(adapter))
            state = await _admission_state(db, group_id, adapter)
            reason = decide(state)
            if reason is not None:
                raise NotAdmitted(reason)
            row = SessionRow(
                adapter=adapter,
                id=new_id(),
                kind=SessionKind.TRAIN.value,
                status=SessionStatus.OPEN.value,
                api_key_hash=api_key_hash,
                group_id=group_id,
                data_id=data_id,
                metadata_=dict(metadata or {}),
                reward=None,
                created_at=utcnow(),
                external_id=idempotency_key,
            )
            db.add(row)
            await db.flush()
            return session_record(row)

    async def admission_state(
        self, *, group_id: str | None = None, adapter: str | None = None
    ) -> AdmissionState:
        """The numbers admission would decide on now (diagnostics, tests)."""
        async with self._read() as db:
            return await _admission_state(db, group_id, adapter)

    async def session_state(self, *, session_id: str) -> SessionState:
        """A session's status and completion count, in one indexed read."""
        values.text(session_id, "session_id")
        direct = self._direct_sqlite
        found: Any = None
        try:
            if direct is None:
                raise SqliteBusy()
            # Read on the event loop (a worker asks before every turn): no thread hop.
            found = direct.read_row(_SESSION_STATE_SQL, (session_id,))
        except SqliteBusy:
            count = (
                select(func.count())
                .where(CompletionRow.session_id == SessionRow.id)
                .scalar_subquery()
            )
            query = select(SessionRow.status, count).where(SessionRow.id == session_id)
            async with self._read() as db:
                found = (await db.execute(query)).first()
        if found is None:
            raise NotFound(f"session {session_id} not found")
        return SessionState(SessionStatus(found[0]), int(found[1]))

    async def fleet_state(self) -> FleetState:
        """The newest policy version (and its path) and production change id."""
        newest = select(PolicyVersionRow.version, PolicyVersionRow.path).order_by(
            PolicyVersionRow.version.desc()
        )
        async with self._read() as db:
            row = (await db.execute(newest.limit(1))).first()
            promotion = (await db.execute(select(func.max(PromotionRow.id)))).scalar()
        return FleetState(
            version=int(row[0]) if row else 0,
            path=row[1] if row else None,
            promotion_id=int(promotion or 0),
        )

    async def notify_change(self, db: AsyncSession, what: str) -> None:
        """Announce ``what`` changed to every replica when ``db``'s transaction commits
        (PostgreSQL; workers on SQLite poll)."""
        if self.shared and self.postgres:
            await db.execute(text("SELECT pg_notify(:c, :w)"), {"c": FLEET_CHANNEL, "w": what})

    @asynccontextmanager
    async def publish_lock(self) -> AsyncIterator[None]:
        """Held by one weight push at a time in the whole fleet (no-op for one process)."""
        if not self.shared:
            yield
            return
        if not self.postgres:
            async with file_lock(sqlite_lock_path(self._engine.url.database)):
                yield
            return
        with outages():
            conn = await self._engine.connect()
            try:
                await conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PUBLISH_LOCK})
                await conn.commit()
            except BaseException:
                await conn.close()
                raise
        try:
            yield
        finally:
            try:
                with outages():
                    await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PUBLISH_LOCK})
                    await conn.commit()
            except BaseException:
                # A session's lock outlives a pooled connection's rollback: drop the
                # connection, which frees it on the server.
                await conn.invalidate()
                raise
            finally:
                await conn.close()


def admitted_counter(adapter: str | None) -> str:
    """The ``fleet_counters`` row counting a policy's admitted sessions (migration 0006)."""
    return ADMITTED_COUNTER if adapter is None else f"{ADMITTED_COUNTER}:{adapter}"


async def newest_version(db: AsyncSession, adapter: str | None) -> int:
    """The newest recorded version of a policy inside ``db``'s transaction (0: none)."""
    if adapter is None:
        query = select(func.max(PolicyVersionRow.version))
    else:
        query = select(func.max(AdapterVersionRow.version)).where(
            AdapterVersionRow.adapter == adapter
        )
    return int((await db.execute(query)).scalar() or 0)


async def _session_of_key(db: AsyncSession, idempotency_key: str) -> SessionRow | None:
    """The training session the admin opened with ``idempotency_key``, row-locked (PostgreSQL:
    a completion insert takes a share lock on its session row, so none lands meanwhile)."""
    query = (
        select(SessionRow)
        .where(
            SessionRow.api_key_id.is_(None),  # the admin's, not a production key's
            SessionRow.external_id == idempotency_key,
            SessionRow.kind == SessionKind.TRAIN.value,
        )
        .with_for_update()
    )
    return (await db.execute(query)).scalar_one_or_none()


async def _reissue(
    db: AsyncSession,
    row: SessionRow,
    api_key_hash: str,
    expected: tuple[str | None, str | None, dict[str, Any], str | None],
) -> SessionRecord:
    """The session ``row`` again, under a new key hash, if nobody can have used it yet."""
    opened_with = (row.group_id, row.data_id, dict(row.metadata_ or {}), row.adapter)
    if opened_with != expected:
        raise Conflict(
            f"this Idempotency-Key already opened session {row.id} with another body "
            "(group_id, data_id, metadata or adapter); send a new key for a new session",
            param="idempotency-key",
            code="idempotency_key_reused",
        )
    completions = (
        await db.execute(select(func.count()).where(CompletionRow.session_id == row.id))
    ).scalar_one()
    status = SessionStatus(row.status)
    if status is not SessionStatus.OPEN or completions or row.reward is not None:
        state = f"{status.value}, {completions} completion(s)"
        if row.reward is not None:
            state += ", rewarded"
        raise Conflict(
            f"this Idempotency-Key already opened session {row.id}, which is in use or "
            f"closed ({state}); its key cannot be issued again. Send a new key for a new "
            "session",
            param="idempotency-key",
            code="idempotency_key_reused",
        )
    row.api_key_hash = api_key_hash
    await db.flush()
    logger.info("session key reissued for a repeated idempotency key", extra={"session_id": row.id})
    return session_record(row)


async def _admission_state(
    db: AsyncSession, group_id: str | None, adapter: str | None
) -> AdmissionState:
    admitted = (
        await db.execute(
            select(FleetCounterRow.value).where(FleetCounterRow.name == admitted_counter(adapter))
        )
    ).scalar()
    open_now = (
        await db.execute(
            select(func.count()).where(
                SessionRow.kind == SessionKind.TRAIN.value,
                SessionRow.status == SessionStatus.OPEN.value,
            )
        )
    ).scalar_one()
    version = await newest_version(db, adapter)
    joins = False
    if group_id is not None:
        member = select(SessionRow.id).where(
            SessionRow.group_id == group_id, SessionRow.status.not_in(_NOT_ADMITTED)
        )
        joins = (await db.execute(member.limit(1))).first() is not None
    return AdmissionState(
        admitted=int(admitted or 0),
        open=int(open_now),
        version=version,
        joins_admitted_group=joins,
        adapter=adapter,
    )
