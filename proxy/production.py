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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from proxima.proxy.backends.errors import BackendError, BackendUnavailable
from proxima.proxy.deployments import CANARY, PRODUCTION, CanarySplit, Deployment, Deployments
from proxima.proxy.errors import BadRequest, Conflict, NotFound
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

    async def path_of(self, version: int) -> str:
        """Where the registry says ``version``'s weights are."""
        if version == 0:
            return self.base_model_path
        for record in await self.store.list_policy_versions():
            if record.version == version:
                if not record.path:
                    raise Conflict(f"Version {version} was pushed without a path.")
                return record.path
        raise NotFound(
            f"Version {version} is not registered; GET /admin/versions lists them.",
            param="version",
            code="version_not_found",
        )

    async def _load(self, deployment: Deployment, version: int, path: str) -> None:
        if deployment.version == version:
            return
        try:
            await deployment.pool.update_weights(version=version, path=path)
        except BackendUnavailable:
            raise  # no backend to load into: a 503, not the version's fault
        except BackendError as exc:
            raise BadRequest(
                f"The {deployment.name} backends could not load version {version} from "
                f"{path}: {exc}",
                param="version",
            ) from exc
        logger.info("%s now serves version %s", deployment.name, version)

    async def _apply(self, version: int, canary: CanarySplit | None) -> None:
        """Serve ``version`` in production and ``canary`` beside it, or change nothing.

        The canary is loaded first, so a canary that cannot load leaves production
        untouched; if production then fails to load, the canary pool goes back to
        the version it served. The split changes only once both have loaded.
        """
        production = self._production()
        paths = {version: await self.path_of(version)}
        if canary is None:
            await self._load(production, version, paths[version])
            # The canary pool keeps finishing what it has in flight; no new session goes there.
            self.deployments.split = None
            return
        paths[canary.version] = await self.path_of(canary.version)
        canary_deployment = await self.deployments.canary_deployment()
        served = canary_deployment.version
        await self._load(canary_deployment, canary.version, paths[canary.version])
        try:
            await self._load(production, version, paths[version])
        except BadRequest:
            await self._reload(canary_deployment, served)
            raise
        self.deployments.split = canary

    async def _reload(self, deployment: Deployment, version: int) -> None:
        """Put ``version`` back on ``deployment`` after a failed change (logged if it fails)."""
        try:
            await self._load(deployment, version, await self.path_of(version))
        except (BadRequest, NotFound, Conflict):
            logger.exception("%s could not go back to version %s", deployment.name, version)

    async def _check_eval(self, version: int) -> None:
        """Refuse ``version`` unless its newest score is at least production's."""
        current = self._production().version
        scores = await self.store.latest_version_evals()
        if version not in scores:
            raise Conflict(
                f"Version {version} has no eval score; run proxima eval --version {version} "
                "first, or promote without --require-eval.",
                param="version",
                code="eval_missing",
            )
        if current not in scores:
            raise Conflict(
                f"The production version {current} has no eval score to compare with; run "
                f"proxima eval --version {current} first.",
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
    async def follow(self) -> None:
        """Serve the newest production state in the store, which any replica may have set.

        The backends are shared by the fleet: those that serve the state's
        versions already are adopted (``BackendPool.follow``); only the ones
        behind are loaded. Called at start-up and by the fleet follower.
        """
        d = self.deployments
        if d.production is None:
            return
        history = await self.store.list_promotions()
        if not history:
            return
        last = history[-1]
        async with self._lock:
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

    async def promote(
        self, version: int, canary: CanarySplit | None = None, *, require_eval: bool = False
    ) -> dict[str, Any]:
        self._production()
        if canary is not None and canary.version == version:
            raise BadRequest(
                "The canary version must differ from the promoted version.", param="canary"
            )
        async with self.store.publish_lock(), self._lock:
            if require_eval:
                await self._check_eval(version)
            await self._apply(version, canary)
            await self.store.record_promotion(
                action="promote",
                version=version,
                canary_version=canary.version if canary else None,
                canary_fraction=canary.fraction if canary else None,
            )
        return await self.status()

    async def rollback(self) -> dict[str, Any]:
        self._production()
        async with self.store.publish_lock(), self._lock:
            target = rollback_target(await self.store.list_promotions())
            if target is None:
                raise Conflict(
                    "Nothing to roll back: no version was promoted.", code="nothing_to_roll_back"
                )
            await self._apply(target, None)
            await self.store.record_promotion(action="rollback", version=target)
        return await self.status()

    # ------------------------------------------------------------------- views
    async def status(self) -> dict[str, Any]:
        d = self.deployments
        history = await self.store.list_promotions()
        production = d.production or d.training
        split = d.split
        return {
            "mode": "pinned" if d.separate else "follows_training",
            "version": production.version,
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

    async def versions(self) -> dict[str, Any]:
        d = self.deployments
        evals = await self.store.latest_version_evals()
        rows: list[dict[str, Any]] = [
            {"version": 0, "path": self.base_model_path, "pushed_at": None}
        ]
        rows += [
            {"version": r.version, "path": r.path, "pushed_at": r.created_at.isoformat()}
            for r in await self.store.list_policy_versions()
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
            row["served_by"] = d.names_serving(row["version"])
        production = d.production or d.training
        return {
            "versions": rows,
            "training": d.training.version,
            "production": production.version,
            "canary": None
            if d.split is None
            else {"version": d.split.version, "fraction": d.split.fraction},
        }
