"""Policies in the store: the base model and named adapters, each with its own sessions,
claims, admission counter, versions, evals and production history (migration 0006)."""

from __future__ import annotations

import pytest
from proxima.proxy.store import Store, migrate
from proxima.proxy.store.database import create_engine
from proxima.proxy.store.errors import Conflict
from proxima.proxy.store.fleet import AdmissionState
from proxima.proxy.store.records import SessionKind, SessionStatus
from sqlalchemy import text

from tests.proxy.store.factories import completion, key_hash


async def _finished(store: Store, *, adapter: str | None, group_id: str | None = None) -> str:
    session = await store.create_session(
        api_key_hash=key_hash(), adapter=adapter, group_id=group_id
    )
    await store.set_session_reward(session_id=session.id, reward=1.0)
    await store.finish_session(session_id=session.id)
    return session.id


def _scan(adapter: str | None) -> str:
    policy = "adapter IS NULL" if adapter is None else f"adapter = '{adapter}'"
    return (
        "SELECT count(*) FROM sessions WHERE kind = 'train' "
        f"AND status NOT IN ('failed', 'dropped') AND {policy}"
    )


async def _counted(store: Store, adapter: str | None) -> tuple[int, int]:
    """(the policy's admitted counter, a scan of its sessions)."""
    async with store.engine.connect() as conn:
        scan = int((await conn.execute(text(_scan(adapter)))).scalar_one())
    return (await store.admission_state(adapter=adapter)).admitted, scan


async def test_sessions_and_completions_carry_their_adapter(store: Store) -> None:
    base = await store.create_session(api_key_hash=key_hash())
    tenant = await store.create_session(api_key_hash=key_hash(), adapter="tenant-a")
    assert base.adapter is None and tenant.adapter == "tenant-a"
    got = await store.get_session(session_id=tenant.id)
    assert got is not None and got.adapter == "tenant-a"
    record = completion(tenant.id, adapter="tenant-a", output_versions=[2, 3])
    await store.record_completion(completion=record)
    (loaded,) = await store.list_completions(session_id=tenant.id)
    assert loaded.adapter == "tenant-a" and loaded.output_versions == [2, 3]
    await store.record_completion(completion=completion(base.id))
    (plain,) = await store.list_completions(session_id=base.id)
    assert plain.adapter is None


@pytest.mark.parametrize("name", ["", "Tenant", "-a", "a b", "a" * 65, "a:b", "a/../b"])
async def test_an_invalid_adapter_name_is_refused(store: Store, name: str) -> None:
    with pytest.raises(ValueError, match="adapter name"):
        await store.create_session(api_key_hash=key_hash(), adapter=name)


async def test_claims_take_only_the_asked_policy(store: Store) -> None:
    base = [await _finished(store, adapter=None) for _ in range(2)]
    a = [await _finished(store, adapter="tenant-a") for _ in range(3)]
    b = [await _finished(store, adapter="tenant-b") for _ in range(2)]
    got_a = await store.claim_sessions(limit=10, trainer_id="t", adapter="tenant-a")
    assert sorted(s.id for s in got_a) == sorted(a)
    assert {s.adapter for s in got_a} == {"tenant-a"}
    got_base = await store.claim_sessions(limit=10, trainer_id="t")  # no adapter: the base's
    assert sorted(s.id for s in got_base) == sorted(base)
    got_b = await store.claim_sessions(limit=10, trainer_id="t", adapter="tenant-b")
    assert sorted(s.id for s in got_b) == sorted(b)
    assert await store.claim_sessions(limit=10, trainer_id="t", adapter="tenant-c") == []


async def test_group_claims_take_only_the_asked_policy(store: Store) -> None:
    a = [await _finished(store, adapter="tenant-a", group_id="ga") for _ in range(2)]
    base = [await _finished(store, adapter=None, group_id="g0") for _ in range(2)]
    got = await store.claim_groups(min_sessions=1, trainer_id="t", adapter="tenant-a")
    assert sorted(s.id for s in got) == sorted(a)
    assert await store.claim_groups(min_sessions=1, trainer_id="t", adapter="tenant-a") == []
    got_base = await store.claim_groups(min_sessions=4, trainer_id="t")
    assert sorted(s.id for s in got_base) == sorted(base)


async def test_a_session_joins_only_a_group_of_its_own_policy(store: Store) -> None:
    """A group is one policy's: another policy's session is refused at creation and at
    admission (where joining an admitted group would also skip its own staleness gate)."""
    await store.create_session(api_key_hash=key_hash(), adapter="tenant-a", group_id="g")
    admitted: list[AdmissionState] = []

    def admit(state: AdmissionState) -> str | None:
        admitted.append(state)
        return None

    for other in ("tenant-b", None):
        with pytest.raises(Conflict, match="group 'g' holds sessions of adapter tenant-a") as exc:
            await store.create_session(api_key_hash=key_hash(), adapter=other, group_id="g")
        assert exc.value.param == "group_id"
        with pytest.raises(Conflict, match="a group is one policy's sessions"):
            await store.admit_train_session(
                decide=admit, api_key_hash=key_hash(), adapter=other, group_id="g"
            )
    assert admitted == []  # refused before admission decided anything
    joined = await store.admit_train_session(
        decide=admit, api_key_hash=key_hash(), adapter="tenant-a", group_id="g"
    )
    assert joined.group_id == "g" and admitted[0].joins_admitted_group
    await store.create_session(api_key_hash=key_hash(), group_id="g0")
    with pytest.raises(Conflict, match="holds sessions of base, not of adapter tenant-a"):
        await store.create_session(api_key_hash=key_hash(), adapter="tenant-a", group_id="g0")
    assert (await store.admission_state(adapter="tenant-b")).admitted == 0


async def test_a_group_mixing_policies_is_never_claimed_together(store: Store) -> None:
    """Rows no check stopped (written directly, or before the check): a group holding
    tenant-a's and tenant-b's sessions is claimed by no trainer, whichever policy it
    asks for, while each policy's own groups are."""
    mixed = [await _finished(store, adapter="tenant-a", group_id="mixed") for _ in range(2)]
    mixed += [await _finished(store, adapter="tenant-b", group_id="elsewhere") for _ in range(2)]
    async with store.engine.begin() as conn:
        await conn.execute(
            text("UPDATE sessions SET group_id = 'mixed' WHERE group_id = 'elsewhere'")
        )
    own = {
        policy: [await _finished(store, adapter=policy, group_id=f"own-{policy}") for _ in "xy"]
        for policy in ("tenant-a", "tenant-b", None)
    }
    for policy in ("tenant-a", "tenant-b", None):
        got = await store.claim_groups(min_sessions=100, trainer_id="t", adapter=policy)
        assert sorted(s.id for s in got) == sorted(own[policy]), policy
        assert await store.claim_groups(min_sessions=100, trainer_id="t", adapter=policy) == []
    for sid in mixed:
        session = await store.get_session(session_id=sid)
        assert session is not None and session.status == SessionStatus.FINISHED


async def test_each_policy_has_its_own_admitted_counter(store: Store) -> None:
    a = [
        (await store.create_session(api_key_hash=key_hash(), adapter="tenant-a")).id for _ in "xyz"
    ]
    await store.create_session(api_key_hash=key_hash(), adapter="tenant-b")
    await store.create_session(api_key_hash=key_hash())
    await store.create_session(
        api_key_hash=None, kind=SessionKind.PRODUCTION, adapter="tenant-a"
    )  # production: not admitted by the staleness rule
    assert await _counted(store, "tenant-a") == (3, 3)
    assert await _counted(store, "tenant-b") == (1, 1)
    assert await _counted(store, None) == (1, 1)
    await store.finish_session(session_id=a[0], status=SessionStatus.FAILED)
    assert await _counted(store, "tenant-a") == (2, 2)
    async with store.engine.begin() as conn:  # one statement over many rows (bulk trigger)
        await conn.execute(text("UPDATE sessions SET status = 'failed' WHERE adapter IS NOT NULL"))
    assert await _counted(store, "tenant-a") == (0, 0)
    assert await _counted(store, "tenant-b") == (0, 0)
    assert await _counted(store, None) == (1, 1)
    assert await _counted(store, "never-used") == (0, 0)


async def test_admission_decides_on_the_sessions_policy(store: Store) -> None:
    await store.record_policy_version(version=4, path="/base/v4")
    await store.record_policy_version(version=2, path="/a/v2", adapter="tenant-a")
    await store.create_session(api_key_hash=key_hash())
    seen: list[AdmissionState] = []

    def record(state: AdmissionState) -> str | None:
        seen.append(state)
        return None

    await store.admit_train_session(decide=record, api_key_hash=key_hash(), adapter="tenant-a")
    await store.admit_train_session(decide=record, api_key_hash=key_hash(), adapter="tenant-a")
    await store.admit_train_session(decide=record, api_key_hash=key_hash())
    assert [(s.adapter, s.admitted, s.version, s.open) for s in seen] == [
        ("tenant-a", 0, 2, 1),
        ("tenant-a", 1, 2, 2),
        (None, 1, 4, 3),  # the open cap counts every policy's open sessions
    ]


async def test_each_policy_has_its_own_version_sequence(store: Store) -> None:
    await store.record_policy_version(version=1, path="/base/v1")
    await store.record_policy_version(version=1, path="/a/v1", adapter="tenant-a")
    await store.record_policy_version(version=2, path="/a/v2", adapter="tenant-a")
    await store.record_policy_version(version=1, path="/b/v1", adapter="tenant-b")
    await store.record_policy_version(version=2, path="/a/v2", adapter="tenant-a")  # a retry
    await store.record_policy_version(version=3, path="/b/v3", adapter="tenant-b")
    with pytest.raises(Conflict, match="not newer"):
        await store.record_policy_version(version=2, path="/b/v2", adapter="tenant-b")
    with pytest.raises(Conflict, match="another path"):
        await store.record_policy_version(version=2, path="/elsewhere", adapter="tenant-a")
    assert await store.current_policy_version() == 1
    assert await store.current_policy_version(adapter="tenant-a") == 2
    assert await store.current_policy_version(adapter="tenant-b") == 3
    assert await store.current_policy_version(adapter="tenant-c") == 0
    a = await store.list_policy_versions(adapter="tenant-a")
    assert [(r.adapter, r.version, r.path) for r in a] == [
        ("tenant-a", 1, "/a/v1"),
        ("tenant-a", 2, "/a/v2"),
    ]
    assert [(r.adapter, r.version) for r in await store.list_policy_versions()] == [(None, 1)]
    heads = await store.adapter_heads()
    assert {name: (r.version, r.path) for name, r in heads.items()} == {
        "tenant-a": (2, "/a/v2"),
        "tenant-b": (3, "/b/v3"),
    }


async def test_evals_and_promotions_are_per_policy(store: Store) -> None:
    await store.record_version_eval(version=1, score=0.5)
    await store.record_version_eval(version=1, score=0.9, adapter="tenant-a")
    await store.record_promotion(action="promote", version=3, adapter="tenant-a")
    await store.record_promotion(action="promote", version=1)
    await store.record_promotion(action="rollback", version=0, adapter="tenant-a")
    assert (await store.latest_version_evals())[1].score == 0.5
    assert (await store.latest_version_evals(adapter="tenant-a"))[1].score == 0.9
    assert await store.latest_version_evals(adapter="tenant-b") == {}
    a = await store.list_promotions(adapter="tenant-a")
    assert [(p.action, p.version, p.adapter) for p in a] == [
        ("promote", 3, "tenant-a"),
        ("rollback", 0, "tenant-a"),
    ]
    assert [(p.action, p.version) for p in await store.list_promotions()] == [("promote", 1)]


async def test_a_production_key_records_sessions_of_its_adapter(store: Store) -> None:
    key = await store.create_api_key(name="a", key_hash=key_hash(), record=True, adapter="tenant-a")
    assert key.adapter == "tenant-a"
    found = await store.get_api_key_by_hash(key_hash=key_hash("unused"))
    assert found is None
    named = await store.get_or_create_production_session(api_key_id=key.id, external_id="conv-1")
    fresh = await store.get_or_create_production_session(api_key_id=key.id, external_id=None)
    assert named.adapter == "tenant-a" and fresh.adapter == "tenant-a"
    base_key = await store.create_api_key(name="b", key_hash=key_hash(), record=True)
    plain = await store.get_or_create_production_session(api_key_id=base_key.id, external_id="x")
    assert base_key.adapter is None and plain.adapter is None


async def test_an_old_database_migrates_with_its_rows_the_bases(db_url: str) -> None:
    """A database at 0005 with sessions: after 0006 they are the base's, counts unchanged;
    back at 0005 the adapter sessions count as the base's again."""
    await migrate.upgrade_async(db_url, "0005")
    engine = create_engine(db_url)
    try:
        async with engine.begin() as conn:
            for i, status in enumerate(["open", "finished", "failed"]):
                await conn.execute(
                    text(
                        "INSERT INTO sessions (id, kind, status, metadata, created_at) "
                        "VALUES (:id, 'train', :status, '{}', CURRENT_TIMESTAMP)"
                    ),
                    {"id": f"s{i}", "status": status},
                )
    finally:
        await engine.dispose()
    await migrate.upgrade_async(db_url, "head")
    store = await Store.open(db_url)
    try:
        assert (await store.admission_state()).admitted == 2
        old = await store.get_session(session_id="s1")
        assert old is not None and old.adapter is None
        await store.create_session(api_key_hash=key_hash(), adapter="tenant-a")
        assert (await store.admission_state()).admitted == 2
        assert (await store.admission_state(adapter="tenant-a")).admitted == 1
        await store.record_policy_version(version=1, path="/a", adapter="tenant-a")
    finally:
        await store.close()
    await migrate.downgrade_async(db_url, "0005")
    engine = create_engine(db_url)
    try:
        async with engine.begin() as conn:
            counters = dict(
                (await conn.execute(text("SELECT name, value FROM fleet_counters"))).tuples().all()
            )
            assert counters == {"admitted_train_sessions": 3}
            await conn.execute(
                text(
                    "INSERT INTO sessions (id, kind, status, metadata, created_at) "
                    "VALUES ('s9', 'train', 'open', '{}', CURRENT_TIMESTAMP)"
                )
            )
            value = (await conn.execute(text("SELECT value FROM fleet_counters"))).scalar_one()
            assert value == 4  # 0005's triggers are back
    finally:
        await engine.dispose()
