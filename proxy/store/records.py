"""Domain records of the trajectory store.

These frozen dataclasses are what the store's repository functions return and
what the trainer consumes. They are separate from the ORM models (``models.py``)
so that callers never hold a live ORM object or a database session.

Token arrays are plain Python lists here; the store packs them compactly
(``int32`` / ``float32`` little-endian bytes) in the database.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class SessionKind(enum.StrEnum):
    TRAIN = "train"  # opened by the rollout controller through POST /rl/sessions
    PRODUCTION = "production"  # recorded production traffic (production API key)


class SessionStatus(enum.StrEnum):
    OPEN = "open"  # the agent may still generate
    FINISHED = "finished"  # POST /finish was called; trainable once it has a reward
    FAILED = "failed"  # the agent raised or timed out; never trained
    CLAIMED = "claimed"  # taken by a trainer (exactly once)
    TRAINED = "trained"  # consumed by a training step
    DROPPED = "dropped"  # claimed but too stale to train; counted, never trained


@dataclass(frozen=True, slots=True)
class SessionRecord:
    id: str
    kind: SessionKind
    status: SessionStatus
    group_id: str | None
    data_id: str | None
    metadata: dict[str, Any]
    reward: float | None
    created_at: datetime
    finished_at: datetime | None = None
    claimed_by: str | None = None
    # X-Session-Id / `user` of production traffic; the Idempotency-Key of a training session
    external_id: str | None = None
    api_key_id: str | None = None  # production key that owns the session, if any
    trained_version: int | None = None  # policy version the session was trained into
    adapter: str | None = None  # the policy it generates with: an adapter, None the base


@dataclass(frozen=True, slots=True)
class CompletionRecord:
    """One generated sequence (one choice of one request).

    ``prompt_ids + output_ids`` is exactly what the model saw and produced.
    ``output_logprobs[i]`` and ``output_versions[i]`` belong to ``output_ids[i]``.
    """

    id: str
    session_id: str
    parent_id: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str  # OpenAI finish reason: stop | length | tool_calls
    created_at: datetime
    request_messages: list[dict[str, Any]] | None = None  # chat requests only
    request_tools: list[dict[str, Any]] | None = None
    response_message: dict[str, Any] | None = None  # the assistant message returned
    response_text: str = ""
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, ... as sampled
    model: str = ""
    reward: float | None = None  # per-completion (per-turn) reward, if posted
    choice_index: int = 0
    finished_at: datetime | None = None
    time_to_first_token: float | None = None  # seconds
    duration: float | None = None  # seconds
    backend: str | None = None
    adapter: str | None = None  # the policy that generated it; ``output_versions`` are its
    # The grammar it was decoded under (None: unconstrained): ``{"kind": SGLang's grammar
    # parameter, "value": its text, "rules": "proxima-engine" | "sglang"}``. Its behaviour
    # logprobs are the masked distribution's, which the trainer recomputes by replaying it.
    grammar: dict[str, Any] | None = None

    @property
    def temperature(self) -> float:
        return float(self.sampling.get("temperature", 1.0))


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    id: str
    name: str
    record: bool  # record this key's traffic into production sessions
    created_at: datetime
    revoked_at: datetime | None = None
    adapter: str | None = None  # the policy the key serves (None: the base model)


@dataclass(frozen=True, slots=True)
class PolicyVersionRecord:
    version: int
    path: str | None
    created_at: datetime
    adapter: str | None = None  # whose version: an adapter's, or the base's (None)
    failed_at: datetime | None = None  # an adapter version that broke once served
    failure: str | None = None  # why (the backend's error)


@dataclass(frozen=True, slots=True)
class VersionEvalRecord:
    version: int
    score: float
    items: int | None
    name: str
    created_at: datetime
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class PromotionRecord:
    """A production change: ``action`` is ``promote`` or ``rollback``; the state it set."""

    id: int
    action: str
    version: int
    canary_version: int | None
    canary_fraction: float | None
    created_at: datetime
    adapter: str | None = None  # the policy whose production changed (None: the base)
