"""Completion operations of the ``Store``: recording and reading trajectories."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from proxima.proxy.store import values
from proxima.proxy.store._base import StoreBase
from proxima.proxy.store.chains import resolve_all
from proxima.proxy.store.convert import completion_record, completion_values
from proxima.proxy.store.direct_sqlite import MAX_PARAMS, RawInsert, SqliteBusy
from proxima.proxy.store.errors import Conflict, NotFound, SessionClosed, outages
from proxima.proxy.store.models import CompletionRow, SessionRow
from proxima.proxy.store.records import CompletionRecord, SessionStatus
from proxima.proxy.store.sessions import CONSUMED_STATUSES
from sqlalchemy import bindparam, insert, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError


class CompletionsMixin(StoreBase):
    """Recording generated sequences and reading a session's trajectory."""

    async def record_completion(self, *, completion: CompletionRecord) -> None:
        """Store one completion; it is committed when this returns.

        Raises ``NotFound`` for an unknown session, ``Conflict`` for a duplicate
        completion id or a session a trainer already took, and ``ValueError``
        when the per-token arrays disagree in length or leave int32.
        """
        await self.record_completions(completions=[completion])

    async def record_completions(
        self,
        *,
        completions: Sequence[CompletionRecord],
        parents: Mapping[str, CompletionRecord] | None = None,
    ) -> None:
        """Store several completions in one transaction: all are committed, or none.

        The proxy's group commit (``group_commit.py``) uses this under load; errors are
        those of ``record_completion``. A completion with a ``parent_id`` is stored
        as what it adds to its parent (``chains.py``): ``parents`` may hand in the
        parents' records (whole, as this store returns them), else they are read.
        """
        known = dict(parents or {})
        for c in completions:
            if c.parent_id is not None and c.parent_id not in known:
                parent = await self.get_completion(completion_id=c.parent_id)
                if parent is not None:
                    known[parent.id] = parent
            known.setdefault(c.id, c)  # a parent committed in the same batch
        rows = [
            completion_values(c, known.get(c.parent_id) if c.parent_id else None)
            for c in completions
        ]
        direct = self._direct_sqlite
        try:
            if direct is not None:
                # A SQLite file: the whole transaction is one call on the driver (on the event
                # loop's connection, or the writer thread's when another writer holds the lock).
                insert = direct.insert(CompletionRow.__table__)  # type: ignore[arg-type]
                with outages():
                    await direct.run(insert_completions_sqlite, insert, completions, rows)
            else:
                async with self._write() as db:
                    conn = await db.connection()
                    await conn.run_sync(insert_completions, completions, rows)
        except (IntegrityError, sqlite3.IntegrityError) as exc:
            ids = ", ".join(c.id for c in completions)
            raise Conflict(f"completion already recorded (one of: {ids})") from exc

    async def get_completion(self, *, completion_id: str) -> CompletionRecord | None:
        """The completion with this id (its whole prompt and messages), or ``None``."""
        values.text(completion_id, "completion_id")
        async with self._read() as db:
            row = await db.get(CompletionRow, completion_id)
            if row is None:
                return None
            if not (row.prompt_prefix or row.messages_prefix or row.tools_from_parent):
                return completion_record(row)
            # Stored against its parent: the session's rows rebuild the chain.
            query = select(CompletionRow).where(CompletionRow.session_id == row.session_id)
            rows = list((await db.execute(query)).scalars())
        return _rebuild(rows, [completion_id])[completion_id]

    async def list_completions(self, *, session_id: str) -> list[CompletionRecord]:
        """The session's completions, oldest first (ties: choice index, then id), each
        with its whole prompt and messages."""
        values.text(session_id, "session_id")
        query = (
            select(CompletionRow)
            .where(CompletionRow.session_id == session_id)
            .order_by(CompletionRow.created_at, CompletionRow.choice_index, CompletionRow.id)
        )
        async with self._read() as db:
            rows = list((await db.execute(query)).scalars())
        ids = [row.id for row in rows]
        built = _rebuild(rows, ids)
        return [built[cid] for cid in ids]

    async def list_completions_since(
        self, *, session_id: str, known: Sequence[CompletionRecord]
    ) -> list[CompletionRecord] | None:
        """``list_completions`` for a caller that holds some of the session's completions
        already (``known``): the session's ids are read in order, and only the rows it does
        not hold are read whole and built, so a worker catching up on the turns another one
        recorded decodes those turns alone, whatever order they were created or committed
        in. None if a row was gone by the second read (the caller reads the session whole).
        """
        values.text(session_id, "session_id")
        held = {c.id: c for c in known}
        rows: Sequence[Any]
        try:
            if self._direct_sqlite is None:
                raise SqliteBusy()
            # On the event loop's connection (a worker asks whenever another one took the
            # session's last turn): no thread hop, no ORM.
            direct = self._direct_sqlite
            ids = direct.read_keys(CompletionRow, "session_id", session_id, "id", _ORDER)
            missing = [cid for cid in ids if cid not in held]
            rows = (
                direct.read_among(CompletionRow, "session_id", session_id, "id", missing)
                if missing
                else []
            )
        except SqliteBusy:
            order = [getattr(CompletionRow, a) for a in _ORDER]
            async with self._read() as db:
                listed = select(CompletionRow.id).where(CompletionRow.session_id == session_id)
                ids = list((await db.execute(listed.order_by(*order))).scalars())
                missing = [cid for cid in ids if cid not in held]
                rows = []
                for at in range(0, len(missing), MAX_PARAMS):
                    among = CompletionRow.id.in_(missing[at : at + MAX_PARAMS])
                    query = select(CompletionRow).where(
                        CompletionRow.session_id == session_id, among
                    )
                    rows += list((await db.execute(query)).scalars())
        by_id: dict[str, Any] = {row.id: row for row in rows}  # rows, or the direct read's
        if len(by_id) != len(missing):
            return None

        def build(cid: str, parent: CompletionRecord | None) -> CompletionRecord:
            row = by_id[cid]
            if parent is None and row.parent_id is not None:
                parent = held.get(row.parent_id)  # a held completion's child
            return completion_record(row, parent)

        built = resolve_all(missing, {row.id: row.parent_id for row in rows}, build)
        return [held[cid] if cid in held else built[cid] for cid in ids]


# ``list_completions``'s order, as attribute names.
_ORDER = ["created_at", "choice_index", "id"]


def _rebuild(rows: Sequence[CompletionRow], ids: list[str]) -> dict[str, CompletionRecord]:
    """Records of ``ids`` (and of their ancestors) from one session's ``rows``."""
    by_id = {row.id: row for row in rows}
    return resolve_all(
        ids,
        {row.id: row.parent_id for row in rows},
        lambda cid, parent: completion_record(by_id[cid], parent),
    )


# Built once: a statement built per call costs more than the insert itself (construction,
# coercion, cache key). One status query for every session of a batch, under a shared row
# lock that keeps a concurrent claim from taking a session before the insert (PostgreSQL;
# SQLite's write transaction already excludes it).
_SESSION_STATUS = (
    select(SessionRow.id, SessionRow.status)
    .where(SessionRow.id.in_(bindparam("ids", expanding=True)))
    .with_for_update(read=True)
)
# A Core executemany, not the ORM unit of work: the rows are new and never read back.
_INSERT_COMPLETIONS = insert(CompletionRow)


def insert_completions(
    conn: Connection, completions: Sequence[CompletionRecord], rows: Sequence[dict[str, Any]]
) -> None:
    """Check the sessions of ``completions`` and insert ``rows``, inside ``conn``'s transaction.

    Raises ``NotFound`` or ``Conflict`` (see ``record_completion``); the caller commits.
    """
    session_ids = list(dict.fromkeys(c.session_id for c in completions))
    status = conn.execute(_SESSION_STATUS, {"ids": session_ids}).tuples().all()
    _check_sessions(session_ids, dict(status))
    conn.execute(_INSERT_COMPLETIONS, list(rows))


def insert_completions_sqlite(
    db: sqlite3.Connection,
    insert: RawInsert,
    completions: Sequence[CompletionRecord],
    rows: Sequence[dict[str, Any]],
) -> None:
    """``insert_completions`` on a ``DirectSqlite`` driver connection (its transaction).

    The same checks and the same stored bytes as the Core statement above, written a second
    time in driver SQL because the Core path cost 4.5x the CPU per completion (0.86 vs
    0.19 ms: docs/benchmarks.md, "Proxy overhead"); ``tests/proxy/store/test_direct_sqlite.py``
    pins that both store the same row.
    """
    session_ids = list(dict.fromkeys(c.session_id for c in completions))
    query = f"SELECT id, status FROM sessions WHERE id IN ({', '.join('?' * len(session_ids))})"
    _check_sessions(session_ids, dict(db.execute(query, session_ids).fetchall()))
    db.executemany(insert.sql, [insert.params(row) for row in rows])


def _check_sessions(session_ids: list[str], status: dict[str, str]) -> None:
    """Only OPEN sessions take completions, checked where the completion is committed.

    The status is read in the inserting transaction (row-locked on PostgreSQL),
    so a finish through any replica, however recent, is seen: a finished
    session never gains a completion.
    """
    for session_id in session_ids:
        if session_id not in status:
            raise NotFound(f"session {session_id} not found")
        current = SessionStatus(status[session_id])
        if current in CONSUMED_STATUSES:
            raise SessionClosed(
                f"session {session_id} was already taken by a trainer ({status[session_id]})"
            )
        if current is not SessionStatus.OPEN:
            raise SessionClosed(f"Session {session_id} is {current.value}; open a new session.")
