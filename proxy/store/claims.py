"""Trainer-side operations of the ``Store``: claiming sessions exactly once.

A session is claimable when it is FINISHED and rewarded (a session reward, or
a reward on any of its completions). ``claim_sessions`` moves claimable
sessions to CLAIMED in one transaction, so each is handed to exactly one
trainer even when several trainers in several processes claim at once:

* PostgreSQL: ``SELECT ... FOR UPDATE OF sessions SKIP LOCKED`` then ``UPDATE``,
  in one transaction; concurrent claimers skip each other's rows.
* SQLite: the transaction starts with ``BEGIN IMMEDIATE``, so claimers (and
  all other writers) serialize on the database write lock.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from proxima.proxy.store._base import StoreBase
from proxima.proxy.store.convert import session_record
from proxima.proxy.store.errors import Conflict, NotFound
from proxima.proxy.store.models import CompletionRow, SessionRow
from proxima.proxy.store.records import SessionKind, SessionRecord, SessionStatus
from sqlalchemy import exists, func, select, update

logger = logging.getLogger(__name__)

_DEFAULT_KINDS = (SessionKind.TRAIN, SessionKind.PRODUCTION)
_FINAL_STATUSES = (SessionStatus.TRAINED, SessionStatus.DROPPED)


class ClaimsMixin(StoreBase):
    """Claiming finished sessions for training and recording the outcome."""

    async def claim_sessions(
        self,
        *,
        limit: int,
        trainer_id: str,
        kinds: Collection[SessionKind] = _DEFAULT_KINDS,
    ) -> list[SessionRecord]:
        """Atomically take up to ``limit`` rewarded FINISHED sessions, oldest finished first."""
        if limit < 1:
            return []
        rewarded = SessionRow.reward.is_not(None) | exists().where(
            CompletionRow.session_id == SessionRow.id, CompletionRow.reward.is_not(None)
        )
        query = (
            select(SessionRow)
            .where(
                SessionRow.status == SessionStatus.FINISHED.value,
                SessionRow.kind.in_([SessionKind(k).value for k in kinds]),
                rewarded,
            )
            .order_by(SessionRow.finished_at, SessionRow.created_at, SessionRow.id)
            .limit(limit)
            .with_for_update(skip_locked=True, of=SessionRow)
        )
        async with self._write() as db:
            rows = list((await db.execute(query)).scalars())
            for row in rows:
                row.status = SessionStatus.CLAIMED.value
                row.claimed_by = trainer_id
            await db.flush()
            claimed = [session_record(row) for row in rows]
        if claimed:
            logger.info("sessions claimed", extra={"trainer_id": trainer_id, "count": len(claimed)})
        return claimed

    async def mark_sessions(
        self,
        *,
        session_ids: Sequence[str],
        status: SessionStatus,
        trained_version: int | None = None,
    ) -> None:
        """Move CLAIMED sessions to TRAINED (into ``trained_version``) or DROPPED.

        All or nothing: raises ``NotFound`` for an unknown id and ``Conflict``
        when any session is not CLAIMED, changing none of them.
        """
        status = SessionStatus(status)
        if status not in _FINAL_STATUSES:
            raise ValueError(f"mark_sessions status must be trained or dropped, not {status}")
        ids = list(dict.fromkeys(session_ids))
        if not ids:
            return
        async with self._write() as db:
            query = (
                select(SessionRow.id, SessionRow.status)
                .where(SessionRow.id.in_(ids))
                .with_for_update()
            )
            found = dict((await db.execute(query)).tuples().all())
            missing = [i for i in ids if i not in found]
            if missing:
                raise NotFound(f"sessions not found: {missing}")
            unclaimed = [i for i in ids if found[i] != SessionStatus.CLAIMED.value]
            if unclaimed:
                raise Conflict(f"sessions not claimed: {unclaimed}")
            await db.execute(
                update(SessionRow)
                .where(SessionRow.id.in_(ids))
                .values(status=status.value, trained_version=trained_version)
            )
        logger.info(
            "sessions marked",
            extra={"status": status.value, "count": len(ids), "trained_version": trained_version},
        )

    async def release_claims(self, *, trainer_id: str) -> int:
        """Return a (crashed) trainer's CLAIMED sessions to FINISHED; how many were released."""
        async with self._write() as db:
            result = await db.execute(
                update(SessionRow)
                .where(
                    SessionRow.status == SessionStatus.CLAIMED.value,
                    SessionRow.claimed_by == trainer_id,
                )
                .values(status=SessionStatus.FINISHED.value, claimed_by=None)
            )
            released = int(result.rowcount)  # type: ignore[attr-defined]
        if released:
            logger.info("claims released", extra={"trainer_id": trainer_id, "count": released})
        return released

    async def count_sessions_by_status(
        self, *, kind: SessionKind | None = None
    ) -> dict[SessionStatus, int]:
        """Session counts per status (every status present, zeros included)."""
        query = select(SessionRow.status, func.count()).group_by(SessionRow.status)
        if kind is not None:
            query = query.where(SessionRow.kind == SessionKind(kind).value)
        counts = dict.fromkeys(SessionStatus, 0)
        async with self._read() as db:
            for status, count in (await db.execute(query)).tuples():
                counts[SessionStatus(status)] = int(count)
        return counts
