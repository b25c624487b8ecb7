"""Policy version operations of the ``Store``: which weights carry which version number.

Every policy has its own sequence: the base model's versions are
``policy_versions``, each adapter's are ``adapter_versions`` rows of its name
(from 1; an adapter's version 0 is the base weights with no adapter applied).

An adapter version that, once served, yields non-finite logprobs is marked failed
(``fail_adapter_version``): it keeps its number (a later push must be newer still)
but is never an adapter's head again, so every replica, and a restarted one, serves
the adapter's last good version instead.
"""

from __future__ import annotations

import logging

from proxima.proxy.policies.adapters import check_adapter, policy_label
from proxima.proxy.store import values
from proxima.proxy.store.convert import policy_version_record
from proxima.proxy.store.errors import Conflict, NotFound
from proxima.proxy.store.fleet import FleetMixin, newest_version
from proxima.proxy.store.models import AdapterVersionRow, PolicyVersionRow, utcnow
from proxima.proxy.store.records import PolicyVersionRecord
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

logger = logging.getLogger(__name__)


class PolicyVersionsMixin(FleetMixin):
    """The history of policy (weights or adapter) versions pushed to the backends."""

    async def record_policy_version(
        self, *, version: int, path: str | None, adapter: str | None = None
    ) -> PolicyVersionRecord:
        """Record a new version of the policy ``adapter`` (``None``: the base); versions only grow.

        Re-recording the newest version with the same path is a no-op (a
        retried weight push). Raises ``Conflict`` for a version that is not
        newer than the policy's current one, or the same version with another path.
        """
        check_adapter(adapter)
        values.integer(version, "version")
        values.text(path, "path")
        if version < 1:
            raise ValueError(f"policy versions start at 1, got {version}")
        try:
            return await self._insert_policy_version(version, path, adapter)
        except IntegrityError as exc:
            raise Conflict(
                f"{policy_label(adapter)} version {version} was recorded concurrently"
            ) from exc

    async def _insert_policy_version(
        self, version: int, path: str | None, adapter: str | None
    ) -> PolicyVersionRecord:
        async with self._write() as db:
            row: PolicyVersionRow | AdapterVersionRow | None
            if adapter is None:
                row = await db.get(PolicyVersionRow, version)
            else:
                row = await db.get(AdapterVersionRow, (adapter, version))
            if row is not None:
                if row.path == path:
                    return policy_version_record(row)
                raise Conflict(
                    f"{policy_label(adapter)} version {version} already recorded with another path"
                )
            current = await newest_version(db, adapter)
            if current and version <= current:
                raise Conflict(
                    f"{policy_label(adapter)} version {version} is not newer than {current}"
                )
            if adapter is None:
                row = PolicyVersionRow(version=version, path=path, created_at=utcnow())
            else:
                row = AdapterVersionRow(
                    adapter=adapter, version=version, path=path, created_at=utcnow()
                )
            db.add(row)
            await db.flush()
            notice = f"policy:{version}" if adapter is None else f"adapter:{adapter}:{version}"
            await self.notify_change(db, notice)
        logger.info(
            "policy version recorded",
            extra={"version": version, "path": path, "adapter": adapter},
        )
        return policy_version_record(row)

    async def current_policy_version(self, *, adapter: str | None = None) -> int:
        """The policy's newest recorded version; 0 (the initial weights) when none."""
        async with self._read() as db:
            return await newest_version(db, adapter)

    async def list_policy_versions(
        self, *, adapter: str | None = None
    ) -> list[PolicyVersionRecord]:
        """All recorded versions of the policy ``adapter`` (``None``: the base), oldest first."""
        async with self._read() as db:
            if adapter is None:
                base = select(PolicyVersionRow).order_by(PolicyVersionRow.version)
                return [policy_version_record(row) for row in (await db.execute(base)).scalars()]
            query = (
                select(AdapterVersionRow)
                .where(AdapterVersionRow.adapter == adapter)
                .order_by(AdapterVersionRow.version)
            )
            return [policy_version_record(row) for row in (await db.execute(query)).scalars()]

    async def adapter_heads(self) -> dict[str, PolicyVersionRecord]:
        """Every adapter's newest good version (what a backend must serve for it), by name;
        an adapter whose every version failed has none (it is served bare: version 0)."""
        newest = (
            select(AdapterVersionRow.adapter, func.max(AdapterVersionRow.version).label("v"))
            .where(AdapterVersionRow.failed_at.is_(None))
            .group_by(AdapterVersionRow.adapter)
            .subquery()
        )
        query = select(AdapterVersionRow).join(
            newest,
            (AdapterVersionRow.adapter == newest.c.adapter)
            & (AdapterVersionRow.version == newest.c.v),
        )
        async with self._read() as db:
            rows = (await db.execute(query)).scalars()
            return {row.adapter: policy_version_record(row) for row in rows}

    async def fail_adapter_version(
        self, *, adapter: str, version: int, reason: str
    ) -> PolicyVersionRecord | None:
        """Mark ``version`` of ``adapter`` failed (it broke once served; ``reason`` says how)
        and return the version to fall back to: the newest good one below it (None: version
        0, the bare base). Marking a version already failed keeps its first reason.
        ``NotFound`` when the version was never recorded."""
        check_adapter(adapter)
        async with self._write() as db:
            row = await db.get(AdapterVersionRow, (adapter, version))
            if row is None:
                raise NotFound(f"{policy_label(adapter)} has no version {version}")
            if row.failed_at is None:
                row.failed_at, row.failure = utcnow(), reason[:2000]
                await db.flush()
                await self.notify_change(db, f"adapter:{adapter}:failed:{version}")
                logger.warning(
                    "adapter version marked failed",
                    extra={"adapter": adapter, "version": version, "reason": reason},
                )
            query = (
                select(AdapterVersionRow)
                .where(
                    AdapterVersionRow.adapter == adapter,
                    AdapterVersionRow.version < version,
                    AdapterVersionRow.failed_at.is_(None),
                )
                .order_by(AdapterVersionRow.version.desc())
                .limit(1)
            )
            good = (await db.execute(query)).scalar_one_or_none()
            return None if good is None else policy_version_record(good)
