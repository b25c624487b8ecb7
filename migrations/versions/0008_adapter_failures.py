"""Failed adapter versions: ``adapter_versions.failed_at`` and ``failure``.

An adapter version that, once served, yields non-finite logprobs is marked
failed (``Store.fail_adapter_version``) and the adapter falls back to its last
good version: ``failed_at`` is when, ``failure`` the backend's error. A failed
version keeps its number (a later push must be newer still) but is never an
adapter's head again. Rows that exist when this runs are all good (NULL).
Downgrading forgets the failures: a failed version becomes a head again.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 11:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "adapter_versions", sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("adapter_versions", sa.Column("failure", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("adapter_versions", "failure")
    op.drop_column("adapter_versions", "failed_at")
