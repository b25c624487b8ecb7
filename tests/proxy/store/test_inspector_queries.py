"""The inspector's SQL on SQLite and PostgreSQL: every filter, order and page of the session
list against an independent reading of the same rows, and the run page's figures.

The store holds a synthetic history (``proxy/testing/inspector_store.py``); the expected
answer of each filter is computed here in Python from every session row and the version
timeline, so the statements of ``proxy/inspector/queries.py`` are checked, not restated.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from proxima.proxy.inspector.queries import (
    BASE,
    FilterError,
    SessionFilter,
    list_sessions,
    parse_filter,
    run_of,
)
from proxima.proxy.inspector.run_view import BUCKETS, Scope, run_figures
from proxima.proxy.store import Store
from proxima.proxy.store.models import AdapterVersionRow, PolicyVersionRow, SessionRow
from proxima.proxy.testing.inspector_store import ADAPTER, START, fill_store
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

SESSIONS = 400  # 6 versions of 64, two runs, every 10th group on the adapter


async def everything(engine: AsyncEngine) -> tuple[list[dict[str, Any]], dict[str | None, list[tuple[int, datetime]]]]:  # fmt: skip
    """Every session row, and each policy's (version, pushed at) timeline."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(
                    SessionRow.id,
                    SessionRow.status,
                    SessionRow.kind,
                    SessionRow.group_id,
                    run_of().label("run"),
                    SessionRow.adapter,
                    SessionRow.reward,
                    SessionRow.created_at,
                )  # fmt: skip
            )
        ).all()
        base = (
            await conn.execute(select(PolicyVersionRow.version, PolicyVersionRow.created_at))
        ).all()
        adapters = (
            await conn.execute(
                select(AdapterVersionRow.adapter, AdapterVersionRow.version, AdapterVersionRow.created_at)
            )
        ).all()  # fmt: skip
    timeline: dict[str | None, list[tuple[int, datetime]]] = {None: [(v, t) for v, t in base]}
    for name, v, t in adapters:
        timeline.setdefault(name, []).append((v, t))
    return [dict(r._mapping) for r in rows], timeline


def opened_under(
    row: dict[str, Any], timeline: dict[str | None, list[tuple[int, datetime]]]
) -> int:
    pushed = [v for v, t in timeline.get(row["adapter"], []) if t <= row["created_at"]]
    return max(pushed, default=0)


def expected(rows: list[dict[str, Any]], timeline: dict[str | None, list[tuple[int, datetime]]],
             f: SessionFilter) -> list[str]:  # fmt: skip
    """The ids ``f`` selects, in its order: the filter's meaning, written out in Python."""
    adapter = BASE if f.version is not None and f.adapter is None else f.adapter

    def keep(r: dict[str, Any]) -> bool:
        return (
            (f.run is None or r["run"] == f.run)
            and (f.group is None or r["group_id"] == f.group)
            and (adapter is None or r["adapter"] == (None if adapter == BASE else adapter))
            and (f.status is None or r["status"] == f.status)
            and (f.kind is None or r["kind"] == f.kind)
            and (f.reward_min is None or (r["reward"] is not None and r["reward"] >= f.reward_min))
            and (f.reward_max is None or (r["reward"] is not None and r["reward"] <= f.reward_max))
            and (f.since is None or r["created_at"] >= f.since)
            and (f.until is None or r["created_at"] < f.until)
            and (f.version is None or opened_under(r, timeline) == f.version)
            and (f.sort not in ("reward", "reward_asc") or r["reward"] is not None)
        )

    key = "reward" if f.sort in ("reward", "reward_asc") else "created_at"
    chosen = sorted((r for r in rows if keep(r)), key=lambda r: (r[key], r["id"]))
    if f.sort in ("new", "reward"):
        chosen.reverse()
    return [r["id"] for r in chosen]


async def walk(engine: AsyncEngine, f: SessionFilter, pages: int = 100) -> list[str]:
    """Every id the list shows for ``f``, page after page (at most ``pages``)."""
    ids: list[str] = []
    for _ in range(pages):
        page = await list_sessions(engine, f)
        assert len(page.items) <= f.limit
        ids += [item.id for item in page.items]
        if page.next is None:
            return ids
        assert len(page.items) == f.limit  # only the last page is short
        f = replace(f, after=page.next)
    return ids


@pytest.fixture
async def filled(store: Store) -> Store:
    await fill_store(store.engine, SESSIONS)
    return store


FILTERS = [
    {},
    {"sort": "old", "limit": "20"},
    {"sort": "reward", "limit": "20"},
    {"sort": "reward_asc", "limit": "100"},
    {"run": "run1"},
    {"group": "item17@run0"},
    {"adapter": ADAPTER},
    {"adapter": BASE, "status": "trained", "sort": "old"},
    {"status": "open"},
    {"kind": "production"},
    {"reward_min": "1", "limit": "20"},
    {"reward_max": "0.5", "reward_min": "0"},
    {"version": "0"},
    {"version": "3", "limit": "20"},
    {"version": "5"},  # the newest: open-ended
    {"version": "2", "adapter": ADAPTER},
    {"version": "9"},  # never pushed: nothing
    {"since": (START + timedelta(seconds=100)).isoformat(), "until": "2026-01-01T00:03:00"},
    {"run": "run0", "status": "trained", "reward_min": "1", "sort": "reward"},
]


async def test_every_filter_and_order_pages_through_exactly_the_matching_sessions(
    filled: Store,
) -> None:
    rows, timeline = await everything(filled.engine)
    for params in FILTERS:  # one store for all of them: filling it is the slow part
        f = parse_filter(params)
        want = expected(rows, timeline, f)
        assert await walk(filled.engine, f) == want, params
        if params.get("version") == "3":
            assert len(want) > f.limit  # the version filter pages too
    assert expected(rows, timeline, parse_filter({"version": "9"})) == []
    assert len(expected(rows, timeline, parse_filter({"group": "item17@run0"}))) == 4


async def test_each_row_carries_its_version_and_turns(filled: Store) -> None:
    rows, timeline = await everything(filled.engine)
    by_id = {r["id"]: r for r in rows}
    page = await list_sessions(filled.engine, parse_filter({"limit": "200", "sort": "old"}))
    assert len(page.items) == 200
    for item in page.items:
        assert item.opened_version == opened_under(by_id[item.id], timeline)
        assert item.turns == 3
        assert item.run == by_id[item.id]["run"]


def test_bad_values_name_their_field() -> None:
    for params, field in [
        ({"reward_min": "lots"}, "reward_min"),
        ({"reward_min": "nan"}, "reward_min"),
        ({"reward_min": "2", "reward_max": "1"}, "reward_max"),
        ({"version": "-1"}, "version"),
        ({"version": "1.5"}, "version"),
        ({"status": "happy"}, "status"),
        ({"sort": "random"}, "sort"),
        ({"limit": "7"}, "limit"),
        ({"since": "yesterday"}, "since"),
        ({"adapter": "Not An Adapter"}, "adapter"),
        ({"after": "no-cursor"}, "after"),
        ({"after": "soon~s1"}, "after"),
        ({"group": "x" * 201}, "group"),
    ]:
        with pytest.raises(FilterError) as caught:
            parse_filter(params)
        assert caught.value.field == field, params


async def test_the_run_figures_agree_with_the_rows(filled: Store) -> None:
    rows, _ = await everything(filled.engine)
    mine = [r for r in rows if r["run"] == "run1" and r["adapter"] is None]
    fig = await run_figures(filled.engine, Scope("run1", BASE))
    assert fig.total == len(mine)
    assert fig.statuses == {
        s: sum(r["status"] == s for r in mine) for s in {r["status"] for r in mine}
    }
    rewarded = [r["reward"] for r in mine if r["reward"] is not None]
    assert fig.mean_reward == pytest.approx(sum(rewarded) / len(rewarded))
    assert sum(n for _, _, n in fig.reward_by_time) == len(rewarded)
    assert 0 < len(fig.reward_by_time) <= BUCKETS
    # Every trained session's tokens are one version old (the fill trains two versions on).
    assert fig.staleness and all(0 <= mean <= 1 and top == 1 for _, mean, top, _ in fig.staleness)
    assert [v for v, _, _ in fig.versions] == sorted({v for v, _, _ in fig.versions}, reverse=True)
    assert fig.evals["held-out"][0][0] == 0
    assert sum(c for _, c, _ in fig.throughput) > 0
    assert [r["run"] for r in fig.runs] == ["run1"]
    adapter = await run_figures(filled.engine, Scope(None, ADAPTER))
    assert adapter.total == sum(r["adapter"] == ADAPTER for r in rows)
    assert {r["run"]: r["sessions"] for r in adapter.runs} == {
        run: sum(r["adapter"] == ADAPTER and r["run"] == run for r in rows)
        for run in ("run0", "run1")
    }
    assert (await run_figures(filled.engine, Scope("no-such-run", BASE))).total == 0
