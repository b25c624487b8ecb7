"""Deployments: eval scores of policy versions and the production promotion history.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 09:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "version_evals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("items", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_version_evals"),
    )
    op.create_index("ix_version_evals_version", "version_evals", ["version"])
    op.create_table(
        "production_promotions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("canary_version", sa.Integer(), nullable=True),
        sa.Column("canary_fraction", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_production_promotions"),
    )


def downgrade() -> None:
    op.drop_table("production_promotions")
    op.drop_index("ix_version_evals_version", table_name="version_evals")
    op.drop_table("version_evals")
