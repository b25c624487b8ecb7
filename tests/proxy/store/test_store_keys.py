"""Production API keys and policy versions."""

from __future__ import annotations

import pytest
from proxima.proxy.store import Conflict, NotFound, Store

from tests.proxy.store.factories import key_hash


async def test_api_key_lifecycle(store: Store) -> None:
    digest = key_hash("sk-prod-secret")
    created = await store.create_api_key(name="prod", key_hash=digest, record=True)
    assert created.name == "prod" and created.record and created.revoked_at is None
    assert await store.get_api_key_by_hash(key_hash=digest) == created
    assert await store.get_api_key(key_id=created.id) == created
    assert await store.get_api_key_by_hash(key_hash=key_hash("other")) is None

    second = await store.create_api_key(name="eval", key_hash=key_hash(), record=False)
    assert [k.id for k in await store.list_api_keys()] == [created.id, second.id]

    revoked = await store.revoke_api_key(key_id=created.id)
    assert revoked.revoked_at is not None
    assert await store.get_api_key_by_hash(key_hash=digest) is None
    assert (await store.revoke_api_key(key_id=created.id)).revoked_at == revoked.revoked_at
    assert len(await store.list_api_keys()) == 2  # revoked keys stay listed
    with pytest.raises(NotFound):
        await store.revoke_api_key(key_id="missing")


async def test_api_key_hash_is_unique(store: Store) -> None:
    digest = key_hash()
    await store.create_api_key(name="a", key_hash=digest, record=False)
    with pytest.raises(Conflict):
        await store.create_api_key(name="b", key_hash=digest, record=False)


async def test_policy_versions(store: Store) -> None:
    assert await store.current_policy_version() == 0
    assert await store.list_policy_versions() == []
    first = await store.record_policy_version(version=1, path="/ckpt/v1")
    assert first.version == 1 and first.path == "/ckpt/v1"
    await store.record_policy_version(version=2, path=None)
    assert await store.current_policy_version() == 2
    assert await store.record_policy_version(version=1, path="/ckpt/v1") == first  # retried push
    with pytest.raises(Conflict):
        await store.record_policy_version(version=1, path="/elsewhere")
    await store.record_policy_version(version=5, path="/ckpt/v5")
    with pytest.raises(Conflict):
        await store.record_policy_version(version=4, path="/ckpt/v4")
    with pytest.raises(ValueError):
        await store.record_policy_version(version=0, path=None)
    assert [v.version for v in await store.list_policy_versions()] == [1, 2, 5]
    assert await store.current_policy_version() == 5
