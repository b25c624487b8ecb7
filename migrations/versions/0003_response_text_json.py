"""completions.response_text as JSON: model output containing NUL must be storable.

PostgreSQL text columns cannot hold U+0000, which a model can generate (a
byte-level tokenizer decodes token ``<0x00>`` to it). The text is now stored
as a JSON string, whose escape ``\\u0000`` keeps it losslessly on every
database (the store reads it back as the same ``str``). Existing rows are
converted in place: ``to_json`` on PostgreSQL, ``json_quote`` on SQLite.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 09:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("UPDATE completions SET response_text = json_quote(response_text)")
    with op.batch_alter_table("completions") as batch:
        batch.alter_column(
            "response_text",
            type_=sa.JSON(),
            existing_type=sa.Text(),
            existing_nullable=False,
            postgresql_using="to_json(response_text)",
        )


def downgrade() -> None:
    # A text column cannot hold NUL on PostgreSQL: it becomes U+FFFD there.
    with op.batch_alter_table("completions") as batch:
        batch.alter_column(
            "response_text",
            type_=sa.Text(),
            existing_type=sa.JSON(),
            existing_nullable=False,
            postgresql_using=("replace(response_text::text, '\\u0000', '\\ufffd')::json #>> '{}'"),
        )
    if op.get_bind().dialect.name == "sqlite":
        op.execute("UPDATE completions SET response_text = json_extract(response_text, '$')")
