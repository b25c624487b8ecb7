"""Session creation, lookup, rewards and finishing."""

from __future__ import annotations

import asyncio
from datetime import UTC

import pytest
from proxima.proxy.api.schemas import MAX_ID_LENGTH
from proxima.proxy.store import (
    Conflict,
    NotFound,
    RewardAlreadySet,
    SessionKind,
    SessionStatus,
    Store,
)
from proxima.proxy.store.models import SessionRow

from tests.proxy.store.factories import completion, key_hash


async def test_create_and_get_session(store: Store) -> None:
    digest = key_hash()
    created = await store.create_session(
        api_key_hash=digest, group_id="g1", data_id="d1", metadata={"task": "math", "n": [1, 2]}
    )
    assert created.kind == SessionKind.TRAIN
    assert created.status == SessionStatus.OPEN
    assert created.reward is None and created.finished_at is None
    assert created.created_at.tzinfo == UTC
    assert await store.get_session(session_id=created.id) == created
    assert await store.get_session_by_key_hash(api_key_hash=digest) == created
    assert await store.get_session(session_id="missing") is None
    assert await store.get_session_by_key_hash(api_key_hash=key_hash()) is None


async def test_session_key_hash_is_unique(store: Store) -> None:
    digest = key_hash()
    await store.create_session(api_key_hash=digest)
    with pytest.raises(Conflict):
        await store.create_session(api_key_hash=digest)


async def test_session_reward_is_write_once(store: Store) -> None:
    session = await store.create_session(api_key_hash=key_hash())
    rewarded = await store.set_session_reward(session_id=session.id, reward=0.75)
    assert rewarded.reward == 0.75
    with pytest.raises(RewardAlreadySet):
        await store.set_session_reward(session_id=session.id, reward=1.0)
    assert (await store.get_session(session_id=session.id)).reward == 0.75  # type: ignore[union-attr]
    with pytest.raises(NotFound):
        await store.set_session_reward(session_id="missing", reward=1.0)


async def test_completion_reward_must_belong_to_the_session(store: Store) -> None:
    mine = await store.create_session(api_key_hash=key_hash())
    other = await store.create_session(api_key_hash=key_hash())
    turn = completion(mine.id)
    await store.record_completion(completion=turn)

    with pytest.raises(NotFound):
        await store.set_completion_reward(session_id=other.id, completion_id=turn.id, reward=1.0)
    with pytest.raises(NotFound):
        await store.set_completion_reward(session_id=mine.id, completion_id="nope", reward=1.0)
    with pytest.raises(NotFound):
        await store.set_completion_reward(session_id="missing", completion_id=turn.id, reward=1.0)

    await store.set_completion_reward(session_id=mine.id, completion_id=turn.id, reward=0.5)
    with pytest.raises(RewardAlreadySet):
        await store.set_completion_reward(session_id=mine.id, completion_id=turn.id, reward=1.0)
    assert (await store.get_completion(completion_id=turn.id)).reward == 0.5  # type: ignore[union-attr]


async def test_finish_session_transitions(store: Store) -> None:
    session = await store.create_session(api_key_hash=key_hash())
    finished = await store.finish_session(session_id=session.id)
    assert finished.status == SessionStatus.FINISHED
    assert finished.finished_at is not None and finished.finished_at.tzinfo == UTC
    again = await store.finish_session(session_id=session.id)
    assert again == finished  # idempotent, finished_at unchanged
    with pytest.raises(Conflict):
        await store.finish_session(session_id=session.id, status=SessionStatus.FAILED)

    failing = await store.create_session(api_key_hash=key_hash())
    failed = await store.finish_session(session_id=failing.id, status=SessionStatus.FAILED)
    assert failed.status == SessionStatus.FAILED
    assert (await store.finish_session(session_id=failing.id, status="failed")) == failed  # type: ignore[arg-type]
    with pytest.raises(Conflict):
        await store.finish_session(session_id=failing.id)

    with pytest.raises(ValueError):
        await store.finish_session(session_id=session.id, status=SessionStatus.TRAINED)
    with pytest.raises(NotFound):
        await store.finish_session(session_id="missing")


async def test_count_sessions_by_kind(store: Store) -> None:
    key = await store.create_api_key(name="prod", key_hash=key_hash(), record=True)
    for _ in range(3):
        await store.create_session(api_key_hash=key_hash())
    failed = await store.create_session(api_key_hash=key_hash())
    await store.finish_session(session_id=failed.id, status=SessionStatus.FAILED)
    await store.get_or_create_production_session(api_key_id=key.id, external_id=None)

    assert await store.count_sessions() == 4
    assert await store.count_sessions(kind=SessionKind.PRODUCTION) == 1
    assert await store.count_sessions(statuses=[SessionStatus.OPEN]) == 3


async def test_production_session_per_external_id(store: Store) -> None:
    key = await store.create_api_key(name="prod", key_hash=key_hash(), record=True)
    first = await store.get_or_create_production_session(api_key_id=key.id, external_id="conv-1")
    assert first.kind == SessionKind.PRODUCTION
    assert first.api_key_id == key.id and first.external_id == "conv-1"
    same = await store.get_or_create_production_session(api_key_id=key.id, external_id="conv-1")
    assert same.id == first.id
    other = await store.get_or_create_production_session(api_key_id=key.id, external_id="conv-2")
    assert other.id != first.id
    fresh = {
        (await store.get_or_create_production_session(api_key_id=key.id, external_id=None)).id
        for _ in range(3)
    }
    assert len(fresh) == 3
    with pytest.raises(NotFound):
        await store.get_or_create_production_session(api_key_id="missing", external_id="x")
    with pytest.raises(NotFound):
        await store.get_or_create_production_session(api_key_id="missing", external_id=None)


async def test_production_session_creation_is_race_safe(store: Store, db_url: str) -> None:
    key = await store.create_api_key(name="prod", key_hash=key_hash(), record=True)
    second = await Store.open(db_url)  # a second engine: separate connection pool
    try:
        calls = [
            target.get_or_create_production_session(api_key_id=key.id, external_id="shared")
            for _ in range(8)
            for target in (store, second)
        ]
        sessions = await asyncio.gather(*calls)
    finally:
        await second.close()
    assert len({s.id for s in sessions}) == 1
    assert await store.count_sessions(kind=SessionKind.PRODUCTION) == 1


async def test_identifiers_up_to_the_api_limit_fit_their_columns(store: Store) -> None:
    """The API accepts ids of up to ``MAX_ID_LENGTH`` characters; the columns hold them.

    PostgreSQL enforces ``varchar(n)`` (SQLite does not): a longer API limit
    than the column would turn valid requests into 500s there.
    """
    longest = "é" * MAX_ID_LENGTH  # characters, not bytes: 2 bytes each in UTF-8
    for column in ("group_id", "data_id", "external_id"):
        assert SessionRow.__table__.c[column].type.length == MAX_ID_LENGTH
    session = await store.create_session(api_key_hash=key_hash(), group_id=longest, data_id=longest)
    loaded = await store.get_session(session_id=session.id)
    assert loaded is not None and (loaded.group_id, loaded.data_id) == (longest, longest)
    key = await store.create_api_key(name="app", key_hash=key_hash(), record=True)
    production = await store.get_or_create_production_session(
        api_key_id=key.id, external_id=longest
    )
    assert production.external_id == longest
    again = await store.get_or_create_production_session(api_key_id=key.id, external_id=longest)
    assert again.id == production.id
