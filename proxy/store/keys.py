"""Production API key operations of the ``Store``."""

from __future__ import annotations

import logging

from proxima.proxy.policies.adapters import check_adapter
from proxima.proxy.store._base import StoreBase, new_id
from proxima.proxy.store.convert import api_key_record
from proxima.proxy.store.errors import Conflict, NotFound
from proxima.proxy.store.models import ApiKeyRow, utcnow
from proxima.proxy.store.records import ApiKeyRecord
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

logger = logging.getLogger(__name__)


class ApiKeysMixin(StoreBase):
    """Production API keys; the store only ever sees their sha256 hashes."""

    async def create_api_key(
        self, *, name: str, key_hash: str, record: bool, adapter: str | None = None
    ) -> ApiKeyRecord:
        """Register a production key by its hash, bound to the policy ``adapter`` (``None``:
        the base model). Raises ``Conflict`` on a duplicate hash."""
        row = ApiKeyRow(
            id=new_id(),
            name=name,
            key_hash=key_hash,
            record=record,
            created_at=utcnow(),
            adapter=check_adapter(adapter),
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
