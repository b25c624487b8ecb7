"""Completions store what they add to their parent, not their whole prompt and messages.

Every completion of an agent session used to store its whole ``prompt_ids`` and its
whole request message list: O(turns x context) per session. A row now stores the
prompt tokens after its parent's ``prompt_ids + output_ids`` (``prompt_prefix`` says
how many tokens were the parent's), the request messages after its parent's request
messages and reply (``messages_prefix``), and no tools when they are the parent's
(``tools_from_parent``); the store rebuilds whole prompts on read
(``proxima.proxy.store.chains``).

Upgrade adds the three columns (0 / false: a row that stores everything, as before)
and converts existing rows session by session; downgrade writes whole prompts,
messages and tools back and drops the columns.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 22:40:00
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from proxima.proxy.store.chains import rebuild, resolve_all, split
from proxima.proxy.store.codec import decode_int32, encode_int32
from proxima.proxy.store.records import CompletionRecord

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


def upgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        for name in ("prompt_prefix", "messages_prefix"):
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(
            sa.Column("tools_from_parent", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    bind = op.get_bind()
    for session_id in _session_ids(bind):
        records = {r.id: r for r in _whole_records(bind, session_id)}
        for record in records.values():
            if record.parent_id is None:
                continue
            stored = split(record, records.get(record.parent_id))
            if stored.prompt_prefix or stored.messages_prefix or stored.tools_from_parent:
                bind.execute(
                    _completions.update()
                    .where(_c.id == record.id)
                    .values(
                        prompt_prefix=stored.prompt_prefix,
                        prompt_ids=encode_int32(stored.prompt_ids),
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

        def record_of(
            cid: str, parent: CompletionRecord | None, rows: dict[str, Any] = by_id
        ) -> CompletionRecord:
            return _record(rows[cid], parent)

        built = resolve_all(
            list(by_id), {cid: row["parent_id"] for cid, row in by_id.items()}, record_of
        )
        for cid, row in by_id.items():
            if row["prompt_prefix"] or row["messages_prefix"] or row["tools_from_parent"]:
                record = built[cid]
                bind.execute(
                    _completions.update()
                    .where(_c.id == cid)
                    .values(
                        prompt_ids=encode_int32(record.prompt_ids),
                        request_messages=record.request_messages,
                        request_tools=record.request_tools,
                    )
                )
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("tools_from_parent")
        batch.drop_column("messages_prefix")
        batch.drop_column("prompt_prefix")


def _session_ids(bind: sa.Connection) -> list[str]:
    return list(bind.execute(sa.select(_c.session_id).distinct()).scalars())


def _whole_records(bind: sa.Connection, session_id: str) -> list[CompletionRecord]:
    """The session's rows as they are before the upgrade: every row whole."""
    rows = bind.execute(sa.select(_completions).where(_c.session_id == session_id)).mappings()
    return [_record(row, None) for row in rows]


def _record(row: Any, parent: CompletionRecord | None) -> CompletionRecord:
    """The fields of a row that ``split`` and ``rebuild`` use, as a record."""
    prompt_ids, request_messages, request_tools = rebuild(
        parent,
        completion_id=row["id"],
        prompt_prefix=row["prompt_prefix"],
        prompt_ids=decode_int32(row["prompt_ids"]),
        messages_prefix=row["messages_prefix"],
        request_messages=row["request_messages"],
        tools_from_parent=bool(row["tools_from_parent"]),
        request_tools=row["request_tools"],
    )
    return CompletionRecord(
        id=row["id"],
        session_id=row["session_id"],
        parent_id=row["parent_id"],
        prompt_ids=prompt_ids,
        output_ids=decode_int32(row["output_ids"]),
        output_logprobs=[],
        output_versions=[],
        finish_reason="",
        created_at=None,  # type: ignore[arg-type]  # not read by split or rebuild
        request_messages=request_messages,
        request_tools=request_tools,
        response_message=row["response_message"],
    )
