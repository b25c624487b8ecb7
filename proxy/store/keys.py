"""API key and policy version operations of the ``Store``."""

from __future__ import annotations

import logging

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from proxy.store._base import StoreBase, new_id
from proxy.store.convert import api_key_record, policy_version_record
from proxy.store.errors import Conflict, NotFound
from proxy.store.models import ApiKeyRow, PolicyVersionRow, utcnow
from proxy.store.records import ApiKeyRecord, PolicyVersionRecord

logger = logging.getLogger(__name__)


class ApiKeysMixin(StoreBase):
    """Production API keys; the store only ever sees their sha256 hashes."""

    async def create_api_key(self, *, name: str, key_hash: str, record: bool) -> ApiKeyRecord:
        """Register a production key by its hash. Raises ``Conflict`` on a duplicate hash."""
        row = ApiKeyRow(
            id=new_id(), name=name, key_hash=key_hash, record=record, created_at=utcnow()
        )
        try:
            async with self._write() as db:
                db.add(row)
                await db.flush()
        except IntegrityError as exc:
            raise Conflict("an API key with this hash already exists") from exc
        logger.info("api key created", extra={"key_id": row.id, "key_name": name})
        return api_key_record(row)

    async def get_api_key(self, *, key_id: str) -> ApiKeyRecord | None:
        """The key with this id (revoked or not), or ``None``."""
        async with self._read() as db:
            row = await db.get(ApiKeyRow, key_id)
            return None if row is None else api_key_record(row)

    async def get_api_key_by_hash(self, *, key_hash: str) -> ApiKeyRecord | None:
        """The active (not revoked) key with this hash, or ``None``."""
        query = select(ApiKeyRow).where(
            ApiKeyRow.key_hash == key_hash, ApiKeyRow.revoked_at.is_(None)
        )
        async with self._read() as db:
            row = (await db.execute(query)).scalar_one_or_none()
            return None if row is None else api_key_record(row)

    async def list_api_keys(self) -> list[ApiKeyRecord]:
        """All keys, revoked ones included, oldest first."""
        query = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id)
        async with self._read() as db:
            return [api_key_record(row) for row in (await db.execute(query)).scalars()]

    async def revoke_api_key(self, *, key_id: str) -> ApiKeyRecord:
        """Revoke a key (idempotent: the first revocation time is kept). ``NotFound`` if unknown."""
        async with self._write() as db:
            row = await db.get(ApiKeyRow, key_id)
            if row is None:
                raise NotFound(f"api key {key_id} not found")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                logger.info("api key revoked", extra={"key_id": key_id})
            await db.flush()
            return api_key_record(row)


class PolicyVersionsMixin(StoreBase):
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
