"""The run page's figures, read from the store by a few aggregate statements.

A *run* is one rollout pass (``metadata.rollout``, see ``queries.py``); without one the page
covers every session of the policy. Every figure is one ``GROUP BY`` over the sessions (or
their completions), never a row per session brought back:

- sessions by status, with their time span;
- the mean reward over time (``BUCKETS`` buckets of creation time) and by the version the
  sessions were trained into (one point per training step);
- held-out scores by version (``version_evals``: what ``proxima eval`` recorded);
- the policy's pushed versions, and the staleness of the tokens each step trained on: a trained
  token of version ``u`` in a step that made version ``v`` was ``v - 1 - u`` versions old (read
  from the completions of the newest ``STALENESS_VERSIONS`` steps only);
- throughput: completions and generated tokens per minute over time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
from proxima.proxy.inspector.queries import BASE, of_adapter, run_of
from proxima.proxy.store.models import (
    AdapterVersionRow,
    CompletionRow,
    PolicyVersionRow,
    SessionRow,
    VersionEvalRow,
)
from sqlalchemy import ColumnElement, Float, Integer, cast, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

BUCKETS = 40
STALENESS_VERSIONS = 10
RUNS_SHOWN = 20


def epoch(column: Any, dialect: str) -> ColumnElement[Any]:
    """Seconds since the epoch of a stored UTC time, in SQL."""
    if dialect == "sqlite":  # stored as 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC)
        return (func.julianday(column) - 2440587.5) * 86400.0
    return cast(func.extract("epoch", column), Float)


def bucket(column: Any, dialect: str, t0: float, width: float) -> ColumnElement[Any]:
    """The index of the ``width``-second bucket from ``t0`` that ``column`` falls in."""
    offset = (epoch(column, dialect) - t0) / width
    # SQLite's CAST truncates (offset >= 0 here); PostgreSQL's rounds, hence floor.
    return cast(offset if dialect == "sqlite" else func.floor(offset), Integer)


@dataclass(frozen=True, slots=True)
class Scope:
    """Which sessions the page covers: a run's (or all), of one policy."""

    run: str | None
    adapter: str  # BASE or an adapter's name

    @property
    def policy(self) -> str | None:
        return None if self.adapter == BASE else self.adapter

    def sessions(self) -> list[ColumnElement[bool]]:
        out = [of_adapter(self.adapter)]
        if self.run is not None:
            out.append(run_of() == self.run)
        return [c for c in out if c is not None]


@dataclass
class RunFigures:
    statuses: dict[str, int] = field(default_factory=dict)
    first: datetime | None = None
    last: datetime | None = None
    mean_reward: float | None = None
    reward_by_time: list[tuple[float, float, int]] = field(default_factory=list)  # (t, mean, n)
    reward_by_version: list[tuple[int, float, int]] = field(default_factory=list)  # (v, mean, n)
    evals: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # name -> (v, score)
    versions: list[tuple[int, datetime, str | None]] = field(default_factory=list)  # newest first
    staleness: list[tuple[int, float, int, int]] = field(default_factory=list)  # (v, mean, max, n)
    throughput: list[tuple[float, float, float]] = field(default_factory=list)  # (t, cpm, tpm)
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    @property
    def trained(self) -> dict[int, tuple[float, int]]:
        """Version -> (mean reward, sessions) of the sessions trained into it."""
        return {v: (m, n) for v, m, n in self.reward_by_version}

    @property
    def stale(self) -> dict[int, tuple[float, int]]:
        """Version -> (mean, max) staleness of the tokens its step trained on."""
        return {v: (m, x) for v, m, x, _ in self.staleness}


async def _statuses(conn: AsyncConnection, scope: Scope, out: RunFigures) -> None:
    query = (
        select(
            SessionRow.status,
            func.count(),
            func.min(SessionRow.created_at),
            func.max(SessionRow.created_at),
            func.sum(SessionRow.reward),
            func.count(SessionRow.reward),
        )
        .where(*scope.sessions())
        .group_by(SessionRow.status)
    )
    rewarded, total = 0, 0.0
    for status, n, first, last, reward_sum, n_rewarded in await conn.execute(query):
        out.statuses[status] = n
        out.first = first if out.first is None else min(out.first, first)
        out.last = last if out.last is None else max(out.last, last)
        rewarded += n_rewarded
        total += reward_sum or 0.0
    out.mean_reward = total / rewarded if rewarded else None


async def _over_time(
    conn: AsyncConnection, scope: Scope, out: RunFigures, dialect: str
) -> tuple[float, float] | None:
    """Reward and throughput over time; returns the buckets' (t0, width)."""
    if out.first is None or out.last is None:
        return None
    t0 = out.first.timestamp()
    # A hair wider than span / BUCKETS: the newest session falls in the last bucket, not past it.
    width = max(1.0, (out.last.timestamp() - t0) / BUCKETS * 1.0001)
    b = bucket(SessionRow.created_at, dialect, t0, width).label("b")
    rewards = (
        select(b, func.avg(SessionRow.reward), func.count())
        .where(*scope.sessions(), SessionRow.reward.is_not(None))
        .group_by(b)
    )
    for index, mean, n in await conn.execute(rewards):
        out.reward_by_time.append((t0 + (index + 0.5) * width, float(mean), n))
    cb = bucket(CompletionRow.created_at, dialect, t0, width).label("b")
    tokens = func.sum(func.length(CompletionRow.output_ids)) / 4
    done = select(cb, func.count(), tokens).where(CompletionRow.created_at >= out.first)
    if scope.run is not None:
        done = done.join(SessionRow, SessionRow.id == CompletionRow.session_id).where(
            *scope.sessions()
        )
    else:
        policy = scope.policy
        done = done.where(
            CompletionRow.adapter.is_(None) if policy is None else CompletionRow.adapter == policy
        )
    minutes = width / 60.0
    for index, n, n_tokens in await conn.execute(done.group_by(cb)):
        if index is not None and 0 <= index < BUCKETS:
            t = t0 + (index + 0.5) * width
            out.throughput.append((t, n / minutes, float(n_tokens or 0) / minutes))
    return t0, width


async def _by_version(conn: AsyncConnection, scope: Scope, out: RunFigures) -> None:
    v = SessionRow.trained_version
    query = (
        select(v, func.avg(SessionRow.reward), func.count())
        .where(*scope.sessions(), v.is_not(None), SessionRow.reward.is_not(None))
        .group_by(v)
        .order_by(v)
    )
    out.reward_by_version = [(int(a), float(m), n) for a, m, n in await conn.execute(query)]
    table: Any = PolicyVersionRow if scope.policy is None else AdapterVersionRow
    versions = select(table.version, table.created_at, table.path)
    if scope.policy is not None:
        versions = versions.where(AdapterVersionRow.adapter == scope.policy)
    rows = await conn.execute(versions.order_by(table.version.desc()).limit(30))
    out.versions = [(int(a), t, p) for a, t, p in rows]
    e = VersionEvalRow
    mine = e.adapter.is_(None) if scope.policy is None else e.adapter == scope.policy
    evals = select(e.name, e.version, e.score).where(mine).order_by(e.version, e.created_at)
    newest: dict[tuple[str, int], float] = {}
    for name, version, score in await conn.execute(evals):
        newest[(name, version)] = score  # the newest score of a version counts
    for (name, version), score in sorted(newest.items()):
        out.evals.setdefault(name, []).append((version, score))


async def _staleness(conn: AsyncConnection, scope: Scope, out: RunFigures) -> None:
    trained = [v for v, _, _ in out.reward_by_version][-STALENESS_VERSIONS:]
    if not trained:
        return
    query = (
        select(SessionRow.trained_version, CompletionRow.output_versions)
        .join(CompletionRow, CompletionRow.session_id == SessionRow.id)
        .where(*scope.sessions(), SessionRow.trained_version >= trained[0])
    )
    ages: dict[int, list[np.ndarray[Any, Any]]] = defaultdict(list)
    for version, packed in await conn.execute(query):
        if packed and version is not None:
            ages[version].append((version - 1) - np.frombuffer(packed, dtype="<i4"))
    for version in sorted(ages):
        a = np.concatenate(ages[version])
        out.staleness.append((version, float(a.mean()), int(a.max()), int(a.size)))


async def _runs(conn: AsyncConnection, out: RunFigures) -> None:
    run = run_of().label("run")
    query = (
        select(
            run,
            func.count(),
            func.min(SessionRow.created_at),
            func.max(SessionRow.created_at),
            func.avg(SessionRow.reward),
        )
        .group_by(run)
        .order_by(func.max(SessionRow.created_at).desc())
        .limit(RUNS_SHOWN)
    )
    for name, n, first, last, reward in await conn.execute(query):
        out.runs.append(
            {"run": name, "sessions": n, "first": first, "last": last, "reward": reward}
        )


async def run_figures(engine: AsyncEngine, scope: Scope) -> RunFigures:
    """Every figure of the run page (see the module docs)."""
    out = RunFigures()
    async with engine.connect() as conn:
        await _statuses(conn, scope, out)
        await _over_time(conn, scope, out, engine.dialect.name)
        await _by_version(conn, scope, out)
        await _staleness(conn, scope, out)
        await _runs(conn, out)
    return out
