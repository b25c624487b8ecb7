"""Completions stored as what they add to their parent: reads give back whole records.

Every test reads back exactly the records that were recorded (``==`` compares every
field: whole prompt ids, request messages, tools), on SQLite and PostgreSQL, and
checks in the rows themselves that only the new part was stored.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from proxima.proxy.store import Store, migrate
from proxima.proxy.store.chains import identical
from proxima.proxy.store.codec import decode_int32, encode_float32, encode_int32
from proxima.proxy.store.database import create_engine
from proxima.proxy.store.models import UTCDateTime
from proxima.proxy.store.records import CompletionRecord
from sqlalchemy import text

from tests.proxy.store.factories import completion, key_hash

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


def _turn(
    session_id: str,
    parent: CompletionRecord | None,
    new_messages: list[dict[str, Any]],
    new_ids: list[int],
    *,
    seconds: float,
    reply: str,
    tools: list[dict[str, Any]] | None = TOOLS,
    **fields: Any,
) -> CompletionRecord:
    """A completion extending ``parent`` as the proxy builds one: parent prompt + output +
    the new messages' ids; parent request + reply + the new messages."""
    if parent is None:
        prompt, messages = list(new_ids), list(new_messages)
    else:
        assert parent.request_messages is not None and parent.response_message is not None
        prompt = [*parent.prompt_ids, *parent.output_ids, *new_ids]
        messages = [*parent.request_messages, parent.response_message, *new_messages]
    out = [100 + int(seconds), 101, 102]
    values: dict[str, Any] = {
        "parent_id": None if parent is None else parent.id,
        "prompt_ids": prompt,
        "output_ids": out,
        "output_logprobs": [-0.5] * 3,
        "output_versions": [1] * 3,
        "request_messages": messages,
        "request_tools": None if tools is None else [dict(t) for t in tools],
        "response_message": {"role": "assistant", "content": reply},
        "response_text": reply,
        "seconds": seconds,
    }
    values.update(fields)
    return completion(session_id, **values)


async def _stored(db_url: str, completion_id: str) -> dict[str, Any]:
    engine = create_engine(db_url)
    try:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT prompt_prefix, prompt_ids, messages_prefix, request_messages, "
                        "tools_from_parent, request_tools FROM completions WHERE id = :id"
                    ),
                    {"id": completion_id},
                )
            ).one()
    finally:
        await engine.dispose()
    return {
        "prompt_prefix": row[0],
        "prompt_ids": decode_int32(row[1]),
        "messages_prefix": row[2],
        "request_messages": _json(row[3]),
        "tools_from_parent": bool(row[4]),
        "request_tools": _json(row[5]),
    }


def _json(value: Any) -> Any:
    """A JSON column read by raw SQL: text on SQLite, decoded on PostgreSQL."""
    return json.loads(value) if isinstance(value, str) else value


async def test_a_chain_stores_each_turns_new_part_and_reads_back_whole(
    store: Store, db_url: str
) -> None:
    session = await store.create_session(api_key_hash=key_hash())
    recorded: list[CompletionRecord] = []
    parent = None
    for turn in range(6):
        message = {"role": "user", "content": f"tool output {turn} " * 20}
        c = _turn(
            session.id,
            parent,
            [message],
            list(range(turn, turn + 50)),
            seconds=turn,
            reply=f"r{turn}",
        )
        # The proxy hands the parent in; the first two turns leave the store to read it.
        parents = {parent.id: parent} if parent is not None and turn >= 2 else None
        await store.record_completions(completions=[c], parents=parents)
        recorded.append(c)
        parent = c
    assert await store.list_completions(session_id=session.id) == recorded
    for c in recorded:
        assert await store.get_completion(completion_id=c.id) == c
    last = recorded[-1]
    row = await _stored(db_url, last.id)
    parent = recorded[-2]
    assert row["prompt_prefix"] == len(parent.prompt_ids) + len(parent.output_ids)
    assert row["prompt_ids"] == list(range(5, 55))
    assert row["messages_prefix"] == len(parent.request_messages or []) + 1
    assert row["request_messages"] == [{"role": "user", "content": "tool output 5 " * 20}]
    assert row["tools_from_parent"] and row["request_tools"] is None
    first = await _stored(db_url, recorded[0].id)
    assert first["prompt_prefix"] == 0 and first["prompt_ids"] == recorded[0].prompt_ids


async def test_branches_siblings_and_edited_history_read_back_exactly(
    store: Store, db_url: str
) -> None:
    """n > 1 siblings share a parent; a retry edits an earlier message (only the messages
    before the edit are the parent's); a turn changes the tools; a fresh render."""
    session = await store.create_session(api_key_hash=key_hash())
    root = _turn(
        session.id, None, [{"role": "user", "content": "task"}], [1, 2, 3], seconds=0, reply="a"
    )
    await store.record_completion(completion=root)
    # n = 2: two choices of one request, committed in one batch with their parent given.
    siblings = [
        _turn(session.id, root, [{"role": "user", "content": "more"}], [4, 5], seconds=1, reply=r,
              choice_index=i)
        for i, r in enumerate(["b0", "b1"])
    ]  # fmt: skip
    await store.record_completions(completions=siblings, parents={root.id: root})
    # Each sibling continued.
    kids = [
        _turn(session.id, s, [{"role": "user", "content": f"after {s.response_text}"}], [6],
              seconds=2 + i, reply="c")
        for i, s in enumerate(siblings)
    ]  # fmt: skip
    for kid, sib in zip(kids, siblings, strict=True):
        await store.record_completions(completions=[kid], parents={sib.id: sib})
    # An edit of history: the client changed the reply it sends back for root (an edited
    # assistant message) and its tool call arguments' key order; the prompt is re-rendered.
    assert root.request_messages is not None
    edited_messages = [
        *root.request_messages,
        {"role": "assistant", "content": "a (edited)"},
        {"role": "user", "content": "more"},
    ]
    edited = completion(
        session.id, parent_id=root.id, prompt_ids=[1, 2, 3, 9, 9, 9], output_ids=[7],
        output_logprobs=[-1.0], output_versions=[2], request_messages=edited_messages,
        request_tools=TOOLS, response_message={"role": "assistant", "content": "d"}, seconds=5,
    )  # fmt: skip
    await store.record_completions(completions=[edited], parents={root.id: root})
    # Values equal in Python but not in JSON: the tools and the parent's reply in another
    # key order (a template renders tojson in key order), a tool output of 1.0 for 1.
    reordered_tools = [{"function": TOOLS[0]["function"], "type": "function"}]
    retyped = _turn(
        session.id, kids[0], [{"role": "user", "content": "x", "score": 1.0}], [8], seconds=6,
        reply="e", tools=reordered_tools,
    )  # fmt: skip
    assert retyped.request_messages is not None and reordered_tools == TOOLS
    retyped = replace(
        retyped,
        request_messages=[
            *retyped.request_messages[:-2],
            {"content": "c", "role": "assistant"},
            retyped.request_messages[-1],
        ],
    )
    await store.record_completions(completions=[retyped], parents={kids[0].id: kids[0]})
    again = _turn(
        session.id, retyped, [{"role": "user", "content": "y"}], [9], seconds=6.5, reply="f",
        tools=reordered_tools,
    )  # fmt: skip
    assert again.request_messages is not None
    again = replace(
        again,
        request_messages=[
            *again.request_messages[:-3],
            {"role": "user", "content": "x", "score": 1},
            *again.request_messages[-2:],
        ],
    )
    await store.record_completions(completions=[again], parents={retyped.id: retyped})
    fresh = completion(session.id, prompt_ids=[5, 5], seconds=7, request_messages=[{"role": "user", "content": "new"}])  # fmt: skip
    await store.record_completion(completion=fresh)

    everything = [root, *siblings, *kids, edited, retyped, again, fresh]
    assert await store.list_completions(session_id=session.id) == everything
    for c in everything:
        loaded = await store.get_completion(completion_id=c.id)
        assert loaded == c
        assert identical(loaded.request_messages, c.request_messages)  # types, key order
        assert identical(loaded.request_tools, c.request_tools)
    row = await _stored(db_url, edited.id)
    assert row["prompt_prefix"] == 0 and row["prompt_ids"] == [1, 2, 3, 9, 9, 9]
    assert row["messages_prefix"] == len(root.request_messages)  # up to the edited reply
    assert row["request_messages"] == edited_messages[len(root.request_messages) :]
    row = await _stored(db_url, retyped.id)
    assert not row["tools_from_parent"] and row["request_tools"] == reordered_tools
    assert row["messages_prefix"] == len(retyped.request_messages) - 2  # reordered reply
    row = await _stored(db_url, again.id)
    assert row["tools_from_parent"]
    assert row["messages_prefix"] == len(again.request_messages or []) - 3  # 1 is not 1.0
    row = await _stored(db_url, siblings[1].id)
    assert row["prompt_prefix"] == len(root.prompt_ids) + len(root.output_ids)
    assert row["prompt_ids"] == [4, 5]


async def test_text_and_chat_completions_mixed_in_one_chain(store: Store) -> None:
    """A /v1/completions turn (no messages) extends a chat turn and is extended by one."""
    session = await store.create_session(api_key_hash=key_hash())
    chat = _turn(
        session.id, None, [{"role": "user", "content": "hi"}], [1, 2], seconds=0, reply="a"
    )
    plain = completion(
        session.id, parent_id=chat.id, prompt_ids=[*chat.prompt_ids, *chat.output_ids, 3],
        seconds=1,
    )  # fmt: skip
    after = completion(
        session.id, parent_id=plain.id, prompt_ids=[*plain.prompt_ids, *plain.output_ids, 4],
        request_messages=[{"role": "user", "content": "again"}], request_tools=TOOLS, seconds=2,
    )  # fmt: skip
    for c in (chat, plain, after):
        await store.record_completion(completion=c)
    assert await store.list_completions(session_id=session.id) == [chat, plain, after]
    assert await store.get_completion(completion_id=after.id) == after


# The completions table as revision 0003 left it (before prompts were stored as deltas).
_V3 = sa.table(
    "completions",
    *(
        sa.column(name, kind)
        for name, kind in [
            ("id", sa.String()), ("session_id", sa.String()), ("parent_id", sa.String()),
            ("prompt_ids", sa.LargeBinary()), ("output_ids", sa.LargeBinary()),
            ("output_logprobs", sa.LargeBinary()), ("output_versions", sa.LargeBinary()),
            ("finish_reason", sa.String()), ("created_at", UTCDateTime()),
            ("request_messages", sa.JSON()), ("request_tools", sa.JSON()),
            ("response_message", sa.JSON()), ("response_text", sa.JSON()),
            ("sampling", sa.JSON()), ("model", sa.String()), ("choice_index", sa.Integer()),
        ]
    ),
)  # fmt: skip
_BEFORE = "0003"  # the revision before completions were stored against their parent


async def test_migration_converts_existing_rows_and_downgrades(db_url: str) -> None:
    """Rows written whole before the migration read back the same after it and after its
    downgrade, and the upgrade stores only what each adds to its parent."""
    await migrate.upgrade_async(db_url, _BEFORE)
    root = _turn("s", None, [{"role": "user", "content": "task"}], [1, 2, 3], seconds=0, reply="a")
    chain = [root]
    for turn in range(1, 4):
        msg = {"role": "user", "content": f"out {turn}"}
        chain.append(_turn("s", chain[-1], [msg], [turn] * 5, seconds=turn, reply=f"r{turn}"))
    sibling = _turn("s", root, [{"role": "user", "content": "other"}], [7], seconds=1, reply="b",
                    choice_index=1)  # fmt: skip
    orphan = _turn("s", None, [{"role": "user", "content": "x"}], [8], seconds=5, reply="c",
                   parent_id="gone")  # fmt: skip
    plain = completion("s", prompt_ids=[9, 9], seconds=6)
    records = [*chain, sibling, orphan, plain]
    engine = create_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO sessions (id, kind, status, metadata, created_at) "
                    "VALUES ('s', 'train', 'open', '{}', CURRENT_TIMESTAMP)"
                )
            )
            for c in records:
                await conn.execute(_V3.insert().values(**_v3_values(c)))
    finally:
        await engine.dispose()

    await migrate.upgrade_async(db_url, "head")
    store = await Store.open(db_url)
    try:
        ordered = sorted(records, key=lambda c: (c.created_at, c.choice_index, c.id))
        assert await store.list_completions(session_id="s") == ordered
        for c in records:
            assert await store.get_completion(completion_id=c.id) == c
    finally:
        await store.close()
    last = await _stored(db_url, chain[-1].id)
    assert last["prompt_prefix"] > 0 and last["prompt_ids"] == [3] * 5
    assert last["messages_prefix"] == len(chain[-2].request_messages or []) + 1
    assert last["tools_from_parent"] and last["request_tools"] is None
    assert (await _stored(db_url, sibling.id))["prompt_ids"] == [7]
    assert (await _stored(db_url, orphan.id))["prompt_prefix"] == 0  # its parent is not there

    await migrate.downgrade_async(db_url, _BEFORE)
    engine = create_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.select(_V3))).mappings().all()
    finally:
        await engine.dispose()
    assert {row["id"]: dict(row) for row in rows} == {c.id: _v3_values(c) for c in records}


def _v3_values(c: CompletionRecord) -> dict[str, Any]:
    return {
        "id": c.id, "session_id": c.session_id, "parent_id": c.parent_id,
        "prompt_ids": encode_int32(c.prompt_ids), "output_ids": encode_int32(c.output_ids),
        "output_logprobs": encode_float32(c.output_logprobs),
        "output_versions": encode_int32(c.output_versions), "finish_reason": c.finish_reason,
        "created_at": c.created_at, "request_messages": c.request_messages,
        "request_tools": c.request_tools, "response_message": c.response_message,
        "response_text": c.response_text, "sampling": c.sampling, "model": c.model,
        "choice_index": c.choice_index,
    }  # fmt: skip


async def test_a_replica_reads_only_the_turns_it_does_not_hold(store: Store) -> None:
    """``list_completions_since``: whatever part of a session a replica holds (a chain
    stored as prefixes, whose new turns' parents are held ones; held out of order; a turn
    another replica created earlier but committed later), the result is the whole read's,
    and only the rows not held are read whole."""
    session = await store.create_session(api_key_hash=key_hash())
    recorded: list[CompletionRecord] = []
    parent = None
    for turn in range(5):
        message = {"role": "user", "content": f"turn {turn}"}
        c = _turn(session.id, parent, [message], [turn, turn + 1], seconds=turn, reply=f"r{turn}")
        parents = {parent.id: parent} if parent else None
        await store.record_completions(completions=[c], parents=parents)
        recorded.append(c)
        parent = c
    whole = await store.list_completions(session_id=session.id)
    assert whole == recorded
    for held in (recorded[:1], recorded[:3], recorded, [], [recorded[3], recorded[0]]):
        assert await store.list_completions_since(session_id=session.id, known=held) == whole
    # A turn created before the last held one (another replica's, committed later).
    late = completion(session.id, seconds=2.5)
    await store.record_completion(completion=late)
    whole = await store.list_completions(session_id=session.id)
    assert [c.id for c in whole] == [*(c.id for c in recorded[:3]), late.id,
                                     *(c.id for c in recorded[3:])]  # fmt: skip
    since = await store.list_completions_since(session_id=session.id, known=recorded)
    assert since == whole
    assert all(a is b for a, b in zip(since, [*recorded[:3], since[3], *recorded[3:]], strict=True))
