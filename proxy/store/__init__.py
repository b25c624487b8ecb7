"""The trajectory store: SQLAlchemy 2 async models and a keyword-only repository.

Typical use::

    from proxima.proxy.store import Store, ensure_schema

    await ensure_schema(url)          # Alembic upgrade to head
    store = await Store.open(url)
    ...
    await store.close()
"""

from __future__ import annotations

from proxima.proxy.store.database import create_engine, normalize_db_url
from proxima.proxy.store.errors import Conflict, NotFound, RewardAlreadySet, StoreError
from proxima.proxy.store.migrate import current_revision, downgrade, ensure_schema, upgrade
from proxima.proxy.store.records import (
    ApiKeyRecord,
    CompletionRecord,
    PolicyVersionRecord,
    SessionKind,
    SessionRecord,
    SessionStatus,
)
from proxima.proxy.store.store import Store

__all__ = [
    "ApiKeyRecord",
    "CompletionRecord",
    "Conflict",
    "NotFound",
    "PolicyVersionRecord",
    "RewardAlreadySet",
    "SessionKind",
    "SessionRecord",
    "SessionStatus",
    "Store",
    "StoreError",
    "create_engine",
    "current_revision",
    "downgrade",
    "ensure_schema",
    "normalize_db_url",
    "upgrade",
]
