"""The session list of the inspector: its filters, read from a query string, and one paged SQL
statement over the indexed columns.

A page is one ``SELECT`` (``list_sessions``): the filters, the order, a keyset cursor and
``LIMIT n + 1`` (the extra row says whether there is a next page); each row's number of turns
and the policy version it was opened under are scalar subqueries of the same statement (an
index lookup each), so a page costs one round trip however many rows it shows.

- Order: newest first (``new``, the default), oldest first (``old``), or by reward (``reward``:
  highest first, ``reward_asc``: lowest; only rewarded sessions). Ties break on the id, so the
  order is total and the keyset cursor (``after``: the last row's sort value and id) is exact.
  The time orders walk ``ix_sessions_created_at_id`` (migration 0007).
- ``version``: sessions opened while ``v`` was their policy's newest version (pushed at ``t_v``,
  next push at ``t_next``): ``t_v <= created_at < t_next``, a range of the same index. The
  policy is the ``adapter`` filter's (the base when none is chosen).
- ``run``: the rollout pass that opened the session (``metadata.rollout``, the tag the rollout
  controller gives every session of one pass; its groups end in ``@<run>``).

Bad values raise ``FilterError`` naming the field: the page answers 400 with the form, never 500.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, cast

from proxima.proxy.policies.adapters import check_adapter
from proxima.proxy.store.models import (
    AdapterVersionRow,
    CompletionRow,
    PolicyVersionRow,
    SessionRow,
    UTCDateTime,
)
from proxima.proxy.store.records import SessionKind, SessionStatus
from sqlalchemy import ColumnElement, Select, case, func, literal, select, tuple_
from sqlalchemy.ext.asyncio import AsyncEngine

BASE = ":base"
"""The ``adapter`` filter's value for the base model (no adapter name can start with ``:``)."""
SORTS = ("new", "old", "reward", "reward_asc")
PAGE_SIZES = (20, 50, 100, 200)
DEFAULT_PAGE = 50
_FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)
_MAX_TEXT = 200


class FilterError(ValueError):
    """A query-string value the inspector cannot use; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a page starts: after the row with this sort value and id."""

    value: datetime | float
    id: str

    def encode(self) -> str:
        value = self.value.isoformat() if isinstance(self.value, datetime) else repr(self.value)
        return f"{value}~{self.id}"


@dataclass(frozen=True, slots=True)
class SessionFilter:
    """What the session list shows; every field optional but ``sort`` and ``limit``."""

    run: str | None = None
    group: str | None = None
    adapter: str | None = None  # None: any policy; BASE: the base; else an adapter's name
    status: str | None = None
    kind: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    version: int | None = None
    since: datetime | None = None
    until: datetime | None = None
    sort: str = "new"
    limit: int = DEFAULT_PAGE
    after: Cursor | None = None

    @property
    def policy(self) -> str | None:
        """The adapter whose versions ``version`` counts (None: the base)."""
        return None if self.adapter in (None, BASE) else self.adapter

    def query(self, **changes: Any) -> dict[str, str]:
        """This filter as query-string parameters (defaults left out), with ``changes``."""
        f = replace(self, **changes)
        out: dict[str, str] = {}
        for name in ("run", "group", "adapter", "status", "kind"):
            if getattr(f, name) is not None:
                out[name] = str(getattr(f, name))
        for name in ("reward_min", "reward_max", "version"):
            if getattr(f, name) is not None:
                out[name] = repr(getattr(f, name))
        for name in ("since", "until"):
            value = getattr(f, name)
            if value is not None:
                out[name] = value.strftime("%Y-%m-%dT%H:%M:%S")
        if f.sort != "new":
            out["sort"] = f.sort
        if f.limit != DEFAULT_PAGE:
            out["limit"] = str(f.limit)
        if f.after is not None:
            out["after"] = f.after.encode()
        return out


def _text(params: dict[str, str], name: str) -> str | None:
    value = params.get(name, "").strip()
    if not value:
        return None
    if len(value) > _MAX_TEXT or "\x00" in value:
        raise FilterError(name, f"at most {_MAX_TEXT} characters, no NUL")
    return value


def _number(params: dict[str, str], name: str) -> float | None:
    value = _text(params, name)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        raise FilterError(name, f"{value!r} is not a number") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise FilterError(name, "must be a finite number")
    return number


def _time(params: dict[str, str], name: str) -> datetime | None:
    value = _text(params, name)
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise FilterError(name, f"{value!r} is not a date and time (YYYY-MM-DDTHH:MM)") from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _choice(params: dict[str, str], name: str, allowed: tuple[str, ...]) -> str | None:
    value = _text(params, name)
    if value is not None and value not in allowed:
        raise FilterError(name, f"{value!r} is not one of {', '.join(allowed)}")
    return value


def _cursor(value: str | None, sort: str) -> Cursor | None:
    if value is None:
        return None
    raw, _, sid = value.rpartition("~")
    if not raw or not sid or len(sid) > 64:
        raise FilterError("after", "not a cursor of this list")
    try:
        if sort in ("new", "old"):
            when = datetime.fromisoformat(raw)
            return Cursor(when if when.tzinfo else when.replace(tzinfo=UTC), sid)
        return Cursor(float(raw), sid)
    except ValueError:
        raise FilterError("after", "not a cursor of this list") from None


def parse_filter(params: dict[str, str]) -> SessionFilter:
    """The filter of a query string (``FilterError`` for a value it cannot use)."""
    adapter = _text(params, "adapter")
    if adapter is not None and adapter != BASE:
        try:
            check_adapter(adapter)
        except ValueError as exc:
            raise FilterError("adapter", str(exc)) from None
    version = _number(params, "version")
    if version is not None and (version != int(version) or not 0 <= version < 2**31):
        raise FilterError("version", "a policy version is a whole number from 0")
    limit = _number(params, "limit")
    if limit is not None and int(limit) not in PAGE_SIZES:
        raise FilterError("limit", f"one of {', '.join(map(str, PAGE_SIZES))}")
    sort = _choice(params, "sort", SORTS) or "new"
    reward_min, reward_max = _number(params, "reward_min"), _number(params, "reward_max")
    if reward_min is not None and reward_max is not None and reward_min > reward_max:
        raise FilterError("reward_max", "below reward_min")
    return SessionFilter(
        run=_text(params, "run"),
        group=_text(params, "group"),
        adapter=adapter,
        status=_choice(params, "status", tuple(s.value for s in SessionStatus)),
        kind=_choice(params, "kind", tuple(k.value for k in SessionKind)),
        reward_min=reward_min,
        reward_max=reward_max,
        version=None if version is None else int(version),
        since=_time(params, "since"),
        until=_time(params, "until"),
        sort=sort,
        limit=DEFAULT_PAGE if limit is None else int(limit),
        after=_cursor(_text(params, "after"), sort),
    )


def run_of() -> ColumnElement[Any]:
    """The run (rollout pass) a session belongs to: ``metadata.rollout``."""
    return cast(ColumnElement[Any], SessionRow.metadata_["rollout"].as_string())


def of_adapter(adapter: str | None) -> ColumnElement[bool] | None:
    """The condition of the ``adapter`` filter (None: no condition)."""
    if adapter is None:
        return None
    if adapter == BASE:
        # Not ``adapter IS NULL``: most sessions are the base's, and SQLite, which keeps no
        # statistics, would read them all through ix_sessions_adapter_status and sort them,
        # where walking the time index in order and skipping the adapters' stops at a page.
        return func.coalesce(SessionRow.adapter, "") == ""
    return SessionRow.adapter == adapter


def opened_version() -> ColumnElement[Any]:
    """The version of its policy that was newest when the session opened (0: none pushed).

    The newest version pushed at or before the session: read down the version key from the
    top, which stops at the first match (versions are pushed in order)."""
    base = (
        select(PolicyVersionRow.version)
        .where(PolicyVersionRow.created_at <= SessionRow.created_at)
        .order_by(PolicyVersionRow.version.desc())
        .limit(1)
        .scalar_subquery()
    )
    adapter = (
        select(AdapterVersionRow.version)
        .where(
            AdapterVersionRow.adapter == SessionRow.adapter,
            AdapterVersionRow.created_at <= SessionRow.created_at,
        )
        .order_by(AdapterVersionRow.version.desc())
        .limit(1)
        .scalar_subquery()
    )
    return func.coalesce(case((SessionRow.adapter.is_(None), base), else_=adapter), 0)


def _version_range(version: int, policy: str | None) -> list[ColumnElement[bool]]:
    """Opened while ``version`` was the newest of ``policy``: a range of ``created_at``."""
    if policy is None:
        table: Any = PolicyVersionRow
        mine: list[ColumnElement[bool]] = []
    else:
        table = AdapterVersionRow
        mine = [AdapterVersionRow.adapter == policy]
    later = select(func.min(table.created_at)).where(table.version > version, *mine)
    far = literal(_FAR_FUTURE, UTCDateTime())
    conds = [SessionRow.created_at < func.coalesce(later.scalar_subquery(), far)]
    if version > 0:
        pushed = select(table.created_at).where(table.version == version, *mine)
        conds.append(SessionRow.created_at >= pushed.scalar_subquery())
    return conds


def conditions(f: SessionFilter) -> list[ColumnElement[bool]]:
    """The WHERE conditions of ``f`` (the cursor's excluded)."""
    out: list[ColumnElement[bool]] = []
    if f.run is not None:
        out.append(run_of() == f.run)
    if f.group is not None:
        out.append(SessionRow.group_id == f.group)
    adapter = of_adapter(BASE if f.version is not None and f.adapter is None else f.adapter)
    if adapter is not None:
        out.append(adapter)
    if f.status is not None:
        out.append(SessionRow.status == f.status)
    if f.kind is not None:
        out.append(SessionRow.kind == f.kind)
    if f.reward_min is not None:
        out.append(SessionRow.reward >= f.reward_min)
    if f.reward_max is not None:
        out.append(SessionRow.reward <= f.reward_max)
    if f.since is not None:
        out.append(SessionRow.created_at >= f.since)
    if f.until is not None:
        out.append(SessionRow.created_at < f.until)
    if f.version is not None:
        out.extend(_version_range(f.version, f.policy))
    if f.sort in ("reward", "reward_asc"):
        out.append(SessionRow.reward.is_not(None))
    return out


@dataclass(frozen=True, slots=True)
class SessionItem:
    """One row of the list."""

    id: str
    kind: str
    status: str
    group_id: str | None
    data_id: str | None
    run: str | None
    adapter: str | None
    reward: float | None
    created_at: datetime
    finished_at: datetime | None
    trained_version: int | None
    opened_version: int
    turns: int


@dataclass(frozen=True, slots=True)
class SessionPage:
    items: list[SessionItem]
    next: Cursor | None  # where the next page starts; None on the last page


def page_statement(f: SessionFilter) -> Select[Any]:
    """The one statement of a page of ``f``.

    Its inner query picks the page (filters, cursor, order, ``LIMIT``) from the indexed
    columns alone; the outer one adds, for those rows only, their run, turns and version (the
    database would otherwise work out those subqueries for every row it sorts)."""
    by_reward = f.sort in ("reward", "reward_asc")
    key = SessionRow.reward if by_reward else SessionRow.created_at
    descending = f.sort in ("new", "reward")
    inner = select(SessionRow.id, key.label("k")).where(*conditions(f))
    if f.after is not None:
        row, mark = tuple_(key, SessionRow.id), tuple_(literal(f.after.value, key.type), f.after.id)
        inner = inner.where(row < mark if descending else row > mark)
    order = (key.desc(), SessionRow.id.desc()) if descending else (key.asc(), SessionRow.id.asc())
    page = inner.order_by(*order).limit(f.limit + 1).subquery("page")
    turns = (
        select(func.count())
        .select_from(CompletionRow)
        .where(CompletionRow.session_id == SessionRow.id)
        .scalar_subquery()
    )
    outer = (page.c.k.desc(), page.c.id.desc()) if descending else (page.c.k.asc(), page.c.id.asc())
    return (
        select(
            SessionRow.id,
            SessionRow.kind,
            SessionRow.status,
            SessionRow.group_id,
            SessionRow.data_id,
            run_of().label("run"),
            SessionRow.adapter,
            SessionRow.reward,
            SessionRow.created_at,
            SessionRow.finished_at,
            SessionRow.trained_version,
            opened_version().label("opened_version"),
            turns.label("turns"),
        )
        .join(page, page.c.id == SessionRow.id)
        .order_by(*outer)
    )


async def list_sessions(engine: AsyncEngine, f: SessionFilter) -> SessionPage:
    """One page of the sessions ``f`` selects, in its order."""
    async with engine.connect() as conn:
        rows = (await conn.execute(page_statement(f))).all()
    items = [SessionItem(**row._mapping) for row in rows[: f.limit]]
    following = None
    if len(rows) > f.limit:
        last = items[-1]
        value = last.reward if f.sort in ("reward", "reward_asc") else last.created_at
        assert value is not None  # reward orders list rewarded sessions only
        following = Cursor(value, last.id)
    return SessionPage(items, following)
