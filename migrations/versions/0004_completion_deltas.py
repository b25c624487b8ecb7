"""Completions store what they add to their parent, not their whole prompt and messages.

Every completion of an agent session used to store its whole ``prompt_ids`` and its
whole request message list: O(turns x context) per session. A row now stores the
prompt tokens after its parent's ``prompt_ids + output_ids`` (``prompt_prefix`` says
how many tokens were the parent's), the request messages after its parent's request
messages and reply (``messages_prefix``), and no tools when they are the parent's
(``tools_from_parent``); the store rebuilds whole prompts on read.

This file carries its own copy of the rules it applies (how a row is split against its
parent, how it is rebuilt, the int32 token encoding), frozen as they were when it was
written: a migration must keep doing what it did when the store's code changes, so it
imports nothing from ``proxima``.

Upgrade adds the three columns (0 / false: a row that stores everything, as before)
and converts existing rows session by session; downgrade writes whole prompts,
messages and tools back and drops the columns.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 22:40:00
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import orjson
import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The columns this migration reads and writes, with the types that encode them.
_completions = sa.table(
    "completions",
    sa.column("id", sa.String()),
    sa.column("session_id", sa.String()),
    sa.column("parent_id", sa.String()),
    sa.column("prompt_prefix", sa.Integer()),
    sa.column("prompt_ids", sa.LargeBinary()),
    sa.column("output_ids", sa.LargeBinary()),
    sa.column("messages_prefix", sa.Integer()),
    sa.column("tools_from_parent", sa.Boolean()),
    sa.column("request_messages", sa.JSON()),
    sa.column("request_tools", sa.JSON()),
    sa.column("response_message", sa.JSON()),
)
_c = _completions.c

Messages = list[dict[str, Any]]


class _Whole(NamedTuple):
    """A completion's fields this migration uses, with its whole prompt, messages, tools."""

    id: str
    session_id: str
    parent_id: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    request_messages: Messages | None
    request_tools: Messages | None
    response_message: dict[str, Any] | None


class _Stored(NamedTuple):
    """What a row stores of its prompt, messages and tools against its parent."""

    prompt_prefix: int
    prompt_ids: list[int]
    messages_prefix: int
    request_messages: Messages | None
    tools_from_parent: bool
    request_tools: Messages | None


def upgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        for name in ("prompt_prefix", "messages_prefix"):
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(
            sa.Column("tools_from_parent", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    bind = op.get_bind()
    for session_id in _session_ids(bind):
        rows = bind.execute(sa.select(_completions).where(_c.session_id == session_id)).mappings()
        wholes = {w.id: w for w in (_whole(row, None) for row in rows)}  # all whole before
        for whole in wholes.values():
            if whole.parent_id is None:
                continue
            stored = _split(whole, wholes.get(whole.parent_id))
            if stored.prompt_prefix or stored.messages_prefix or stored.tools_from_parent:
                bind.execute(
                    _completions.update()
                    .where(_c.id == whole.id)
                    .values(
                        prompt_prefix=stored.prompt_prefix,
                        prompt_ids=_encode_int32(stored.prompt_ids),
                        messages_prefix=stored.messages_prefix,
                        request_messages=stored.request_messages,
                        tools_from_parent=stored.tools_from_parent,
                        request_tools=stored.request_tools,
                    )
                )


def downgrade() -> None:
    bind = op.get_bind()
    for session_id in _session_ids(bind):
        rows = bind.execute(sa.select(_completions).where(_c.session_id == session_id)).mappings()
        by_id = {row["id"]: row for row in rows}

        def whole_of(cid: str, parent: _Whole | None, rows: dict[str, Any] = by_id) -> _Whole:
            return _whole(rows[cid], parent)

        built = _resolve_all(
            list(by_id), {cid: row["parent_id"] for cid, row in by_id.items()}, whole_of
        )
        for cid, row in by_id.items():
            if row["prompt_prefix"] or row["messages_prefix"] or row["tools_from_parent"]:
                whole = built[cid]
                bind.execute(
                    _completions.update()
                    .where(_c.id == cid)
                    .values(
                        prompt_ids=_encode_int32(whole.prompt_ids),
                        request_messages=whole.request_messages,
                        request_tools=whole.request_tools,
                    )
                )
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("tools_from_parent")
        batch.drop_column("messages_prefix")
        batch.drop_column("prompt_prefix")


def _session_ids(bind: sa.Connection) -> list[str]:
    return list(bind.execute(sa.select(_c.session_id).distinct()).scalars())


def _whole(row: sa.RowMapping, parent: _Whole | None) -> _Whole:
    """A row with its prefixes filled in from ``parent`` (a row without prefixes is whole).

    Raises ``RuntimeError`` when the row needs a parent it does not have."""
    cid: str = row["id"]
    prompt_ids = _decode_int32(row["prompt_ids"])
    request_messages: Messages | None = row["request_messages"]
    request_tools: Messages | None = row["request_tools"]
    prompt_prefix: int = row["prompt_prefix"] or 0
    messages_prefix: int = row["messages_prefix"] or 0
    tools_from_parent = bool(row["tools_from_parent"])
    if prompt_prefix or messages_prefix or tools_from_parent:
        if parent is None:
            raise RuntimeError(f"completion {cid} is stored against a parent that is missing")
        if prompt_prefix:
            prompt_ids = _prompt_head(cid, parent, prompt_prefix) + prompt_ids
        if messages_prefix:
            previous = _chat_sequence(parent)
            if messages_prefix > len(previous):
                raise RuntimeError(f"completion {cid}: messages prefix longer than its parent")
            request_messages = [*previous[:messages_prefix], *(request_messages or [])]
        if tools_from_parent:
            request_tools = parent.request_tools
    return _Whole(
        id=cid,
        session_id=row["session_id"],
        parent_id=row["parent_id"],
        prompt_ids=prompt_ids,
        output_ids=_decode_int32(row["output_ids"]),
        request_messages=request_messages,
        request_tools=request_tools,
        response_message=row["response_message"],
    )


def _prompt_head(cid: str, parent: _Whole, prompt_prefix: int) -> list[int]:
    """The first ``prompt_prefix`` tokens of the parent's ``prompt_ids + output_ids``."""
    n_head = len(parent.prompt_ids)
    if prompt_prefix > n_head + len(parent.output_ids):
        raise RuntimeError(f"completion {cid}: prompt prefix longer than its parent")
    if prompt_prefix <= n_head:
        return parent.prompt_ids[:prompt_prefix]
    return [*parent.prompt_ids, *parent.output_ids[: prompt_prefix - n_head]]


def _split(whole: _Whole, parent: _Whole | None) -> _Stored:
    """``whole``'s stored form against ``parent`` (its parent of the same session, or None):
    a prefix is taken only when it is exactly the parent's."""
    if parent is None or parent.id != whole.parent_id or parent.session_id != whole.session_id:
        return _Stored(0, whole.prompt_ids, 0, whole.request_messages, False, whole.request_tools)
    prompt = whole.prompt_ids
    head, out = parent.prompt_ids, parent.output_ids
    n_head, n_seq = len(head), len(head) + len(out)
    prompt_prefix = 0
    if len(prompt) >= n_seq and prompt[:n_head] == head and prompt[n_head:n_seq] == out:
        prompt_prefix = n_seq
    messages_prefix = 0
    request = whole.request_messages
    if request is not None:
        previous = _chat_sequence(parent)
        limit = min(len(previous), len(request))
        if _identical(request[:limit], previous[:limit]):  # a turn extending its parent
            messages_prefix = limit
        else:
            while messages_prefix < limit and _identical(
                request[messages_prefix], previous[messages_prefix]
            ):
                messages_prefix += 1
    tools_from_parent = whole.request_tools is not None and _identical(
        whole.request_tools, parent.request_tools
    )
    return _Stored(
        prompt_prefix,
        prompt[prompt_prefix:] if prompt_prefix else prompt,
        messages_prefix,
        request[messages_prefix:] if request is not None and messages_prefix else request,
        tools_from_parent,
        None if tools_from_parent else whole.request_tools,
    )


def _chat_sequence(whole: _Whole) -> Messages:
    """The parent's messages a child's request may start with: request, then reply."""
    if whole.request_messages is None:
        return []
    if whole.response_message is None:
        return list(whole.request_messages)
    return [*whole.request_messages, whole.response_message]


def _identical(a: Any, b: Any) -> bool:
    """Equal JSON values that also serialize alike: same types (``1`` is not ``1.0`` or
    ``True``) and the same key order."""
    if a is b:
        return True
    try:
        return bool(a == b) and orjson.dumps(a) == orjson.dumps(b)
    except TypeError:  # orjson.JSONEncodeError included: compared field by field
        return _identical_fields(a, b)


def _identical_fields(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            ka == kb and _identical_fields(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_identical_fields(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _resolve_all(
    ids: list[str],
    parent_of: Mapping[str, str | None],
    build: Callable[[str, _Whole | None], _Whole],
) -> dict[str, _Whole]:
    """Every id built after its parent (``build(id, parent)``); a parent outside
    ``parent_of`` is given as None."""
    done: dict[str, _Whole] = {}
    for start in ids:
        if start in done:
            continue
        chain = [start]  # ancestors not yet built, nearest last
        seen = {start}
        while True:
            parent_id = parent_of.get(chain[-1])
            if parent_id is None or parent_id in done or parent_id not in parent_of:
                break
            if parent_id in seen:
                raise RuntimeError(f"completion {start}: its parents form a cycle")
            chain.append(parent_id)
            seen.add(parent_id)
        for cid in reversed(chain):
            parent_id = parent_of.get(cid)
            done[cid] = build(cid, done.get(parent_id) if parent_id is not None else None)
    return done


def _encode_int32(values: Sequence[int]) -> bytes:
    """Token ids as the store keeps them: little-endian int32."""
    return struct.pack(f"<{len(values)}i", *values)


def _decode_int32(data: bytes | None) -> list[int]:
    if not data:
        return []
    return list(struct.unpack(f"<{len(data) // 4}i", data))
