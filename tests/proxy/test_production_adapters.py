"""Production per policy: promote, canary, rollback and the eval gate of one adapter leave
the base's and every other adapter's production alone.

Real store, real pools; each deployment's backend is the fake SGLang with LoRA enabled
(SGLang 0.5.23's adapter registry), so what production serves is what its backend loaded.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.errors import Conflict
from proxima.proxy.policies.deployments import CanarySplit, Deployment, Deployments
from proxima.proxy.policies.production import ProductionController
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app

NAMES = ("training", "production", "canary")


@dataclass
class Setup:
    store: Store
    fakes: dict[str, FakeBackend]
    http: httpx.AsyncClient
    root: Path

    def deployments(self) -> Deployments:
        """Fresh pools over the same backends (a proxy that starts)."""
        pools = {n: BackendPool([f"http://{n}"], http=self.http) for n in NAMES}

        async def canary() -> Deployment:
            return Deployment("canary", pools["canary"])

        return Deployments(
            Deployment("training", pools["training"]),
            Deployment("production", pools["production"]),
            canary_factory=canary,
        )

    def controller(self, deployments: Deployments) -> ProductionController:
        return ProductionController(
            deployments=deployments, store=self.store, base_model_path="/base"
        )

    def loaded(self, name: str) -> set[str]:
        lora = self.fakes[name].lora
        assert lora is not None
        return set(lora.loaded())

    async def push(self, adapter: str, version: int) -> None:
        path = self.root / f"{adapter}-v{version}"
        path.mkdir()
        config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
        (path / "adapter_config.json").write_text(json.dumps(config))
        await self.store.record_policy_version(version=version, path=str(path), adapter=adapter)


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    store = await Store.open(url)
    fakes = {n: FakeBackend(seed=i, enable_lora=True) for i, n in enumerate(NAMES)}
    http = httpx.AsyncClient(
        mounts={
            f"http://{n}": httpx.ASGITransport(app=create_fake_app(f)) for n, f in fakes.items()
        }
    )
    try:
        yield Setup(store, fakes, http, tmp_path)
    finally:
        await http.aclose()
        await store.close()


async def test_promote_and_rollback_of_one_adapter_leave_the_others_alone(setup: Setup) -> None:
    d = setup.deployments()
    production = setup.controller(d)
    await setup.push("tenant-a", 1)
    await setup.push("tenant-a", 2)
    await setup.push("tenant-b", 1)
    await setup.store.record_policy_version(version=1, path="/base/v1")
    await production.promote(1)  # the base
    await production.promote(1, adapter="tenant-b")
    await production.promote(1, adapter="tenant-a")
    status = await production.promote(2, adapter="tenant-a")
    assert status["adapter"] == "tenant-a" and status["version"] == 2
    pool = d.production.pool if d.production else None
    assert pool is not None
    assert pool.version == 1 and pool.policy("tenant-b") == (1, "tenant-b@v1")
    assert pool.policy("tenant-a") == (2, "tenant-a@v2")
    assert setup.loaded("production") == {"tenant-a@v2", "tenant-b@v1"}

    back = await production.rollback(adapter="tenant-a")
    assert back["version"] == 1 and back["rollback_to"] == 0
    assert pool.policy("tenant-a") == (1, "tenant-a@v1")
    assert pool.policy("tenant-b") == (1, "tenant-b@v1") and pool.version == 1
    assert setup.loaded("production") == {"tenant-a@v1", "tenant-b@v1"}
    await production.rollback(adapter="tenant-a")  # back to its bare base: version 0
    assert pool.policy("tenant-a") == (0, None)
    assert setup.loaded("production") == {"tenant-b@v1"}
    with pytest.raises(Conflict, match="adapter tenant-a"):
        await production.rollback(adapter="tenant-a")
    b = await production.status(adapter="tenant-b")
    assert b["version"] == 1 and [h["action"] for h in b["history"]] == ["promote"]
    base = await production.status()
    assert base["version"] == 1 and [h["action"] for h in base["history"]] == ["promote"]
    assert setup.loaded("training") == set()  # training's pool was never touched

    # A proxy that starts restores every policy's production state from the store.
    fresh = setup.deployments()
    await setup.controller(fresh).follow()
    assert fresh.production is not None
    assert fresh.production.pool.policy("tenant-b") == (1, "tenant-b@v1")
    assert fresh.production.pool.policy("tenant-a") == (0, None)


async def test_each_adapter_has_its_own_canary(setup: Setup) -> None:
    d = setup.deployments()
    production = setup.controller(d)
    await setup.push("tenant-a", 1)
    await setup.push("tenant-a", 2)
    await setup.push("tenant-b", 1)
    await production.promote(1, adapter="tenant-b")
    status = await production.promote(1, CanarySplit(2, 0.5), adapter="tenant-a")
    assert status["canary"] == {"version": 2, "fraction": 0.5}
    assert d.canary is not None and d.canary.pool.policy("tenant-a") == (2, "tenant-a@v2")
    assert d.split is None and d.split_of("tenant-b") is None
    keys = [f"conversation-{i}" for i in range(200)]
    to_canary = [
        k for k in keys if d.route(production=True, sticky_key=k, adapter="tenant-a") is d.canary
    ]
    assert 60 < len(to_canary) < 140  # about half of tenant-a's production sessions
    assert all(
        d.route(production=True, sticky_key=k, adapter="tenant-b") is d.production for k in keys
    )
    assert all(d.route(production=True, sticky_key=k) is d.production for k in keys)
    await production.rollback(adapter="tenant-a")  # drops tenant-a's canary only
    assert d.split_of("tenant-a") is None


async def test_the_eval_gate_compares_an_adapters_own_scores(setup: Setup) -> None:
    production = setup.controller(setup.deployments())
    await setup.push("tenant-a", 1)
    await setup.push("tenant-a", 2)
    await setup.store.record_version_eval(version=0, score=0.2, adapter="tenant-a")
    await setup.store.record_version_eval(version=1, score=0.6, adapter="tenant-a")
    await setup.store.record_version_eval(version=2, score=0.5, adapter="tenant-a")
    await setup.store.record_version_eval(version=2, score=0.9)  # the base's version 2
    await production.promote(1, require_eval=True, adapter="tenant-a")
    with pytest.raises(Conflict, match="below production") as caught:
        await production.promote(2, require_eval=True, adapter="tenant-a")
    assert caught.value.code == "eval_below_production"
    versions = await production.versions(adapter="tenant-a")
    assert [(r["version"], r["eval"]["score"]) for r in versions["versions"]] == [
        (0, 0.2),
        (1, 0.6),
        (2, 0.5),
    ]
    assert versions["production"] == 1


async def test_the_store_says_which_base_version_production_and_the_canary_serve(
    setup: Setup,
) -> None:
    """What a replica's rejoin reads before it loads a shared backend (``fleet_version``):
    the base's production and canary versions as the store holds them, whoever changed them."""
    d = setup.deployments()
    started: list[Deployment] = []
    d.on_started = started.append
    production = setup.controller(d)
    read = {name: production.recorded_version(name) for name in NAMES}
    assert read["training"] is None  # training's versions only go up: no store read needed
    prod, canary = read["production"], read["canary"]
    assert prod is not None and canary is not None
    assert (await prod(), await canary()) == (0, None)  # never promoted
    for version in (1, 2):
        await setup.store.record_policy_version(version=version, path=f"/base/v{version}")
    await setup.push("tenant-a", 1)
    await production.promote(2, CanarySplit(1, 0.5))
    assert [s.name for s in started] == ["canary"]  # the canary started once, and was shared
    await production.promote(1, adapter="tenant-a")  # another policy's change
    assert (await prod(), await canary()) == (2, 1)
    await production.rollback()
    assert (await prod(), await canary()) == (0, None)
    # A fresh controller (another replica) reads the same: it is the store's, not a cache.
    other = setup.controller(setup.deployments()).recorded_version("production")
    assert other is not None and await other() == 0
