"""The store refuses a value its column cannot hold, with the same 400 naming the field on
SQLite and PostgreSQL (``proxima.proxy.store.values``), before any transaction opens.

Without the check SQLite stored what PostgreSQL refused with a driver error (a 500): NaN in
JSON, a NUL in text, an integer past int32 (and past int64 on SQLite itself).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from proxima.proxy.store import Store
from proxima.proxy.store.values import InvalidValue, integer, json_value, text

from tests.proxy.store.factories import key_hash


def _admit(store: Store, **fields: Any) -> Awaitable[Any]:
    return store.admit_train_session(decide=lambda _: None, api_key_hash=key_hash(), **fields)


CALLS: dict[str, tuple[str, Callable[[Store, str], Awaitable[Any]]]] = {
    "metadata NaN": (
        "metadata",
        lambda s, _: s.create_session(api_key_hash=key_hash(), metadata={"x": math.nan}),
    ),
    "metadata -inf, nested": (
        "metadata",
        lambda s, _: _admit(s, metadata={"x": [1, {"y": -math.inf}]}),
    ),
    "group NUL": ("group_id", lambda s, _: _admit(s, group_id="g\x00")),
    "idempotency NUL": ("idempotency-key", lambda s, _: _admit(s, idempotency_key="k\x00")),
    "session id NUL": ("session_id", lambda s, _: s.get_session(session_id="a\x00b")),
    "finish NUL": ("session_id", lambda s, _: s.finish_session(session_id="a\x00b")),
    "state NUL": ("session_id", lambda s, _: s.session_state(session_id="a\x00b")),
    "completion id NUL": (
        "completion_id",
        lambda s, sid: s.set_completion_reward(session_id=sid, completion_id="c\x00", reward=1.0),
    ),
    "reward NaN": ("reward", lambda s, sid: s.set_session_reward(session_id=sid, reward=math.nan)),
    "eval items 2**31": (
        "items",
        lambda s, _: s.record_version_eval(version=0, score=0.5, items=2**31),
    ),
    "eval items 2**70": (
        "items",
        lambda s, _: s.record_version_eval(version=0, score=0.5, items=2**70),
    ),
    "eval name NUL": (
        "name",
        lambda s, _: s.record_version_eval(version=0, score=0.5, name="n\x00"),
    ),
    "eval score inf": ("score", lambda s, _: s.record_version_eval(version=0, score=math.inf)),
    "version 2**31": ("version", lambda s, _: s.record_policy_version(version=2**31, path="/p")),
    "path NUL": ("path", lambda s, _: s.record_policy_version(version=1, path="/p\x00")),
    "external id NUL": (
        "external_id",
        lambda s, _: s.get_or_create_production_session(api_key_id="k", external_id="e\x00"),
    ),
}


@pytest.mark.parametrize("case", sorted(CALLS))
async def test_a_value_no_column_holds_is_a_400_naming_the_field(store: Store, case: str) -> None:
    field, call = CALLS[case]
    session = await store.create_session(api_key_hash=key_hash(), metadata={"ok": [1.5, "t"]})
    with pytest.raises(InvalidValue) as caught:
        await call(store, session.id)
    assert caught.value.param == field and caught.value.status_code == 400
    assert field in caught.value.message
    # Nothing was written; the store goes on.
    assert (await store.get_session(session_id=session.id)) == session
    assert await store.latest_version_evals() == {}
    assert await store.list_policy_versions() == []


def test_the_checks_take_what_their_columns_hold() -> None:
    assert text("plain é 🦀", "f") == "plain é 🦀" and text(None, "f") is None
    assert integer(2**31 - 1, "f") == 2**31 - 1 and integer(-(2**31), "f") == -(2**31)
    assert integer(2**63 - 1, "f", bits=64) == 2**63 - 1
    for bad in (2**31, True, 1.0):
        with pytest.raises(InvalidValue):
            integer(bad, "f")  # type: ignore[arg-type]
    value = {"a": [1, 2.5, "x\x00", None, True, {"b\x00": 10**30}]}
    assert json_value(value, "f") is value
