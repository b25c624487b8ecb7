"""SQLAlchemy ORM models of the trajectory store.

The schema itself is created only by the Alembic migrations in
``migrations/versions``; these models must stay in sync with them (a test
compares both). Callers never see these objects: the store converts rows to
the frozen records of ``records.py`` (see ``convert.py``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    Postgres stores ``timestamptz``; SQLite has no time zones, so values are
    converted to UTC before writing and tagged as UTC when read back.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; the store only accepts aware UTC times")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """Declarative base with a constraint naming convention shared with the migrations."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ApiKeyRow(Base):
    """A production API key; only its sha256 hash is stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)
    record: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # The policy this key serves: a named adapter, or NULL for the base model.
    adapter: Mapped[str | None] = mapped_column(String(64), nullable=True)


class SessionRow(Base):
    """One agent run (training) or one recorded production conversation."""

    __tablename__ = "sessions"
    __table_args__ = (
        UniqueConstraint("api_key_id", "external_id"),
        Index("ix_sessions_status_finished_at", "status", "finished_at"),
        Index("ix_sessions_kind_status", "kind", "status"),
        Index("ix_sessions_group_id", "group_id"),
        Index("ix_sessions_adapter_status", "adapter", "status"),
        Index("ix_sessions_created_at_id", "created_at", "id"),  # the inspector's list (0007)
        Index("ix_sessions_reward_id", "reward", "id"),  # ... ordered by reward (0007)
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    api_key_hash: Mapped[str | None] = mapped_column(
        String(128), nullable=True, unique=True, index=True
    )
    group_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    data_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    claimed_by: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # Production: the client's conversation id, unique per key. Training (no api_key_id):
    # the Idempotency-Key the admin opened it with, unique by the admission lock.
    external_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    api_key_id: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("api_keys.id"), nullable=True
    )
    trained_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The policy the session generates with (set at creation): an adapter, or NULL (the base).
    adapter: Mapped[str | None] = mapped_column(String(64), nullable=True)


class CompletionRow(Base):
    """One generated sequence; token arrays are packed bytes (see ``codec.py``), prompt,
    messages and tools stored as what they add to the parent's (see ``chains.py``)."""

    __tablename__ = "completions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("sessions.id", ondelete="CASCADE"), index=True
    )
    parent_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # What the row adds to its parent (see ``chains.py``): the first ``prompt_prefix``
    # prompt tokens, the first ``messages_prefix`` request messages and, with
    # ``tools_from_parent``, the tools are the parent's; the columns hold the rest.
    prompt_prefix: Mapped[int] = mapped_column(Integer, server_default="0")
    messages_prefix: Mapped[int] = mapped_column(Integer, server_default="0")
    tools_from_parent: Mapped[bool] = mapped_column(Boolean, server_default=false())
    prompt_ids: Mapped[bytes] = mapped_column(LargeBinary)
    output_ids: Mapped[bytes] = mapped_column(LargeBinary)
    output_logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    output_versions: Mapped[bytes] = mapped_column(LargeBinary)
    finish_reason: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    request_messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    request_tools: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    response_message: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # JSON, not text: a JSON string keeps NUL (``\u0000``), which PostgreSQL text cannot.
    response_text: Mapped[str] = mapped_column(JSON)
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    model: Mapped[str] = mapped_column(String(200))
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    choice_index: Mapped[int] = mapped_column(Integer)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    time_to_first_token: Mapped[float | None] = mapped_column(Float, nullable=True)
    duration: Mapped[float | None] = mapped_column(Float, nullable=True)
    backend: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # The policy that generated it (NULL: the base); ``output_versions`` are its versions.
    adapter: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The grammar it was decoded under (NULL: none): ``{"kind", "value", "rules"}``, replayed
    # by the trainer over the output tokens (``trainer/constrained.py``); migration 0009.
    grammar: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class PolicyVersionRow(Base):
    """A policy (weights) version pushed to the inference backends."""

    __tablename__ = "policy_versions"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    path: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AdapterVersionRow(Base):
    """A version of a named adapter pushed to the backends (its own sequence, from 1)."""

    __tablename__ = "adapter_versions"

    adapter: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    path: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Set when the version, once served, yielded non-finite logprobs and the adapter fell
    # back to its last good version (0008); a failed version is never a head again.
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    failure: Mapped[str | None] = mapped_column(Text, nullable=True)


class VersionEvalRow(Base):
    """One evaluation score of a policy version (version 0: the starting model)."""

    __tablename__ = "version_evals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[int] = mapped_column(Integer, index=True)
    score: Mapped[float] = mapped_column(Float)
    items: Mapped[int | None] = mapped_column(Integer, nullable=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    adapter: Mapped[str | None] = mapped_column(String(64), nullable=True)  # NULL: the base


class PromotionRow(Base):
    """One change of the production deployment: a promotion or a rollback."""

    __tablename__ = "production_promotions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    action: Mapped[str] = mapped_column(String(16))
    version: Mapped[int] = mapped_column(Integer)
    canary_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    canary_fraction: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    adapter: Mapped[str | None] = mapped_column(String(64), nullable=True)  # NULL: the base


class FleetCounterRow(Base):
    """A count kept exact by database triggers, read in O(1) by every replica.

    ``admitted_train_sessions``: training sessions neither FAILED nor DROPPED
    (the ``N`` of the staleness rule) of the base model; ``admitted_train_sessions:<adapter>``:
    the same count for one adapter. Maintained by triggers on ``sessions`` (migrations 0005,
    0006).
    """

    __tablename__ = "fleet_counters"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)
