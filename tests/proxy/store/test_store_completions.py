"""Recording and reading completions (token arrays, JSON payloads, ordering)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from proxima.proxy.store import Conflict, NotFound, Store
from proxima.proxy.store.errors import SessionClosed
from proxima.proxy.store.records import SessionStatus

from tests.proxy.store.factories import completion, key_hash


async def test_record_and_read_back_everything(store: Store) -> None:
    session = await store.create_session(api_key_hash=key_hash())
    local = timezone(timedelta(hours=2))
    record = completion(
        session.id,
        prompt_ids=list(range(1000)),
        output_ids=[151_643, 0, 7],
        output_logprobs=[-0.125, -3.5, 0.0],
        output_versions=[3, 3, 4],
        finish_reason="tool_calls",
        created_at=datetime(2025, 5, 1, 14, 0, tzinfo=local),
        request_messages=[{"role": "user", "content": "héllo 👋"}],
        request_tools=[{"type": "function", "function": {"name": "add", "parameters": {}}}],
        response_message={"role": "assistant", "content": None, "tool_calls": []},
        response_text="",
        sampling={"temperature": 0.7, "top_p": 0.9, "seed": 3},
        model="tiny",
        choice_index=1,
        finished_at=datetime(2025, 5, 1, 12, 0, 1, 250_000, tzinfo=UTC),
        time_to_first_token=0.01,
        duration=1.25,
        backend="http://127.0.0.1:30000",
        grammar={"kind": "regex", "value": "(yes|no)\\n", "rules": "sglang"},
    )
    await store.record_completion(completion=record)
    loaded = await store.get_completion(completion_id=record.id)
    assert loaded is not None
    assert loaded.created_at == record.created_at  # same instant ...
    assert loaded.created_at.tzinfo == UTC  # ... returned in UTC
    assert loaded == record
    assert loaded.temperature == 0.7
    assert await store.get_completion(completion_id="missing") is None


async def test_list_completions_in_creation_order(store: Store) -> None:
    session = await store.create_session(api_key_hash=key_hash())
    other = await store.create_session(api_key_hash=key_hash())
    late = completion(session.id, seconds=10)
    early = completion(session.id, seconds=1)
    choice_b = completion(session.id, seconds=5, choice_index=1)
    choice_a = completion(session.id, seconds=5, choice_index=0, parent_id=early.id)
    for record in (late, choice_b, early, choice_a, completion(other.id)):
        await store.record_completion(completion=record)
    listed = await store.list_completions(session_id=session.id)
    assert [c.id for c in listed] == [early.id, choice_a.id, choice_b.id, late.id]
    assert listed[1].parent_id == early.id
    assert await store.list_completions(session_id="missing") == []


async def test_record_completion_errors(store: Store) -> None:
    session = await store.create_session(api_key_hash=key_hash())
    record = completion(session.id)
    await store.record_completion(completion=record)
    with pytest.raises(Conflict):
        await store.record_completion(completion=record)
    with pytest.raises(NotFound):
        await store.record_completion(completion=completion("missing"))
    with pytest.raises(ValueError, match="equal lengths"):
        await store.record_completion(completion=completion(session.id, output_versions=[0]))
    with pytest.raises(ValueError, match="naive"):
        await store.record_completion(
            completion=completion(session.id, created_at=datetime(2025, 1, 1))
        )
    assert [c.id for c in await store.list_completions(session_id=session.id)] == [record.id]


async def test_only_open_sessions_gain_completions(store: Store) -> None:
    # Checked in the inserting transaction: a finish (through any proxy replica) is
    # seen by every later commit, so a finished session never gains a completion.
    session = await store.create_session(api_key_hash=key_hash())
    await store.record_completion(completion=completion(session.id))
    await store.set_session_reward(session_id=session.id, reward=1.0)
    await store.finish_session(session_id=session.id)
    with pytest.raises(SessionClosed, match="finished"):
        await store.record_completion(completion=completion(session.id))
    await store.claim_sessions(limit=1, trainer_id="t")
    with pytest.raises(SessionClosed, match="taken by a trainer"):
        await store.record_completion(completion=completion(session.id))
    failed = await store.create_session(api_key_hash=key_hash())
    await store.finish_session(session_id=failed.id, status=SessionStatus.FAILED)
    with pytest.raises(SessionClosed, match="failed"):
        await store.record_completions(completions=[completion(failed.id)])
    assert len(await store.list_completions(session_id=session.id)) == 1
    assert await store.list_completions(session_id=failed.id) == []


# Whatever a model can generate must record: NUL (a byte-level tokenizer decodes token
# <0x00> to it; PostgreSQL text columns refuse it), escapes, text that looks like JSON.
GENERATED_TEXTS = ["a\x00b", "\x00", "", "42", '"quoted"', "back\\slash \\u0000", "🦀\U0010ffff"]


@pytest.mark.parametrize("text", GENERATED_TEXTS)
async def test_any_generated_text_records_losslessly(store: Store, text: str) -> None:
    session = await store.create_session(api_key_hash=key_hash(), metadata={"note": text})
    record = completion(
        session.id,
        response_text=text,
        response_message={"role": "assistant", "content": text},
        request_messages=[{"role": "user", "content": text, "name": text}],
        sampling={"stop": [text]},
    )
    await store.record_completions(completions=[record])
    assert await store.get_completion(completion_id=record.id) == record
    assert await store.list_completions(session_id=session.id) == [record]
    loaded = await store.get_session(session_id=session.id)
    assert loaded is not None and loaded.metadata == {"note": text}
