"""Initial schema: api_keys, sessions, completions, policy_versions.

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("key_hash", sa.String(128), nullable=False),
        sa.Column("record", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("api_key_hash", sa.String(128), nullable=True),
        sa.Column("group_id", sa.String(200), nullable=True),
        sa.Column("data_id", sa.String(200), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("claimed_by", sa.String(200), nullable=True),
        sa.Column("external_id", sa.String(200), nullable=True),
        sa.Column("api_key_id", sa.String(64), nullable=True),
        sa.Column("trained_version", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
        sa.ForeignKeyConstraint(
            ["api_key_id"], ["api_keys.id"], name="fk_sessions_api_key_id_api_keys"
        ),
        sa.UniqueConstraint("api_key_id", "external_id", name="uq_sessions_api_key_id_external_id"),
    )
    op.create_index("ix_sessions_api_key_hash", "sessions", ["api_key_hash"], unique=True)
    op.create_index("ix_sessions_status_finished_at", "sessions", ["status", "finished_at"])
    op.create_index("ix_sessions_kind_status", "sessions", ["kind", "status"])
    op.create_table(
        "completions",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("parent_id", sa.String(64), nullable=True),
        sa.Column("prompt_ids", sa.LargeBinary(), nullable=False),
        sa.Column("output_ids", sa.LargeBinary(), nullable=False),
        sa.Column("output_logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("output_versions", sa.LargeBinary(), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("request_messages", sa.JSON(), nullable=True),
        sa.Column("request_tools", sa.JSON(), nullable=True),
        sa.Column("response_message", sa.JSON(), nullable=True),
        sa.Column("response_text", sa.Text(), nullable=False),
        sa.Column("sampling", sa.JSON(), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("choice_index", sa.Integer(), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("time_to_first_token", sa.Float(), nullable=True),
        sa.Column("duration", sa.Float(), nullable=True),
        sa.Column("backend", sa.String(200), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_completions"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name="fk_completions_session_id_sessions",
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_completions_session_id", "completions", ["session_id"])
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("version", name="pk_policy_versions"),
    )


def downgrade() -> None:
    op.drop_table("policy_versions")
    op.drop_index("ix_completions_session_id", table_name="completions")
    op.drop_table("completions")
    op.drop_index("ix_sessions_kind_status", table_name="sessions")
    op.drop_index("ix_sessions_status_finished_at", table_name="sessions")
    op.drop_index("ix_sessions_api_key_hash", table_name="sessions")
    op.drop_table("sessions")
    op.drop_table("api_keys")
