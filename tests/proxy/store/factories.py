"""Builders of store records for the store tests."""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from proxima.proxy.store.records import CompletionRecord

_EPOCH = datetime(2025, 1, 1, tzinfo=UTC)


def key_hash(raw: str | None = None) -> str:
    """sha256 hex of a (random) raw key, as the API layer computes it."""
    return hashlib.sha256((raw or uuid.uuid4().hex).encode()).hexdigest()


def completion(session_id: str, *, seconds: float = 0.0, **fields: Any) -> CompletionRecord:
    """A small completion of ``session_id`` created ``seconds`` after a fixed epoch."""
    values: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "session_id": session_id,
        "parent_id": None,
        "prompt_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "output_logprobs": [-0.5, -0.25],
        "output_versions": [0, 1],
        "finish_reason": "stop",
        "created_at": _EPOCH + timedelta(seconds=seconds),
    }
    values.update(fields)
    return CompletionRecord(**values)
