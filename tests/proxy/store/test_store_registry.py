"""The version registry: eval scores per version and the production promotion history."""

from __future__ import annotations

import pytest
from proxima.proxy.store import Store


async def test_version_evals_newest_wins(store: Store) -> None:
    assert await store.latest_version_evals() == {}
    await store.record_version_eval(version=0, score=0.2, items=50, name="arith")
    await store.record_version_eval(version=3, score=0.5, items=50)
    await store.record_version_eval(version=0, score=0.25, items=50, name="arith")
    latest = await store.latest_version_evals()
    assert sorted(latest) == [0, 3]
    assert latest[0].score == pytest.approx(0.25) and latest[0].name == "arith"
    assert latest[3].items == 50 and latest[3].name == "eval"
    with pytest.raises(ValueError, match=">= 0"):
        await store.record_version_eval(version=-1, score=1.0)


async def test_promotions_are_an_ordered_history(store: Store) -> None:
    assert await store.list_promotions() == []
    first = await store.record_promotion(action="promote", version=1)
    second = await store.record_promotion(
        action="promote", version=1, canary_version=2, canary_fraction=0.25
    )
    await store.record_promotion(action="rollback", version=1)
    history = await store.list_promotions()
    assert [(p.action, p.version, p.canary_version) for p in history] == [
        ("promote", 1, None),
        ("promote", 1, 2),
        ("rollback", 1, None),
    ]
    assert history[0] == first and history[1] == second
    assert history[1].canary_fraction == pytest.approx(0.25)
    assert first.id < second.id and first.created_at <= second.created_at
    with pytest.raises(ValueError, match="both"):
        await store.record_promotion(action="promote", version=1, canary_version=2)
    with pytest.raises(ValueError, match="unknown"):
        await store.record_promotion(action="demote", version=1)
