"""Deployment routing, the canary split, and the promotion history as a stack."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.errors import Conflict, NotFound
from proxima.proxy.policies.deployments import (
    CanarySplit,
    Deployment,
    Deployments,
    canary_bucket,
    split_model_version,
)
from proxima.proxy.policies.production import ProductionController, promotion_stack, rollback_target
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.store.records import PromotionRecord


def _deployment(name: str, version: int = 0) -> Deployment:
    http = httpx.AsyncClient()
    return Deployment(name, BackendPool([f"http://127.0.0.1:1/{name}"], http=http, version=version))


def _entry(i: int, action: str, version: int, canary: int | None = None) -> PromotionRecord:
    return PromotionRecord(
        id=i,
        action=action,
        version=version,
        canary_version=canary,
        canary_fraction=None if canary is None else 0.1,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def test_canary_bucket_is_fixed_and_uniform() -> None:
    keys = [f"session-{i}" for i in range(4000)]
    buckets = [canary_bucket(k) for k in keys]
    assert buckets == [canary_bucket(k) for k in keys]  # sticky: same key, same place
    assert all(0.0 <= b < 1.0 for b in buckets)
    below = sum(b < 0.25 for b in buckets) / len(buckets)
    assert below == pytest.approx(0.25, abs=0.03)


def test_split_model_version() -> None:
    assert split_model_version("tiny@v3") == ("tiny", 3)
    assert split_model_version("org/model@v0") == ("org/model", 0)
    assert split_model_version("tiny") == ("tiny", None)
    assert split_model_version("tiny@3") == ("tiny@3", None)
    assert split_model_version("tiny@vx") == ("tiny@vx", None)


def test_without_production_everything_goes_to_training() -> None:
    d = Deployments(_deployment("training", 4))
    assert not d.separate and not d.can_canary
    assert d.route(production=True, sticky_key="s") is d.training
    assert d.route(production=False, sticky_key=None) is d.training
    assert d.names_serving(4) == ["training", "production"]


async def test_production_keys_go_to_production_and_the_canary_by_hash() -> None:
    training, production, canary = (
        _deployment("training", 7),
        _deployment("production", 1),
        _deployment("canary", 2),
    )

    async def start_canary() -> Deployment:
        return canary

    d = Deployments(training, production, canary_factory=start_canary)
    assert d.route(production=False, sticky_key="s") is training
    assert d.route(production=True, sticky_key="s") is production
    assert await d.canary_deployment() is canary
    d.split = CanarySplit(version=2, fraction=0.3)
    keys = [f"k{i}" for i in range(200)]
    for key in keys:
        want = canary if canary_bucket(key) < 0.3 else production
        assert d.route(production=True, sticky_key=key) is want
        assert d.route(production=True, sticky_key=key) is want  # every turn alike
    for backend in canary.pool.backends:  # the canary is down: its sessions go to stable
        canary.pool.mark_failed(backend, ConnectionError("gone"))
    assert all(d.route(production=True, sticky_key=k) is production for k in keys)
    for backend in canary.pool.backends:
        backend.healthy = True
    d.split = CanarySplit(version=2, fraction=0.0)
    assert all(d.route(production=True, sticky_key=k) is production for k in keys)
    # An explicit version goes to whoever serves it; the canary counts while split.
    assert d.route(production=False, sticky_key=None, version=2) is canary
    assert d.route(production=False, sticky_key=None, version=7) is training
    assert d.names_serving(2) == ["canary"]
    with pytest.raises(Conflict, match="--canary 5 --fraction 0"):
        d.serving(5)


async def test_an_adapters_version_by_name_goes_to_whoever_serves_that_adapter_version() -> None:
    """``<model>:<adapter>@v<N>`` (``proxima eval --version N --adapter A``): the deployment
    serving version N *of that adapter*; the base's versions say nothing about it."""
    from proxima.proxy.backends.pool import AdapterVersion

    training, production, canary = (
        _deployment("training", 1),
        _deployment("production", 1),
        _deployment("canary", 1),
    )

    async def start_canary() -> Deployment:
        return canary

    d = Deployments(training, production, canary_factory=start_canary)
    await d.canary_deployment()
    for deployment, version in ((training, 3), (production, 2), (canary, 1)):
        deployment.pool.adapters["tenant-a"] = AdapterVersion("tenant-a", version, f"/a{version}")

    def serving(version: int, adapter: str | None) -> Deployment:
        return d.route(production=False, sticky_key=None, version=version, adapter=adapter)

    assert serving(3, "tenant-a") is training and serving(2, "tenant-a") is production
    with pytest.raises(Conflict, match="version 1 of adapter tenant-a.*--adapter tenant-a"):
        serving(1, "tenant-a")  # the canary counts only while tenant-a has a split
    d.set_split("tenant-a", CanarySplit(version=1, fraction=0.0))
    assert serving(1, "tenant-a") is canary
    assert serving(0, "tenant-b") is production  # never pushed: every pool serves its v0
    assert serving(1, None) is production  # the base: its own versions
    with pytest.raises(Conflict, match="version 3 now"):
        serving(3, None)


async def test_canary_without_backends_is_refused() -> None:
    d = Deployments(_deployment("training"), _deployment("production"))
    with pytest.raises(Conflict, match="--canary-backend"):
        await d.canary_deployment()


def test_rollback_pops_the_promotion_stack() -> None:
    assert rollback_target([]) is None
    history = [_entry(1, "promote", 1)]
    assert rollback_target(history) == 0  # before the first promotion: the base model
    history += [_entry(2, "promote", 1, canary=2), _entry(3, "promote", 2)]
    assert [e.id for e in promotion_stack(history)] == [1, 2, 3]
    assert rollback_target(history) == 1
    history.append(_entry(4, "rollback", 1))
    assert [e.id for e in promotion_stack(history)] == [1, 2]
    assert rollback_target(history) == 1
    history.append(_entry(5, "rollback", 1))
    assert rollback_target(history) == 0
    history.append(_entry(6, "rollback", 0))
    assert rollback_target(history) is None


async def test_eval_gate_needs_both_scores_and_refuses_a_lower_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    store = await Store.open(url)
    try:
        await store.record_policy_version(version=1, path="/w/v1")
        await store.record_policy_version(version=2, path="/w/v2")
        controller = ProductionController(
            deployments=Deployments(_deployment("training", 2), _deployment("production", 1)),
            store=store,
            base_model_path="/base",
        )
        assert await controller.path_of(0) == "/base"
        assert await controller.path_of(2) == "/w/v2"
        with pytest.raises(NotFound, match="not registered"):
            await controller.path_of(3)

        with pytest.raises(Conflict, match="Version 2 has no eval score") as exc:
            await controller.promote(2, require_eval=True)
        assert exc.value.code == "eval_missing"
        await store.record_version_eval(version=2, score=0.4)
        with pytest.raises(Conflict, match="production version 1 has no eval score"):
            await controller.promote(2, require_eval=True)
        await store.record_version_eval(version=1, score=0.5)
        with pytest.raises(Conflict, match=r"scored 0.4, below production version 1 \(0.5\)"):
            await controller.promote(2, require_eval=True)
        assert await store.list_promotions() == []  # nothing refused was recorded

        # A score equal to production's passes; production already serves 1, so no load.
        state = await controller.promote(1, require_eval=True)
        assert (state["version"], state["rollback_to"]) == (1, 0)
        assert [h["action"] for h in state["history"]] == ["promote"]
    finally:
        await store.close()
