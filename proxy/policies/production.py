"""Promotion, canary and rollback of the production deployment.

``ProductionController`` is what the ``/admin/production`` and
``/admin/versions`` routes call. A promotion loads a registered version
(``policy_versions``; version 0 is the model the server started with) into
the production pool, and optionally another one into the canary pool, then
appends the new state to the promotion history in the store; a restarted
proxy restores the newest state from there.

Safe under load: loading is the pool's weight update, so production
generations in flight are interrupted and resumed token-exactly on the new
weights (each token keeps the version that produced it); none fails.
Sessions already routed keep their pool for the whole completion.

A promotion that fails (a version that cannot load, in production or in the
canary) changes nothing: what was served is still served, the split stays,
and nothing is recorded.

Rollback goes back to the version promoted before the current one. The
history is a stack: a promotion pushes, a rollback pops, so rolling back
twice goes back two promotions; the initial state (version 0) is the bottom.
A rollback drops the canary.

Every policy has its own production state: ``adapter`` names one (None:
the base model). A promotion of adapter A loads A's version (its LoRA) on the
production pool beside the others and records A's history only; the base's
and every other adapter's versions, canaries and histories are untouched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from proxima.proxy.backends.errors import BackendError, BackendUnavailable
from proxima.proxy.errors import BadRequest, Conflict, NotFound
from proxima.proxy.policies.adapters import policy_label
from proxima.proxy.policies.deployments import (
    CANARY,
    PRODUCTION,
    TRAINING,
    CanarySplit,
    Deployment,
    Deployments,
)
from proxima.proxy.store.records import PromotionRecord
from proxima.proxy.store.store import Store

logger = logging.getLogger(__name__)


def promotion_stack(history: Sequence[PromotionRecord]) -> list[PromotionRecord]:
    """The promotions still in effect: each promotion pushes, each rollback pops one."""
    stack: list[PromotionRecord] = []
    for entry in history:
        if entry.action == "promote":
            stack.append(entry)
        elif stack:
            stack.pop()
    return stack


def rollback_target(history: Sequence[PromotionRecord]) -> int | None:
    """The version a rollback returns to; ``None`` when nothing was promoted."""
    stack = promotion_stack(history)
    if not stack:
        return None
    return stack[-2].version if len(stack) >= 2 else 0


def _history_entry(entry: PromotionRecord) -> dict[str, Any]:
    return {
        "action": entry.action,
        "version": entry.version,
        "canary": None
        if entry.canary_version is None
        else {"version": entry.canary_version, "fraction": entry.canary_fraction},
        "at": entry.created_at.isoformat(),
    }


class ProductionController:
    """Changes what the production deployment serves, one change at a time."""

    def __init__(self, *, deployments: Deployments, store: Store, base_model_path: str):
        self.deployments = deployments
        self.store = store
        self.base_model_path = base_model_path
        self._lock = asyncio.Lock()

    def _production(self) -> Deployment:
        if self.deployments.production is None:
            raise Conflict(
                "Production follows the trainer on this proxy: start proxima serve with "
                "--production-backend URL or --production-engine to pin a version.",
                code="no_production_deployment",
            )
        return self.deployments.production

    async def path_of(self, version: int, adapter: str | None = None) -> str:
        """Where the registry says ``version`` of the policy is ("" for an adapter's
        version 0: the bare base, nothing to load)."""
        if version == 0:
            return self.base_model_path if adapter is None else ""
        for record in await self.store.list_policy_versions(adapter=adapter):
            if record.version == version:
                if not record.path:
                    raise Conflict(f"Version {version} was pushed without a path.")
                return record.path
        whose = "" if adapter is None else f" of adapter {adapter}"
        listing = "/admin/versions" if adapter is None else f"/admin/versions?adapter={adapter}"
        raise NotFound(
            f"Version {version}{whose} is not registered; GET {listing} lists them.",
            param="version",
            code="version_not_found",
        )

    async def _load(
        self, deployment: Deployment, version: int, path: str, adapter: str | None = None
    ) -> None:
        pool = deployment.pool
        if pool.policy(adapter)[0] == version:
            return
        try:
            if adapter is None:
                await pool.update_weights(version=version, path=path)
            else:
                await pool.update_adapter(adapter=adapter, version=version, path=path or None)
        except BackendUnavailable:
            raise  # no backend to load into: a 503, not the version's fault
        except BackendError as exc:
            raise BadRequest(
                f"The {deployment.name} backends could not load version {version} of "
                f"{policy_label(adapter)} from {path}: {exc}",
                param="version",
            ) from exc
        logger.info("%s now serves %s version %s", deployment.name, policy_label(adapter), version)

    async def _apply(
        self, version: int, canary: CanarySplit | None, adapter: str | None = None
    ) -> None:
        """Serve ``version`` of the policy in production and ``canary`` beside it, or change
        nothing.

        The canary is loaded first, so a canary that cannot load leaves production
        untouched; if production then fails to load, the canary pool goes back to
        the version it served. The split changes only once both have loaded. Only
        this policy's versions and split change.
        """
        production = self._production()
        paths = {version: await self.path_of(version, adapter)}
        if canary is None:
            await self._load(production, version, paths[version], adapter)
            # The canary pool keeps finishing what it has in flight; no new session goes there.
            self.deployments.set_split(adapter, None)
            return
        paths[canary.version] = await self.path_of(canary.version, adapter)
        canary_deployment = await self.deployments.canary_deployment()
        served = canary_deployment.pool.policy(adapter)[0]
        await self._load(canary_deployment, canary.version, paths[canary.version], adapter)
        try:
            await self._load(production, version, paths[version], adapter)
        except BadRequest:
            await self._reload(canary_deployment, served, adapter)
            raise
        self.deployments.set_split(adapter, canary)

    async def _reload(self, deployment: Deployment, version: int, adapter: str | None) -> None:
        """Put ``version`` back on ``deployment`` after a failed change (logged if it fails)."""
        try:
            await self._load(deployment, version, await self.path_of(version, adapter), adapter)
        except (BadRequest, NotFound, Conflict):
            logger.exception("%s could not go back to version %s", deployment.name, version)

    async def _check_eval(self, version: int, adapter: str | None = None) -> None:
        """Refuse ``version`` unless its newest score is at least production's (per policy)."""
        current = self._production().pool.policy(adapter)[0]
        scores = await self.store.latest_version_evals(adapter=adapter)
        flag = "" if adapter is None else f" --adapter {adapter}"
        if version not in scores:
            raise Conflict(
                f"Version {version} has no eval score; run proxima eval --version {version}"
                f"{flag} first, or promote without --require-eval.",
                param="version",
                code="eval_missing",
            )
        if current not in scores:
            raise Conflict(
                f"The production version {current} has no eval score to compare with; run "
                f"proxima eval --version {current}{flag} first.",
                param="version",
                code="eval_missing",
            )
        if scores[version].score < scores[current].score:
            raise Conflict(
                f"Version {version} scored {scores[version].score:.4g}, below production "
                f"version {current} ({scores[current].score:.4g}); not promoted.",
                param="version",
                code="eval_below_production",
            )

    # ------------------------------------------------------------------ actions
    def recorded_version(self, deployment: str) -> Callable[[], Awaitable[int | None]] | None:
        """How to read the base model's version the store says ``deployment`` serves now
        (``BackendPool.fleet_version``): production's is the newest change's (0: never
        promoted), the canary's that change's canary (None without one: any will do). None
        for training, whose versions only go up (a backend behind is behind)."""

        async def production() -> int | None:
            newest = await self._newest_promotion()
            return newest.version if newest else 0

        async def canary() -> int | None:
            newest = await self._newest_promotion()
            return newest.canary_version if newest else None

        return {PRODUCTION: production, CANARY: canary}.get(deployment)

    async def _newest_promotion(self) -> PromotionRecord | None:
        """The base model's newest production change in the store (None: never promoted)."""
        history = await self.store.list_promotions()
        return history[-1] if history else None

    async def follow(self) -> None:
        """Serve the newest production state in the store, which any replica may have set.

        The backends are shared by the fleet: those that serve the state's
        versions already are adopted (``BackendPool.follow``); only the ones
        behind are loaded. Called at start-up and by the fleet follower. Every
        adapter's production state is restored too.
        """
        d = self.deployments
        if d.production is None:
            return
        history = await self.store.list_promotions()
        async with self._lock:
            if history:
                await self._follow_base(history[-1])
            for adapter in await self.store.adapter_heads():
                promoted = await self.store.list_promotions(adapter=adapter)
                if promoted:
                    await self._follow_adapter(adapter, promoted[-1])

    async def _follow_base(self, last: PromotionRecord) -> None:
        d = self.deployments
        assert d.production is not None
        await d.production.pool.follow(last.version, await self.path_of(last.version))
        if last.canary_version is None or last.canary_fraction is None:
            d.split = None
            return
        if not d.can_canary:
            logger.warning("the recorded canary needs canary backends; serving without it")
            d.split = None
            return
        canary = await d.canary_deployment()
        await canary.pool.follow(last.canary_version, await self.path_of(last.canary_version))
        d.split = CanarySplit(last.canary_version, last.canary_fraction)

    async def _follow_adapter(self, adapter: str, last: PromotionRecord) -> None:
        """Serve an adapter's recorded production state (logged, not raised, if it fails)."""
        canary = None
        if last.canary_version is not None and last.canary_fraction is not None:
            canary = CanarySplit(last.canary_version, last.canary_fraction)
            if not self.deployments.can_canary:
                logger.warning("adapter %s's canary needs canary backends; dropped", adapter)
                canary = None
        try:
            await self._apply(last.version, canary, adapter)
        except (BadRequest, NotFound, Conflict) as exc:
            logger.error("adapter %s's production state could not be restored: %s", adapter, exc)

    async def promote(
        self,
        version: int,
        canary: CanarySplit | None = None,
        *,
        require_eval: bool = False,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        """Serve ``version`` of the policy ``adapter`` (None: the base) to its production
        keys; other policies' production is untouched."""
        self._production()
        if canary is not None and canary.version == version:
            raise BadRequest(
                "The canary version must differ from the promoted version.", param="canary"
            )
        async with self.store.publish_lock(), self._lock:
            if require_eval:
                await self._check_eval(version, adapter)
            await self._apply(version, canary, adapter)
            await self.store.record_promotion(
                action="promote",
                version=version,
                canary_version=canary.version if canary else None,
                canary_fraction=canary.fraction if canary else None,
                adapter=adapter,
            )
        return await self.status(adapter)

    async def rollback(self, adapter: str | None = None) -> dict[str, Any]:
        """The policy's production back to the version promoted before its current one."""
        self._production()
        async with self.store.publish_lock(), self._lock:
            target = rollback_target(await self.store.list_promotions(adapter=adapter))
            if target is None:
                raise Conflict(
                    f"Nothing to roll back: no version of {policy_label(adapter)} was promoted.",
                    code="nothing_to_roll_back",
                )
            await self._apply(target, None, adapter)
            await self.store.record_promotion(action="rollback", version=target, adapter=adapter)
        return await self.status(adapter)

    # ------------------------------------------------------------------- views
    async def status(self, adapter: str | None = None) -> dict[str, Any]:
        d = self.deployments
        history = await self.store.list_promotions(adapter=adapter)
        production = d.production or d.training
        split = d.split_of(adapter)
        return {
            "adapter": adapter,
            "mode": "pinned" if d.separate else "follows_training",
            "version": production.pool.policy(adapter)[0],
            "canary": None
            if split is None
            else {"version": split.version, "fraction": split.fraction},
            "rollback_to": rollback_target(history) if d.separate else None,
            "history": [_history_entry(h) for h in history],
            "deployments": {
                PRODUCTION: production.describe(),
                CANARY: d.canary.describe() if d.canary is not None else None,
            },
        }

    async def versions(self, adapter: str | None = None) -> dict[str, Any]:
        d = self.deployments
        evals = await self.store.latest_version_evals(adapter=adapter)
        rows: list[dict[str, Any]] = [
            {
                "version": 0,
                "path": self.base_model_path if adapter is None else None,
                "pushed_at": None,
                "failed": None,
            }
        ]
        rows += [
            {
                "version": r.version,
                "path": r.path,
                "pushed_at": r.created_at.isoformat(),
                # An adapter version that broke once served (AdapterGuard): when, and why.
                "failed": None
                if r.failed_at is None
                else {"at": r.failed_at.isoformat(), "reason": r.failure},
            }
            for r in await self.store.list_policy_versions(adapter=adapter)
        ]
        for row in rows:
            ev = evals.get(row["version"])
            row["eval"] = (
                None
                if ev is None
                else {
                    "score": ev.score,
                    "items": ev.items,
                    "name": ev.name,
                    "at": ev.created_at.isoformat(),
                }
            )
            row["served_by"] = (
                d.names_serving(row["version"])
                if adapter is None
                else _names_serving_adapter(d, adapter, row["version"])
            )
        production = d.production or d.training
        split = d.split_of(adapter)
        return {
            "adapter": adapter,
            "versions": rows,
            "training": d.training.pool.policy(adapter)[0],
            "production": production.pool.policy(adapter)[0],
            "canary": None
            if split is None
            else {"version": split.version, "fraction": split.fraction},
        }


def _names_serving_adapter(d: Deployments, adapter: str, version: int) -> list[str]:
    names = []
    if d.training.pool.adapter_version(adapter) == version:
        names.append(TRAINING)
    if (d.production or d.training).pool.adapter_version(adapter) == version:
        names.append(PRODUCTION)
    split = d.split_of(adapter)
    if (
        d.canary is not None
        and split is not None
        and d.canary.pool.adapter_version(adapter) == version
    ):
        names.append(CANARY)
    return names
