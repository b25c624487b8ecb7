"""The grammar a completion was decoded under: ``completions.grammar``.

A completion decoded under a grammar (structured output, a forced tool call) has
behaviour logprobs of the masked, renormalised distribution. The trainer recomputes
them by replaying the grammar over the recorded tokens, so the grammar is stored
with the completion: a JSON object ``{"kind", "value", "rules"}`` (SGLang's grammar
parameter, its text, and whose masking rules applied). NULL for an unconstrained
completion, and for every row that exists when this runs (those stay context only,
as before). Downgrading forgets the grammars.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 14:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("completions", sa.Column("grammar", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("completions", "grammar")
