"""Claiming sessions for training: eligibility, order, exactly-once across processes."""

from __future__ import annotations

import multiprocessing
import queue
import time

import pytest
from proxima.proxy.store import Conflict, NotFound, SessionKind, SessionStatus, Store

from tests.proxy.store.claim_worker import claim_until_empty
from tests.proxy.store.factories import completion, key_hash


async def _finished(store: Store, *, reward: float | None = 1.0) -> str:
    session = await store.create_session(api_key_hash=key_hash())
    if reward is not None:
        await store.set_session_reward(session_id=session.id, reward=reward)
    await store.finish_session(session_id=session.id)
    return session.id


async def test_only_finished_and_rewarded_sessions_are_claimed(store: Store) -> None:
    rewarded = await _finished(store)
    turn_rewarded = (await store.create_session(api_key_hash=key_hash())).id
    turn = completion(turn_rewarded)
    await store.record_completion(completion=turn)
    await store.finish_session(session_id=turn_rewarded)
    await store.set_completion_reward(session_id=turn_rewarded, completion_id=turn.id, reward=0.0)
    await _finished(store, reward=None)  # finished, no reward anywhere
    open_session = await store.create_session(api_key_hash=key_hash())
    await store.set_session_reward(session_id=open_session.id, reward=1.0)  # rewarded, still open
    failed = await store.create_session(api_key_hash=key_hash())
    await store.set_session_reward(session_id=failed.id, reward=1.0)
    await store.finish_session(session_id=failed.id, status=SessionStatus.FAILED)

    claimed = await store.claim_sessions(limit=10, trainer_id="t1")
    assert [s.id for s in claimed] == [rewarded, turn_rewarded]
    assert all(s.status == SessionStatus.CLAIMED and s.claimed_by == "t1" for s in claimed)
    assert await store.claim_sessions(limit=10, trainer_id="t2") == []


async def test_oldest_finished_first_and_limit(store: Store) -> None:
    sessions = [await store.create_session(api_key_hash=key_hash()) for _ in range(3)]
    for session in sessions:
        await store.set_session_reward(session_id=session.id, reward=1.0)
    for index in (2, 0, 1):  # finish order differs from creation order
        await store.finish_session(session_id=sessions[index].id)
    first = await store.claim_sessions(limit=2, trainer_id="t")
    assert [s.id for s in first] == [sessions[2].id, sessions[0].id]
    assert [s.id for s in await store.claim_sessions(limit=2, trainer_id="t")] == [sessions[1].id]
    assert await store.claim_sessions(limit=0, trainer_id="t") == []


async def test_claim_filters_by_kind(store: Store) -> None:
    train = await _finished(store)
    key = await store.create_api_key(name="prod", key_hash=key_hash(), record=True)
    prod = await store.get_or_create_production_session(api_key_id=key.id, external_id="c1")
    await store.set_session_reward(session_id=prod.id, reward=1.0)
    await store.finish_session(session_id=prod.id)

    only_prod = await store.claim_sessions(limit=5, trainer_id="t", kinds=[SessionKind.PRODUCTION])
    assert [s.id for s in only_prod] == [prod.id]
    assert [s.id for s in await store.claim_sessions(limit=5, trainer_id="t")] == [train]


async def test_mark_release_and_counts(store: Store) -> None:
    ids = [await _finished(store) for _ in range(4)]
    await store.create_session(api_key_hash=key_hash())  # stays open
    claimed = [s.id for s in await store.claim_sessions(limit=3, trainer_id="crashed")]
    assert claimed == ids[:3]

    await store.mark_sessions(session_ids=[ids[0]], status=SessionStatus.TRAINED, trained_version=7)
    await store.mark_sessions(session_ids=[ids[1]], status=SessionStatus.DROPPED)
    trained = await store.get_session(session_id=ids[0])
    assert trained is not None and trained.status == SessionStatus.TRAINED
    assert trained.trained_version == 7
    assert (await store.get_session(session_id=ids[1])).status == SessionStatus.DROPPED  # type: ignore[union-attr]

    with pytest.raises(Conflict):  # ids[3] was never claimed: nothing changes
        await store.mark_sessions(session_ids=[ids[2], ids[3]], status=SessionStatus.TRAINED)
    assert (await store.get_session(session_id=ids[2])).status == SessionStatus.CLAIMED  # type: ignore[union-attr]
    with pytest.raises(NotFound):
        await store.mark_sessions(session_ids=["missing"], status=SessionStatus.DROPPED)
    with pytest.raises(ValueError):
        await store.mark_sessions(session_ids=[ids[2]], status=SessionStatus.FINISHED)

    assert await store.count_sessions_by_status() == {
        SessionStatus.OPEN: 1,
        SessionStatus.FINISHED: 1,
        SessionStatus.FAILED: 0,
        SessionStatus.CLAIMED: 1,
        SessionStatus.TRAINED: 1,
        SessionStatus.DROPPED: 1,
    }
    assert sum((await store.count_sessions_by_status(kind=SessionKind.PRODUCTION)).values()) == 0

    assert await store.release_claims(trainer_id="someone-else") == 0
    assert await store.release_claims(trainer_id="crashed") == 1
    released = await store.get_session(session_id=ids[2])
    assert released is not None and released.status == SessionStatus.FINISHED
    assert released.claimed_by is None
    again = await store.claim_sessions(limit=5, trainer_id="restarted")
    assert [s.id for s in again] == [ids[2], ids[3]]


async def test_rewards_are_frozen_once_claimed(store: Store) -> None:
    session = await store.create_session(api_key_hash=key_hash())
    turn = completion(session.id)
    await store.record_completion(completion=turn)
    await store.set_completion_reward(session_id=session.id, completion_id=turn.id, reward=1.0)
    await store.finish_session(session_id=session.id)
    await store.claim_sessions(limit=1, trainer_id="t")
    with pytest.raises(Conflict):
        await store.set_session_reward(session_id=session.id, reward=1.0)
    assert (await store.finish_session(session_id=session.id)).status == SessionStatus.CLAIMED


async def test_two_trainer_processes_claim_each_session_exactly_once(
    store: Store, db_url: str
) -> None:
    expected = {await _finished(store) for _ in range(40)}
    await _finished(store, reward=None)  # not claimable

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    workers = [
        ctx.Process(target=claim_until_empty, args=(db_url, name, barrier, 3, results))
        for name in ("trainer-a", "trainer-b")
    ]
    for worker in workers:
        worker.start()
    claimed: dict[str, list[str]] = {}
    deadline = time.monotonic() + 120
    while len(claimed) < len(workers):
        try:
            trainer_id, ids = results.get(timeout=1)
            claimed[trainer_id] = ids
        except queue.Empty:
            crashed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            assert not crashed, f"a trainer process failed (exit codes {crashed}); see its stderr"
            assert time.monotonic() < deadline, "trainer processes did not finish in time"
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0

    a, b = claimed["trainer-a"], claimed["trainer-b"]
    assert len(a) == len(set(a)) and len(b) == len(set(b))
    assert not set(a) & set(b)
    assert set(a) | set(b) == expected
    assert a and b, "both trainers should have claimed while running concurrently"
    for trainer_id, ids in claimed.items():
        for session_id in ids:
            session = await store.get_session(session_id=session_id)
            assert session is not None and session.claimed_by == trainer_id
    counts = await store.count_sessions_by_status()
    assert counts[SessionStatus.CLAIMED] == 40 and counts[SessionStatus.FINISHED] == 1
