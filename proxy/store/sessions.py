"""Session operations of the ``Store``: creation, lookup, rewards, finishing."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from proxima.proxy.policies.adapters import check_adapter
from proxima.proxy.store import values
from proxima.proxy.store._base import StoreBase, check_group_policy, new_id, of_policy
from proxima.proxy.store.convert import session_record
from proxima.proxy.store.direct_sqlite import SqliteBusy
from proxima.proxy.store.errors import Conflict, NotFound, RewardAlreadySet
from proxima.proxy.store.models import ApiKeyRow, CompletionRow, SessionRow, utcnow
from proxima.proxy.store.records import SessionKind, SessionRecord, SessionStatus
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

logger = logging.getLogger(__name__)

CONSUMED_STATUSES = frozenset({SessionStatus.CLAIMED, SessionStatus.TRAINED, SessionStatus.DROPPED})
"""Statuses of sessions a trainer has taken; their trajectory and rewards are frozen."""

_DONE_STATUSES = frozenset({SessionStatus.FINISHED}) | CONSUMED_STATUSES


class SessionsMixin(StoreBase):
    """Creating, reading, rewarding and finishing sessions."""

    async def create_session(
        self,
        *,
        api_key_hash: str | None,
        kind: SessionKind = SessionKind.TRAIN,
        group_id: str | None = None,
        data_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        external_id: str | None = None,
        api_key_id: str | None = None,
        adapter: str | None = None,
    ) -> SessionRecord:
        """Open a new session of the policy ``adapter`` (``None``: the base model).

        ``api_key_hash`` is the sha256 hash of the session's own API key (train
        sessions); it must be unique. Raises ``Conflict`` if it is already used, or if
        ``group_id`` names a group of another policy's sessions.
        """
        values.text(group_id, "group_id")
        values.text(data_id, "data_id")
        values.text(external_id, "external_id")
        values.json_value(metadata, "metadata")
        row = SessionRow(
            adapter=check_adapter(adapter),
            id=new_id(),
            kind=SessionKind(kind).value,
            status=SessionStatus.OPEN.value,
            api_key_hash=api_key_hash,
            group_id=group_id,
            data_id=data_id,
            metadata_=dict(metadata or {}),
            reward=None,
            created_at=utcnow(),
            external_id=external_id,
            api_key_id=api_key_id,
        )
        try:
            async with self._write() as db:
                await check_group_policy(db, group_id, row.adapter)
                db.add(row)
                await db.flush()
        except IntegrityError as exc:
            raise Conflict("session key hash or (api key, external id) already in use") from exc
        logger.debug("session created", extra={"session_id": row.id, "kind": row.kind})
        return session_record(row)

    async def get_session(self, *, session_id: str) -> SessionRecord | None:
        """The session with this id, or ``None``."""
        values.text(session_id, "session_id")
        async with self._read() as db:
            row = await db.get(SessionRow, session_id)
            return None if row is None else session_record(row)

    async def get_session_by_key_hash(self, *, api_key_hash: str) -> SessionRecord | None:
        """The session whose own API key hashes to ``api_key_hash``, or ``None``.

        Every session's first request (and one every key-cache period) asks this: on
        SQLite it is read on the event loop when that needs no wait (see ``DirectSqlite``).
        """
        direct = self._direct_sqlite
        if direct is not None:
            try:
                found = direct.read_one(SessionRow, "api_key_hash", api_key_hash)
            except SqliteBusy:
                pass
            else:
                return None if found is None else session_record(found)  # type: ignore[arg-type]
        async with self._read() as db:
            query = select(SessionRow).where(SessionRow.api_key_hash == api_key_hash)
            row = (await db.execute(query)).scalar_one_or_none()
            return None if row is None else session_record(row)

    async def get_or_create_production_session(
        self, *, api_key_id: str, external_id: str | None
    ) -> SessionRecord:
        """The production session of ``(api_key_id, external_id)``, created on first use.

        ``external_id=None`` always opens a new session. Concurrent callers with
        the same pair get the same session (a unique constraint decides; the
        loser of an insert race reads the winner's row). Raises ``NotFound`` if
        the API key does not exist.
        """
        values.text(external_id, "external_id")
        if external_id is None:
            key = await self._require_api_key(api_key_id)
            return await self.create_session(
                api_key_hash=None,
                kind=SessionKind.PRODUCTION,
                api_key_id=api_key_id,
                adapter=key.adapter,
            )
        for attempt in range(3):
            try:
                return await self._get_or_insert_production(api_key_id, external_id)
            except IntegrityError:
                # Another writer inserted the same (api_key_id, external_id) first.
                logger.debug("production session insert race", extra={"attempt": attempt})
        raise Conflict(f"could not get or create production session {external_id!r}")

    async def _require_api_key(self, api_key_id: str) -> ApiKeyRow:
        async with self._read() as db:
            key = await db.get(ApiKeyRow, api_key_id)
            if key is None:
                raise NotFound(f"api key {api_key_id} not found")
            return key

    async def _get_or_insert_production(self, api_key_id: str, external_id: str) -> SessionRecord:
        async with self._write() as db:
            query = select(SessionRow).where(
                SessionRow.api_key_id == api_key_id, SessionRow.external_id == external_id
            )
            row = (await db.execute(query)).scalar_one_or_none()
            if row is not None:
                return session_record(row)
            key = await db.get(ApiKeyRow, api_key_id)
            if key is None:
                raise NotFound(f"api key {api_key_id} not found")
            row = SessionRow(
                adapter=key.adapter,  # a production key's sessions are its policy's
                id=new_id(),
                kind=SessionKind.PRODUCTION.value,
                status=SessionStatus.OPEN.value,
                metadata_={},
                created_at=utcnow(),
                external_id=external_id,
                api_key_id=api_key_id,
            )
            db.add(row)
            await db.flush()
            return session_record(row)

    async def set_session_reward(self, *, session_id: str, reward: float) -> SessionRecord:
        """Post the final reward of a session (write-once).

        Raises ``NotFound``, ``RewardAlreadySet``, or ``Conflict`` when a trainer
        already took the session (the reward would never be trained on).
        """
        values.text(session_id, "session_id")
        values.finite(reward, "reward")
        async with self._write() as db:
            row = await self._session_row(db, session_id, lock=True)
            if row.reward is not None:
                raise RewardAlreadySet(f"session {session_id} already has a reward")
            _require_not_consumed(row)
            row.reward = float(reward)
            await db.flush()
            return session_record(row)

    async def set_completion_reward(
        self, *, session_id: str, completion_id: str, reward: float
    ) -> None:
        """Post a per-turn reward for one completion of the session (write-once).

        Raises ``NotFound`` (also when the completion belongs to another
        session), ``RewardAlreadySet``, or ``Conflict`` when already claimed.
        """
        values.text(session_id, "session_id")
        values.text(completion_id, "completion_id")
        values.finite(reward, "reward")
        async with self._write() as db:
            session = await self._session_row(db, session_id, lock=True)
            completion = await db.get(CompletionRow, completion_id)
            if completion is None or completion.session_id != session_id:
                raise NotFound(f"completion {completion_id} not found in session {session_id}")
            if completion.reward is not None:
                raise RewardAlreadySet(f"completion {completion_id} already has a reward")
            _require_not_consumed(session)
            completion.reward = float(reward)

    async def finish_session(
        self, *, session_id: str, status: SessionStatus = SessionStatus.FINISHED
    ) -> SessionRecord:
        """Close a session as FINISHED (agent done) or FAILED (agent raised).

        Finishing again is a no-op (also after a trainer took the session);
        failing an already-failed session too. Moving between FINISHED and
        FAILED raises ``Conflict``; ``NotFound`` for an unknown id.
        """
        values.text(session_id, "session_id")
        status = SessionStatus(status)
        if status not in (SessionStatus.FINISHED, SessionStatus.FAILED):
            raise ValueError(f"finish_session status must be finished or failed, not {status}")
        async with self._write() as db:
            row = await self._session_row(db, session_id, lock=True)
            current = SessionStatus(row.status)
            if current == SessionStatus.OPEN:
                row.status = status.value
                row.finished_at = utcnow()
                await db.flush()
            elif not (
                (status == SessionStatus.FINISHED and current in _DONE_STATUSES)
                or (status == SessionStatus.FAILED and current == SessionStatus.FAILED)
            ):
                raise Conflict(f"session {session_id} is {current}, cannot mark it {status}")
            return session_record(row)

    async def count_sessions(
        self,
        *,
        kind: SessionKind = SessionKind.TRAIN,
        statuses: Collection[SessionStatus] | None = None,
        adapter: str | None = None,
    ) -> int:
        """Number of sessions of ``kind`` of one policy (optionally only ``statuses``)."""
        query = (
            select(func.count())
            .select_from(SessionRow)
            .where(SessionRow.kind == kind.value, of_policy(SessionRow.adapter, adapter))
        )
        if statuses is not None:
            query = query.where(SessionRow.status.in_([SessionStatus(s).value for s in statuses]))
        async with self._read() as db:
            return int((await db.execute(query)).scalar_one())


def _require_not_consumed(row: SessionRow) -> None:
    if SessionStatus(row.status) in CONSUMED_STATUSES:
        raise Conflict(f"session {row.id} was already taken by a trainer ({row.status})")
