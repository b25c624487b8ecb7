"""Sessions with their completions, many at a time: pages for exports and experiment trackers.

``Store.list_completions`` reads one session per query; reading a whole store that way costs a
round trip per session. :func:`sessions_with_completions` reads a page of sessions in two
queries (the sessions, then every completion of them) and rebuilds each completion's whole
prompt and messages as ``list_completions`` does (``chains.resolve_all``), in the same order
(oldest first; ties: choice index, then id). :func:`session_id_pages` walks the ids of the
sessions a condition selects, a keyset page at a time (oldest first), so a reader of the
whole store holds one page in memory. :func:`group_rewards` reads the rewards of every session
of some groups (a group's advantages compare its sessions), no tokens. :func:`trained_into`
picks the sessions a training step trained into a version (a tracker's sample rollouts of that
step).

Reads only: each call is its own read transaction; the records are frozen.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from proxima.proxy.store.chains import resolve_all
from proxima.proxy.store.convert import completion_record, session_record
from proxima.proxy.store.models import CompletionRow, SessionRow
from proxima.proxy.store.records import CompletionRecord, SessionRecord, SessionStatus
from proxima.proxy.store.store import Store
from sqlalchemy import ColumnElement, literal, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

SessionWithCompletions = tuple[SessionRecord, list[CompletionRecord]]


@dataclass(frozen=True, slots=True)
class SessionRewards:
    """A session's rewards: its own, and each completion's (oldest first, as
    ``list_completions`` orders them; None: unset)."""

    session_id: str
    group_id: str | None
    status: SessionStatus
    reward: float | None
    turn_rewards: list[float | None]


_MAX_IN = 500  # ids per IN (...) list: SQLite's default limit on bound parameters is 32766


async def sessions_with_completions(
    store: Store, session_ids: Sequence[str]
) -> list[SessionWithCompletions]:
    """The sessions of ``session_ids`` (in that order; unknown ids left out), each with its
    completions rebuilt whole, oldest first."""
    sessions: dict[str, SessionRecord] = {}
    rows: dict[str, list[CompletionRow]] = defaultdict(list)
    async with AsyncSession(store.engine) as db:
        for start in range(0, len(session_ids), _MAX_IN):
            chunk = list(session_ids[start : start + _MAX_IN])
            found = await db.execute(select(SessionRow).where(SessionRow.id.in_(chunk)))
            for session_row in found.scalars():
                sessions[session_row.id] = session_record(session_row)
            query = (
                select(CompletionRow)
                .where(CompletionRow.session_id.in_(chunk))
                .order_by(CompletionRow.created_at, CompletionRow.choice_index, CompletionRow.id)
            )
            for row in (await db.execute(query)).scalars():
                rows[row.session_id].append(row)
    out = []
    for session_id in session_ids:
        if session_id in sessions:
            out.append((sessions[session_id], _rebuilt(rows.get(session_id, []))))
    return out


def _rebuilt(rows: list[CompletionRow]) -> list[CompletionRecord]:
    """One session's records, whole, in the order of ``rows``."""
    by_id = {row.id: row for row in rows}
    built = resolve_all(
        list(by_id),
        {row.id: row.parent_id for row in rows},
        lambda cid, parent: completion_record(by_id[cid], parent),
    )
    return [built[row.id] for row in rows]


async def session_id_pages(
    store: Store, conditions: Sequence[ColumnElement[bool]], *, page_size: int = 500
) -> AsyncIterator[list[str]]:
    """The ids of the sessions ``conditions`` select, oldest first (ties: id), a page at a
    time: each page is one query that starts after the last (created_at, id) of the one
    before, so no page is read twice however the store grows meanwhile."""
    after: tuple[datetime, str] | None = None
    while True:
        query = select(SessionRow.id, SessionRow.created_at).where(*conditions)
        if after is not None:
            mark = tuple_(literal(after[0], SessionRow.created_at.type), literal(after[1]))
            query = query.where(tuple_(SessionRow.created_at, SessionRow.id) > mark)
        query = query.order_by(SessionRow.created_at, SessionRow.id).limit(page_size)
        async with store.engine.connect() as conn:
            page = (await conn.execute(query)).all()
        if not page:
            return
        yield [row.id for row in page]
        if len(page) < page_size:
            return
        after = (page[-1].created_at, page[-1].id)


async def group_rewards(store: Store, group_ids: Collection[str]) -> list[SessionRewards]:
    """The rewards of every session of the groups ``group_ids``, oldest session first."""
    ids = sorted(group_ids)
    sessions: list[SessionRewards] = []
    async with store.engine.connect() as conn:
        for start in range(0, len(ids), _MAX_IN):
            chunk = ids[start : start + _MAX_IN]
            query = (
                select(SessionRow.id, SessionRow.group_id, SessionRow.status, SessionRow.reward)
                .where(SessionRow.group_id.in_(chunk))
                .order_by(SessionRow.created_at, SessionRow.id)
            )
            found = (await conn.execute(query)).all()
            turns: dict[str, list[float | None]] = defaultdict(list)
            members = [row.id for row in found]
            for first in range(0, len(members), _MAX_IN):
                rewards = (
                    select(CompletionRow.session_id, CompletionRow.reward)
                    .where(CompletionRow.session_id.in_(members[first : first + _MAX_IN]))
                    .order_by(
                        CompletionRow.created_at, CompletionRow.choice_index, CompletionRow.id
                    )
                )
                for row in (await conn.execute(rewards)).all():
                    turns[row.session_id].append(row.reward)
            sessions += [
                SessionRewards(r.id, r.group_id, SessionStatus(r.status), r.reward, turns[r.id])
                for r in found
            ]
    return sessions


async def trained_into(
    store: Store, *, version: int, adapter: str | None = None, limit: int = 8
) -> list[SessionWithCompletions]:
    """Up to ``limit`` sessions the policy ``adapter`` (None: the base) was trained on to
    become ``version``, oldest first, with their completions."""
    policy = SessionRow.adapter.is_(None) if adapter is None else SessionRow.adapter == adapter
    query = (
        select(SessionRow.id)
        .where(SessionRow.trained_version == version, policy)
        .order_by(SessionRow.created_at, SessionRow.id)
        .limit(limit)
    )
    async with store.engine.connect() as conn:
        ids = list((await conn.execute(query)).scalars())
    return await sessions_with_completions(store, ids)
