"""Indexes on ``sessions (created_at, id)`` and ``(reward, id)``: the inspector's session list.

The trajectory inspector (``/ui/sessions``, ``proxy/inspector/``) lists sessions
newest first, a page at a time, by keyset: ``WHERE (created_at, id) < (:t, :id)
ORDER BY created_at DESC, id DESC LIMIT n``. Without an index every page sorted the
whole table (100k sessions: a scan and a sort per page); with it a page reads ``n``
index entries. Filters by creation time and by policy version (a version is a range
of creation times: from its push to the next one) use the same range. Ordered by reward
(highest first), a page reads ``(reward, id)`` the same way.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 10:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_sessions_created_at_id", "sessions", ["created_at", "id"])
    op.create_index("ix_sessions_reward_id", "sessions", ["reward", "id"])


def downgrade() -> None:
    op.drop_index("ix_sessions_reward_id", table_name="sessions")
    op.drop_index("ix_sessions_created_at_id", table_name="sessions")
