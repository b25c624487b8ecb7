"""Failed adapter versions in the store (migration 0008), on SQLite and PostgreSQL.

A version marked failed keeps its number (the next push must be newer still) but is never
a head again; ``fail_adapter_version`` answers the version to fall back to: the newest good
one below it, or None (version 0, the bare base).
"""

from __future__ import annotations

import pytest
from proxima.proxy.store import Store
from proxima.proxy.store.errors import Conflict, NotFound

A = "tenant-a"


async def _push(store: Store, *versions: int, adapter: str = A) -> None:
    for v in versions:
        await store.record_policy_version(
            version=v, path=f"/adapters/{adapter}/v{v}", adapter=adapter
        )


async def test_a_failed_version_is_no_head_and_keeps_its_number(store: Store) -> None:
    await _push(store, 1, 2, 3)
    await _push(store, 1, adapter="tenant-b")
    good = await store.fail_adapter_version(adapter=A, version=3, reason="non-finite logprob")
    assert good is not None and (good.version, good.path) == (2, "/adapters/tenant-a/v2")
    heads = await store.adapter_heads()
    assert heads[A].version == 2 and heads["tenant-b"].version == 1
    assert await store.current_policy_version(adapter=A) == 3  # the number stays taken
    with pytest.raises(Conflict, match="already recorded with another path"):
        await store.record_policy_version(version=3, path="/adapters/fixed", adapter=A)
    listed = {r.version: r for r in await store.list_policy_versions(adapter=A)}
    assert listed[3].failed_at is not None and listed[3].failure == "non-finite logprob"
    assert listed[2].failed_at is None and listed[2].failure is None
    # A newer push is a head again.
    await _push(store, 4)
    assert (await store.adapter_heads())[A].version == 4


async def test_falling_back_past_every_version_reaches_the_bare_base(store: Store) -> None:
    await _push(store, 1, 2)
    first = await store.fail_adapter_version(adapter=A, version=2, reason="first")
    assert first is not None and first.version == 1
    again = await store.fail_adapter_version(adapter=A, version=2, reason="second")
    assert again is not None and again.version == 1
    (v2,) = [r for r in await store.list_policy_versions(adapter=A) if r.version == 2]
    assert v2.failure == "first"  # the first reason is kept
    assert await store.fail_adapter_version(adapter=A, version=1, reason="also") is None
    assert A not in await store.adapter_heads()


async def test_failing_an_unknown_version_is_not_found(store: Store) -> None:
    await _push(store, 1)
    with pytest.raises(NotFound):
        await store.fail_adapter_version(adapter=A, version=7, reason="x")
    with pytest.raises(ValueError, match="adapter name"):
        await store.fail_adapter_version(adapter="Bad Name", version=1, reason="x")
