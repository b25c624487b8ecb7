"""Claiming whole groups (``Store.claim_groups``) and counting a group's sessions.

Runs on SQLite and PostgreSQL. A group must never be split across training
batches: while one of its sessions is open, or fewer sessions than its
``group_size`` exist, none of it is claimed.
"""

from __future__ import annotations

from typing import Any

from proxima.proxy.store import SessionStatus, Store

from tests.proxy.store.factories import key_hash


async def _session(
    store: Store, group: str | None, *, finish: bool = True, reward: float | None = 1.0, **meta: Any
) -> str:
    session = await store.create_session(api_key_hash=key_hash(), group_id=group, metadata=meta)
    if reward is not None:
        await store.set_session_reward(session_id=session.id, reward=reward)
    if finish:
        await store.finish_session(session_id=session.id)
    return session.id


async def test_a_group_with_an_open_session_is_not_claimed(store: Store) -> None:
    a = [await _session(store, "A") for _ in range(3)]
    a_open = await _session(store, "A", finish=False)
    b = [await _session(store, "B") for _ in range(2)]
    # session-level claiming would take 3 of A and 1 of B: two split groups
    claimed = await store.claim_groups(min_sessions=4, trainer_id="t")
    assert [s.id for s in claimed] == b  # A waits for its open session; B is whole
    await store.finish_session(session_id=a_open)
    claimed = await store.claim_groups(min_sessions=4, trainer_id="t")
    assert sorted(s.id for s in claimed) == sorted([*a, a_open])


async def test_group_size_waits_for_sessions_not_yet_opened(store: Store) -> None:
    first = [await _session(store, "G", group_size=4) for _ in range(2)]
    assert await store.claim_groups(min_sessions=1, trainer_id="t") == []
    rest = [await _session(store, "G", group_size=4) for _ in range(2)]
    claimed = await store.claim_groups(min_sessions=1, trainer_id="t")
    assert sorted(s.id for s in claimed) == sorted(first + rest)  # whole, past min_sessions


async def test_failed_and_unrewarded_members_do_not_block_the_group(store: Store) -> None:
    ok = [await _session(store, "F") for _ in range(2)]
    failed = await _session(store, "F", finish=False)
    await store.finish_session(session_id=failed, status=SessionStatus.FAILED)
    await _session(store, "F", reward=None)  # finished without a reward: never claimable
    claimed = await store.claim_groups(min_sessions=8, trainer_id="t")
    assert sorted(s.id for s in claimed) == sorted(ok)
    assert await store.count_group_sessions(group_id="F") == 3  # admitted, not failed


async def test_whole_groups_oldest_first_until_min_sessions(store: Store) -> None:
    # finish order: u1, X1, Y1, X2, u2, Y2 -> units by last finish: u1, X, u2, Y
    u1 = await _session(store, None)
    x1 = await _session(store, "X")
    y1 = await _session(store, "Y")
    x2 = await _session(store, "X")
    u2 = await _session(store, None)
    y2 = await _session(store, "Y")
    first = await store.claim_groups(min_sessions=2, trainer_id="t")
    assert [s.id for s in first] == [u1, x1, x2]  # u1 is 1 < 2, X carries it to 3
    second = await store.claim_groups(min_sessions=1, trainer_id="t")
    assert [s.id for s in second] == [u2]
    third = await store.claim_groups(min_sessions=5, trainer_id="t")
    assert [s.id for s in third] == [y1, y2]  # fewer than asked: all there is
    assert await store.claim_groups(min_sessions=1, trainer_id="t") == []
    assert await store.claim_groups(min_sessions=0, trainer_id="t") == []
    assert all(s.status == SessionStatus.CLAIMED and s.claimed_by == "t" for s in first)


async def test_released_groups_are_claimed_whole_again(store: Store) -> None:
    g = [await _session(store, "R") for _ in range(3)]
    assert len(await store.claim_groups(min_sessions=1, trainer_id="crashed")) == 3
    assert await store.claim_groups(min_sessions=1, trainer_id="t") == []
    assert await store.release_claims(trainer_id="crashed") == 3
    again = await store.claim_groups(min_sessions=1, trainer_id="t")
    assert sorted(s.id for s in again) == sorted(g)
