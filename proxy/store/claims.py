"""Trainer-side operations of the ``Store``: claiming sessions exactly once.

A session is claimable when it is FINISHED and rewarded (a session reward, or
a reward on any of its completions). ``claim_sessions`` moves claimable
sessions to CLAIMED in one transaction, so each is handed to exactly one
trainer even when several trainers in several processes claim at once.
``claim_groups`` does the same for whole groups (the sessions sharing a
``group_id``; a session without one is a group by itself), so that a group's
sessions are compared with each other in one batch, never split across two:

* PostgreSQL: ``SELECT ... FOR UPDATE OF sessions SKIP LOCKED`` then ``UPDATE``,
  in one transaction; concurrent claimers skip each other's rows.
* SQLite: the transaction starts with ``BEGIN IMMEDIATE``, so claimers (and
  all other writers) serialize on the database write lock.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

from proxima.proxy.store._base import StoreBase, of_policy
from proxima.proxy.store.convert import session_record
from proxima.proxy.store.errors import Conflict, NotFound
from proxima.proxy.store.models import CompletionRow, SessionRow
from proxima.proxy.store.records import SessionKind, SessionRecord, SessionStatus
from sqlalchemy import exists, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

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
        adapter: str | None = None,
    ) -> list[SessionRecord]:
        """Atomically take up to ``limit`` rewarded FINISHED sessions, oldest finished first.

        Only sessions of the policy ``adapter`` (``None``: the base model's) are taken: a
        trainer trains one policy on its own sessions.
        """
        if limit < 1:
            return []
        rewarded = _rewarded()
        query = (
            select(SessionRow)
            .where(
                SessionRow.status == SessionStatus.FINISHED.value,
                SessionRow.kind.in_([SessionKind(k).value for k in kinds]),
                of_policy(SessionRow.adapter, adapter),
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

    async def claim_groups(
        self,
        *,
        min_sessions: int,
        trainer_id: str,
        kinds: Collection[SessionKind] = _DEFAULT_KINDS,
        adapter: str | None = None,
    ) -> list[SessionRecord]:
        """Atomically take whole complete groups, oldest first, until ``min_sessions`` are held.

        Only groups of the policy ``adapter`` (``None``: the base model's) are taken.

        A group is complete when none of its sessions is OPEN and, if its
        sessions' metadata names a ``group_size``, at least that many sessions
        of the group exist (the rollout controller may open a group's sessions
        one at a time). All of a complete group's claimable sessions are
        claimed together; its failed or unrewarded sessions are not part of it.
        Groups are ordered by their last session's finish. The last group taken
        may carry the total past ``min_sessions``; when the complete groups hold
        fewer, all of them are taken. A group another trainer holds part of
        (Postgres ``SKIP LOCKED``) is left alone.
        """
        if min_sessions < 1:
            return []
        query = (
            select(SessionRow)
            .where(
                SessionRow.status == SessionStatus.FINISHED.value,
                SessionRow.kind.in_([SessionKind(k).value for k in kinds]),
                of_policy(SessionRow.adapter, adapter),
                _rewarded(),
            )
            .order_by(SessionRow.finished_at, SessionRow.created_at, SessionRow.id)
            .limit(max(16 * min_sessions, 1024))
            .with_for_update(skip_locked=True, of=SessionRow)
        )
        async with self._write() as db:
            rows = list((await db.execute(query)).scalars())
            group_ids = {row.group_id for row in rows if row.group_id is not None}
            by_group: dict[str, list[SessionRow]] = {}
            for row in rows:
                if row.group_id is not None:
                    by_group.setdefault(row.group_id, []).append(row)
            complete = await _complete_groups(db, by_group) if group_ids else set()
            units: list[list[SessionRow]] = []
            seen: set[str] = set()
            for row in reversed(rows):  # a group's place is its last finish
                if row.group_id is None:
                    units.append([row])
                elif row.group_id in complete and row.group_id not in seen:
                    seen.add(row.group_id)
                    units.append(by_group[row.group_id])
            taken: list[SessionRow] = []
            for unit in reversed(units):
                if len(taken) >= min_sessions:
                    break
                taken.extend(unit)
            for row in taken:
                row.status = SessionStatus.CLAIMED.value
                row.claimed_by = trainer_id
            await db.flush()
            claimed = [session_record(row) for row in taken]
        if claimed:
            logger.info(
                "groups claimed",
                extra={"trainer_id": trainer_id, "count": len(claimed), "groups": len(units)},
            )
        return claimed

    async def count_group_sessions(self, *, group_id: str) -> int:
        """Sessions of ``group_id`` that were admitted and are not FAILED or DROPPED."""
        query = select(func.count()).where(
            SessionRow.group_id == group_id,
            SessionRow.status.not_in([SessionStatus.FAILED.value, SessionStatus.DROPPED.value]),
        )
        async with self._read() as db:
            return int((await db.execute(query)).scalar_one())

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

    async def claimed_sessions(self, *, trainer_id: str) -> list[SessionRecord]:
        """The sessions ``trainer_id`` holds CLAIMED now, oldest finished first (a trainer whose
        claim's answer was lost learns from it what the claim took)."""
        query = (
            select(SessionRow)
            .where(
                SessionRow.status == SessionStatus.CLAIMED.value,
                SessionRow.claimed_by == trainer_id,
            )
            .order_by(SessionRow.finished_at, SessionRow.created_at, SessionRow.id)
        )
        async with self._read() as db:
            return [session_record(row) for row in (await db.execute(query)).scalars()]

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


def _rewarded() -> Any:
    """SQL condition: the session has a reward, or one of its completions has."""
    return SessionRow.reward.is_not(None) | exists().where(
        CompletionRow.session_id == SessionRow.id, CompletionRow.reward.is_not(None)
    )


async def _complete_groups(db: AsyncSession, locked: dict[str, list[SessionRow]]) -> set[str]:
    """Ids of the groups in ``locked`` that are complete and wholly locked by this transaction."""
    ids = list(locked)
    counts_query = (
        select(SessionRow.group_id, SessionRow.status, func.count())
        .where(SessionRow.group_id.in_(ids))
        .group_by(SessionRow.group_id, SessionRow.status)
    )
    counts = (await db.execute(counts_query)).tuples().all()
    total: dict[str, int] = {}
    open_: dict[str, int] = {}
    for group_id, status, count in counts:
        assert group_id is not None  # selected by group id above
        total[group_id] = total.get(group_id, 0) + int(count)
        if status == SessionStatus.OPEN.value:
            open_[group_id] = int(count)
    claimable_query = (
        select(SessionRow.group_id, func.count())
        .where(
            SessionRow.group_id.in_(ids),
            SessionRow.status == SessionStatus.FINISHED.value,
            _rewarded(),
        )
        .group_by(SessionRow.group_id)
    )
    claimable = {g: int(n) for g, n in (await db.execute(claimable_query)).tuples()}
    complete = set()
    for group_id, rows in locked.items():
        sizes = [r.metadata_.get("group_size") for r in rows if isinstance(r.metadata_, dict)]
        size = max((int(x) for x in sizes if isinstance(x, int)), default=0)
        if (
            not open_.get(group_id)
            and claimable.get(group_id) == len(rows)  # no row held by another claimer
            and total.get(group_id, 0) >= size
        ):
            complete.add(group_id)
    return complete
