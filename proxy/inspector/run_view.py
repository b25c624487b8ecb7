"""The run page's figures, read from the store in one pass over the sessions and a few small reads.

A *run* is one rollout pass (``metadata.rollout``, see ``queries.py``); without one the page
covers every session of the policy. What it costs:

- the time span: the first and last session of the scope, read from ``ix_sessions_created_at_id``
  (two index walks that stop at the first match);
- one ``GROUP BY`` pass over the scope's sessions, by status, time bucket (``BUCKETS`` of the
  span), the version trained into and the run: sessions by status, the mean reward over time and
  by the version the sessions were trained into (one point per training step), sessions opened
  per minute, and the runs of the store (on the page without a run). It brings back one row per
  group (a few thousand at most), never one per session;
- staleness, from the completions of the newest ``RECENT`` trained sessions: a trained token of
  version ``u`` in the step that made version ``v`` was ``v - 1 - u`` versions old;
- throughput in completions and generated tokens per minute, from the completions of the newest
  ``RECENT`` sessions (a scan of every completion would read every token array in the store);
- the policy's pushed versions and held-out scores (``version_evals``: what ``proxima eval``
  recorded), tables of one row per push.
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
RECENT = 1000
RECENT_BUCKETS = 20
RUNS_SHOWN = 20
VERSIONS_SHOWN = 30


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
    opened_by_time: list[tuple[float, float]] = field(default_factory=list)  # (t, per minute)
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


async def _span(conn: AsyncConnection, scope: Scope, out: RunFigures) -> None:
    first = select(SessionRow.created_at).where(*scope.sessions())
    out.first = (await conn.execute(first.order_by(SessionRow.created_at).limit(1))).scalar()
    out.last = (await conn.execute(first.order_by(SessionRow.created_at.desc()).limit(1))).scalar()


class _Sums:
    """Sessions, rewarded sessions and their reward sum, added up group by group."""

    __slots__ = ("n", "rewarded", "reward")

    def __init__(self) -> None:
        self.n, self.rewarded, self.reward = 0, 0, 0.0

    def add(self, n: int, rewarded: int, reward: float | None) -> None:
        self.n += n
        self.rewarded += rewarded
        self.reward += reward or 0.0

    @property
    def mean(self) -> float | None:
        return self.reward / self.rewarded if self.rewarded else None


async def _pass(conn: AsyncConnection, scope: Scope, out: RunFigures, dialect: str) -> None:
    """The one pass over the scope's sessions (see the module docs)."""
    assert out.first is not None and out.last is not None
    t0 = out.first.timestamp()
    # A hair wider than span / BUCKETS: the newest session falls in the last bucket, not past it.
    width = max(1.0, (out.last.timestamp() - t0) / BUCKETS * 1.0001)
    b = bucket(SessionRow.created_at, dialect, t0, width).label("b")
    run = run_of().label("run")
    keys: list[Any] = [SessionRow.status, b, SessionRow.trained_version]
    if scope.run is None:
        keys.append(run)
    query = select(
        *keys,
        func.count(),
        func.count(SessionRow.reward),
        func.sum(SessionRow.reward),
        func.min(SessionRow.created_at),
        func.max(SessionRow.created_at),
    ).where(*scope.sessions())
    statuses: dict[str, int] = defaultdict(int)
    total = _Sums()
    by_time: dict[int, _Sums] = defaultdict(_Sums)
    by_version: dict[int, _Sums] = defaultdict(_Sums)
    runs: dict[str | None, dict[str, Any]] = {}
    for row in await conn.execute(query.group_by(*keys)):
        status, index, trained = row[0], row[1], row[2]
        name = row[3] if scope.run is None else scope.run
        n, rewarded, reward, first, last = row[-5:]
        statuses[status] += n
        total.add(n, rewarded, reward)
        by_time[index].add(n, rewarded, reward)
        if trained is not None:
            by_version[trained].add(n, rewarded, reward)
        entry = runs.setdefault(name, {"run": name, "sums": _Sums(), "first": first, "last": last})
        entry["sums"].add(n, rewarded, reward)
        entry["first"], entry["last"] = min(entry["first"], first), max(entry["last"], last)
    out.statuses = dict(statuses)
    out.mean_reward = total.mean
    minutes = width / 60.0
    for index in sorted(by_time):
        s, t = by_time[index], t0 + (index + 0.5) * width
        out.opened_by_time.append((t, s.n / minutes))
        if s.mean is not None:
            out.reward_by_time.append((t, s.mean, s.rewarded))
    out.reward_by_version = [
        (int(v), s.mean, s.rewarded) for v, s in sorted(by_version.items()) if s.mean is not None
    ]
    newest = sorted(runs.values(), key=lambda r: r["last"], reverse=True)[:RUNS_SHOWN]
    out.runs = [
        {
            "run": r["run"],
            "sessions": r["sums"].n,
            "first": r["first"],
            "last": r["last"],
            "reward": r["sums"].mean,
        }  # fmt: skip
        for r in newest
    ]


async def _registry(conn: AsyncConnection, scope: Scope, out: RunFigures) -> None:
    """The policy's pushed versions and held-out scores."""
    table: Any = PolicyVersionRow if scope.policy is None else AdapterVersionRow
    versions = select(table.version, table.created_at, table.path)
    if scope.policy is not None:
        versions = versions.where(AdapterVersionRow.adapter == scope.policy)
    rows = await conn.execute(versions.order_by(table.version.desc()).limit(VERSIONS_SHOWN))
    out.versions = [(int(v), t, p) for v, t, p in rows]
    e = VersionEvalRow
    mine = e.adapter.is_(None) if scope.policy is None else e.adapter == scope.policy
    evals = select(e.name, e.version, e.score).where(mine).order_by(e.version, e.created_at)
    newest: dict[tuple[str, int], float] = {}
    for name, version, score in await conn.execute(evals):
        newest[(name, version)] = score  # the newest score of a version counts
    for (name, version), score in sorted(newest.items()):
        out.evals.setdefault(name, []).append((version, score))


def _recent(scope: Scope, *extra: ColumnElement[bool]) -> Any:
    """The ids of the scope's newest ``RECENT`` sessions (meeting ``extra``), by the time index."""
    return (
        select(SessionRow.id)
        .where(*scope.sessions(), *extra)
        .order_by(SessionRow.created_at.desc())
        .limit(RECENT)
    )


async def _staleness(conn: AsyncConnection, scope: Scope, out: RunFigures) -> None:
    trained = _recent(scope, SessionRow.trained_version.is_not(None)).subquery()
    query = (
        select(SessionRow.trained_version, CompletionRow.output_versions)
        .join(trained, trained.c.id == SessionRow.id)
        .join(CompletionRow, CompletionRow.session_id == SessionRow.id)
    )
    ages: dict[int, list[np.ndarray[Any, Any]]] = defaultdict(list)
    for version, packed in await conn.execute(query):
        if packed and version is not None:
            ages[version].append((version - 1) - np.frombuffer(packed, dtype="<i4"))
    for version in sorted(ages):
        a = np.concatenate(ages[version])
        out.staleness.append((version, float(a.mean()), int(a.max()), int(a.size)))


async def _throughput(conn: AsyncConnection, scope: Scope, out: RunFigures) -> None:
    recent = _recent(scope).subquery()
    query = select(CompletionRow.created_at, func.length(CompletionRow.output_ids)).join(
        recent, recent.c.id == CompletionRow.session_id
    )
    rows = (await conn.execute(query)).all()
    if len(rows) < 2:
        return
    times = np.array([t.timestamp() for t, _ in rows])
    tokens = np.array([n or 0 for _, n in rows], dtype=float) / 4  # int32 ids: 4 bytes each
    t0, t1 = float(times.min()), float(times.max())
    width = max(1.0, (t1 - t0) / RECENT_BUCKETS * 1.0001)
    index = ((times - t0) // width).astype(int)
    counts = np.bincount(index, minlength=RECENT_BUCKETS)
    sums = np.bincount(index, weights=tokens, minlength=RECENT_BUCKETS)
    minutes = width / 60.0
    out.throughput = [
        (t0 + (k + 0.5) * width, float(counts[k] / minutes), float(sums[k] / minutes))
        for k in range(len(counts))
        if counts[k]
    ]


async def run_figures(engine: AsyncEngine, scope: Scope) -> RunFigures:
    """Every figure of the run page (see the module docs)."""
    out = RunFigures()
    async with engine.connect() as conn:
        await _span(conn, scope, out)
        if out.first is not None:
            await _pass(conn, scope, out, engine.dialect.name)
            await _staleness(conn, scope, out)
            await _throughput(conn, scope, out)
        await _registry(conn, scope, out)
    return out
