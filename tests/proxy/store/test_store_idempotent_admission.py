"""Admission with an idempotency key: a repeat answers the session the key opened, once.

Runs on SQLite and PostgreSQL. A client that lost the answer to its create
sends the same key again; it must get the session the first request opened
(under a new key hash: the first key never reached it), never a second session
and never a second count in admission, and a 409 when the session may already be
in someone's hands.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from proxima.proxy.store import SessionStatus, Store
from proxima.proxy.store.errors import Conflict, NotAdmitted
from proxima.proxy.store.fleet import AdmissionState
from proxima.proxy.store.records import SessionKind

from tests.proxy.store.factories import completion, key_hash


def admit_all(state: AdmissionState) -> str | None:
    return None


def refuse_all(state: AdmissionState) -> str | None:
    return "full"


async def _open(store: Store, key: str | None, **body: Any) -> tuple[str, str]:
    """Admit a session with ``key``; returns its id and the key hash it was given."""
    digest = key_hash()
    session = await store.admit_train_session(
        decide=admit_all, api_key_hash=digest, idempotency_key=key, **body
    )
    return session.id, digest


async def test_a_repeated_key_answers_the_same_session_under_a_new_key(store: Store) -> None:
    body = {"group_id": "g", "data_id": "d", "metadata": {"sample": 0}}
    first, first_hash = await _open(store, "key-1", **body)
    assert (await store.admission_state()).admitted == 1

    asked: list[AdmissionState] = []

    def full(state: AdmissionState) -> str | None:
        asked.append(state)
        return "full"

    new_hash = key_hash()
    again = await store.admit_train_session(
        decide=full, api_key_hash=new_hash, idempotency_key="key-1", **body
    )
    assert again.id == first and again.status is SessionStatus.OPEN
    assert asked == []  # admitted once: a repeat is not a new decision (nor refused when full)
    assert await store.get_session_by_key_hash(api_key_hash=first_hash) is None
    found = await store.get_session_by_key_hash(api_key_hash=new_hash)
    assert found is not None and found.id == first
    assert (await store.admission_state()).admitted == 1
    assert await store.count_sessions() == 1

    other, _ = await _open(store, "key-2", **body)  # another key: another session
    plain = [(await _open(store, None, **body))[0] for _ in range(2)]  # no key: always new
    assert len({first, other, *plain}) == 4
    assert (await store.admission_state()).admitted == 4
    with pytest.raises(NotAdmitted):  # a new key still goes through admission
        await store.admit_train_session(
            decide=refuse_all, api_key_hash=key_hash(), idempotency_key="key-3", **body
        )


async def test_concurrent_repeats_of_one_key_open_one_session(store: Store) -> None:
    ids = await asyncio.gather(*(_open(store, "same-key", group_id="g") for _ in range(8)))
    assert len({session_id for session_id, _ in ids}) == 1
    assert await store.count_sessions() == 1
    assert (await store.admission_state()).admitted == 1
    # exactly one of the eight key hashes is the session's now: the last writer's
    holders = [await store.get_session_by_key_hash(api_key_hash=h) for _, h in ids]
    assert sum(holder is not None for holder in holders) == 1


@pytest.mark.parametrize("use", ["completion", "reward", "finished", "failed"])
async def test_a_session_in_use_or_closed_is_not_issued_again(store: Store, use: str) -> None:
    session_id, session_hash = await _open(store, "used-key")
    if use == "completion":
        await store.record_completions(completions=[completion(session_id)])
    elif use == "reward":
        await store.set_session_reward(session_id=session_id, reward=1.0)
    else:
        await store.finish_session(session_id=session_id, status=SessionStatus(use))
    with pytest.raises(Conflict, match=f"already opened session {session_id}") as raised:
        await _open(store, "used-key")
    assert raised.value.code == "idempotency_key_reused"
    found = await store.get_session_by_key_hash(api_key_hash=session_hash)  # its key still works
    assert found is not None and found.id == session_id
    assert await store.count_sessions() == 1


@pytest.mark.parametrize(
    "changed", [{"group_id": "h"}, {"data_id": "e"}, {"metadata": {"x": 2}}, {"adapter": "a"}]
)
async def test_a_repeat_with_another_body_is_refused(store: Store, changed: dict[str, Any]) -> None:
    body: dict[str, Any] = {"group_id": "g", "data_id": "d", "metadata": {"x": 1}}
    await _open(store, "body-key", **body)
    with pytest.raises(Conflict, match="with another body") as raised:
        await _open(store, "body-key", **{**body, **changed})
    assert raised.value.code == "idempotency_key_reused"
    assert await store.count_sessions() == 1


async def test_a_production_session_with_that_external_id_is_not_the_key(store: Store) -> None:
    api_key = await store.create_api_key(name="prod", key_hash=key_hash(), record=True)
    production = await store.get_or_create_production_session(
        api_key_id=api_key.id, external_id="conv-1"
    )
    train, _ = await _open(store, "conv-1")
    assert train != production.id
    assert (await _open(store, "conv-1"))[0] == train
    assert await store.count_sessions(kind=SessionKind.PRODUCTION) == 1
    assert await store.count_sessions() == 1
