"""Version registry operations of the ``Store``: eval scores and production promotions.

Pushed versions themselves are ``policy_versions`` (``versions.py``); this
mixin adds what an operator decides with them: the scores ``proxima eval``
measured for a version, and the append-only history of what production
served (each promotion or rollback is one row holding the state it set).
Both are per policy: ``adapter`` ``None`` is the base model's, a name an
adapter's; one policy's history never moves another's production.
"""

from __future__ import annotations

from proxima.proxy.policies.adapters import check_adapter
from proxima.proxy.store import values
from proxima.proxy.store._base import of_policy
from proxima.proxy.store.convert import promotion_record, version_eval_record
from proxima.proxy.store.fleet import FleetMixin
from proxima.proxy.store.models import PromotionRow, VersionEvalRow, utcnow
from proxima.proxy.store.records import PromotionRecord, VersionEvalRecord
from sqlalchemy import select


class RegistryMixin(FleetMixin):
    """Eval scores of versions and the production promotion history."""

    async def record_version_eval(
        self,
        *,
        version: int,
        score: float,
        items: int | None = None,
        name: str = "eval",
        adapter: str | None = None,
    ) -> VersionEvalRecord:
        """Remember one evaluation of the policy's ``version``; the newest one is its score."""
        values.integer(version, "version")
        values.integer(items, "items")
        values.finite(score, "score")
        values.text(name, "name")
        if version < 0:
            raise ValueError(f"policy versions are >= 0, got {version}")
        async with self._write() as db:
            row = VersionEvalRow(
                version=version,
                score=score,
                items=items,
                name=name,
                created_at=utcnow(),
                adapter=check_adapter(adapter),
            )
            db.add(row)
            await db.flush()
            return version_eval_record(row)

    async def latest_version_evals(
        self, *, adapter: str | None = None
    ) -> dict[int, VersionEvalRecord]:
        """The newest evaluation of every evaluated version of the policy ``adapter``."""
        query = (
            select(VersionEvalRow)
            .where(of_policy(VersionEvalRow.adapter, adapter))
            .order_by(VersionEvalRow.id)
        )
        async with self._read() as db:
            rows = (await db.execute(query)).scalars()
            return {row.version: version_eval_record(row) for row in rows}

    async def record_promotion(
        self,
        *,
        action: str,
        version: int,
        canary_version: int | None = None,
        canary_fraction: float | None = None,
        adapter: str | None = None,
    ) -> PromotionRecord:
        """Append a production change (``promote`` or ``rollback``) of the policy ``adapter``
        (``None``: the base) and the state it set."""
        if action not in ("promote", "rollback"):
            raise ValueError(f"unknown production action {action!r}")
        if (canary_version is None) != (canary_fraction is None):
            raise ValueError("a canary needs both a version and a fraction")
        async with self._write() as db:
            row = PromotionRow(
                action=action,
                version=version,
                canary_version=canary_version,
                canary_fraction=canary_fraction,
                created_at=utcnow(),
                adapter=check_adapter(adapter),
            )
            db.add(row)
            await db.flush()
            await self.notify_change(db, f"production:{row.id}")
            return promotion_record(row)

    async def list_promotions(self, *, adapter: str | None = None) -> list[PromotionRecord]:
        """Every production change of the policy ``adapter`` (``None``: the base), oldest first."""
        query = (
            select(PromotionRow)
            .where(of_policy(PromotionRow.adapter, adapter))
            .order_by(PromotionRow.id)
        )
        async with self._read() as db:
            return [promotion_record(row) for row in (await db.execute(query)).scalars()]
