"""What replicas share through the store: admission, the admitted counter, session state."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.store.errors import NotAdmitted, NotFound
from proxima.proxy.store.fleet import AdmissionState
from proxima.proxy.store.records import SessionKind, SessionStatus
from sqlalchemy import text

from tests.proxy.store.factories import completion, key_hash


def _admitted_by_scan() -> str:
    return (
        "SELECT count(*) FROM sessions WHERE kind = 'train' AND status NOT IN ('failed', 'dropped')"
    )


async def _counter_and_scan(store: Store) -> tuple[int, int]:
    async with store.engine.connect() as conn:
        scan = (await conn.execute(text(_admitted_by_scan()))).scalar_one()
    return (await store.admission_state()).admitted, int(scan)


async def test_admitted_counter_follows_every_status_change(store: Store) -> None:
    sessions = [(await store.create_session(api_key_hash=key_hash())).id for _ in range(6)]
    await store.create_session(api_key_hash=None, kind=SessionKind.PRODUCTION)  # not counted
    assert await _counter_and_scan(store) == (6, 6)
    await store.finish_session(session_id=sessions[0], status=SessionStatus.FAILED)
    await store.finish_session(session_id=sessions[0], status=SessionStatus.FAILED)  # no-op
    for sid in sessions[1:4]:
        await store.set_session_reward(session_id=sid, reward=1.0)
        await store.finish_session(session_id=sid)
    assert await _counter_and_scan(store) == (5, 5)
    claimed = await store.claim_sessions(limit=3, trainer_id="t")
    assert await _counter_and_scan(store) == (5, 5)
    await store.mark_sessions(session_ids=[claimed[0].id], status=SessionStatus.DROPPED)
    await store.mark_sessions(
        session_ids=[claimed[1].id], status=SessionStatus.TRAINED, trained_version=1
    )
    assert await _counter_and_scan(store) == (4, 4)
    async with store.engine.begin() as conn:  # a delete by hand keeps it exact too
        await conn.execute(text("DELETE FROM sessions WHERE id = :i"), {"i": sessions[5]})
    assert await _counter_and_scan(store) == (3, 3)
    state = await store.admission_state()
    assert state.open == 1 and state.version == 0


async def test_admission_decides_in_one_transaction(store: Store) -> None:
    seen: list[AdmissionState] = []

    def capacity_3(state: AdmissionState) -> str | None:
        seen.append(state)
        return None if state.admitted < 3 else "full"

    async def create(i: int) -> bool:
        try:
            await store.admit_train_session(decide=capacity_3, api_key_hash=key_hash())
        except NotAdmitted as exc:
            assert exc.reason == "full"
            return False
        return True

    results = await asyncio.gather(*(create(i) for i in range(10)))
    assert sum(results) == 3
    assert sorted(s.admitted for s in seen)[:4] == [0, 1, 2, 3]
    await store.record_policy_version(version=1, path="/w1")
    state = await store.admission_state()
    assert (state.admitted, state.open, state.version) == (3, 3, 1)


async def test_group_membership_is_read_for_admission(store: Store) -> None:
    await store.admit_train_session(decide=lambda s: None, api_key_hash=key_hash(), group_id="g")
    assert (await store.admission_state(group_id="g")).joins_admitted_group
    assert not (await store.admission_state(group_id="other")).joins_admitted_group


async def test_session_state_counts_completions(store: Store) -> None:
    session = await store.create_session(api_key_hash=key_hash())
    assert (await store.session_state(session_id=session.id)).completions == 0
    await store.record_completions(completions=[completion(session.id), completion(session.id)])
    await store.finish_session(session_id=session.id)
    state = await store.session_state(session_id=session.id)
    assert (state.status, state.completions) == (SessionStatus.FINISHED, 2)
    with pytest.raises(NotFound):
        await store.session_state(session_id="nope")


async def test_session_state_on_a_sqlite_file_is_read_on_the_event_loop(tmp_path: Path) -> None:
    """The workers' check before each turn takes no thread hop: the async engine is not used,
    and what another process's store recorded and finished is seen at once."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    mine, other = await Store.open(url, shared=True), await Store.open(url, shared=True)
    try:
        session = await other.create_session(api_key_hash=key_hash())
        engine_reads: list[object] = []
        real_read = mine._read

        def counted() -> Any:
            engine_reads.append(None)
            return real_read()

        mine._read = counted  # type: ignore[method-assign]
        assert (await mine.session_state(session_id=session.id)).completions == 0
        await other.record_completions(completions=[completion(session.id)])
        await other.finish_session(session_id=session.id)
        state = await mine.session_state(session_id=session.id)
        assert (state.status, state.completions) == (SessionStatus.FINISHED, 1)
        with pytest.raises(NotFound):
            await mine.session_state(session_id="nope")
        assert engine_reads == []
    finally:
        await mine.close()
        await other.close()


async def test_publish_lock_excludes_a_second_holder(store: Store) -> None:
    order: list[str] = []

    async def push(name: str) -> None:
        async with store.publish_lock():
            order.append(f"{name}+")
            await asyncio.sleep(0.05)
            order.append(f"{name}-")

    await asyncio.gather(push("a"), push("b"))
    if store.shared:  # PostgreSQL: one holder at a time, across processes too
        assert order in (["a+", "a-", "b+", "b-"], ["b+", "b-", "a+", "a-"])
    else:  # SQLite serves one process, whose own lock orders its pushes: a no-op here
        assert order == ["a+", "b+", "a-", "b-"]
