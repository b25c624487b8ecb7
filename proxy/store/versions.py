"""Policy version operations of the ``Store``: which weights carry which version number."""

from __future__ import annotations

import logging

from proxima.proxy.store.convert import policy_version_record
from proxima.proxy.store.errors import Conflict
from proxima.proxy.store.fleet import FleetMixin
from proxima.proxy.store.models import PolicyVersionRow, utcnow
from proxima.proxy.store.records import PolicyVersionRecord
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

logger = logging.getLogger(__name__)


class PolicyVersionsMixin(FleetMixin):
    """The history of policy (weights) versions pushed to the backends."""

    async def record_policy_version(self, *, version: int, path: str | None) -> PolicyVersionRecord:
        """Record a new policy version; versions only grow.

        Re-recording the newest version with the same path is a no-op (a
        retried weight push). Raises ``Conflict`` for a version that is not
        newer than the current one, or the same version with another path.
        """
        if version < 1:
            raise ValueError(f"policy versions start at 1, got {version}")
        try:
            return await self._insert_policy_version(version, path)
        except IntegrityError as exc:
            raise Conflict(f"policy version {version} was recorded concurrently") from exc

    async def _insert_policy_version(self, version: int, path: str | None) -> PolicyVersionRecord:
        async with self._write() as db:
            existing = await db.get(PolicyVersionRow, version)
            if existing is not None:
                if existing.path == path:
                    return policy_version_record(existing)
                raise Conflict(f"policy version {version} already recorded with another path")
            current = (await db.execute(select(func.max(PolicyVersionRow.version)))).scalar()
            if current is not None and version <= current:
                raise Conflict(f"policy version {version} is not newer than {current}")
            row = PolicyVersionRow(version=version, path=path, created_at=utcnow())
            db.add(row)
            await db.flush()
            await self.notify_change(db, f"policy:{version}")
        logger.info("policy version recorded", extra={"version": version, "path": path})
        return policy_version_record(row)

    async def current_policy_version(self) -> int:
        """The newest recorded policy version; 0 (the initial weights) when none."""
        async with self._read() as db:
            current = (await db.execute(select(func.max(PolicyVersionRow.version)))).scalar()
            return int(current or 0)

    async def list_policy_versions(self) -> list[PolicyVersionRecord]:
        """All recorded policy versions, oldest first."""
        query = select(PolicyVersionRow).order_by(PolicyVersionRow.version)
        async with self._read() as db:
            return [policy_version_record(row) for row in (await db.execute(query)).scalars()]
