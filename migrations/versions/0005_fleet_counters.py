"""Admission in constant time for a fleet of proxies: a counter row kept by the database.

The staleness rule counts the training sessions admitted so far (every train
session that is not FAILED or DROPPED). Counting them was a scan of every
session ever created; now one row of ``fleet_counters`` holds the count, kept
exact by a trigger on ``sessions`` (insert, status or kind change, delete) in
the same transaction as the change, whichever process makes it. Admission
reads that row and the open sessions (through ``ix_sessions_kind_status``),
under one lock shared by every replica (see ``proxy/store/fleet.py``).

``ix_sessions_group_id``: whether a group already has an admitted session is
asked on every grouped create; it was a scan too.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 22:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ADMITTED = "admitted_train_sessions"
# A session counts as admitted: a training session not FAILED and not DROPPED.
_COUNTS_NEW = "NEW.kind = 'train' AND NEW.status NOT IN ('failed', 'dropped')"
_COUNTS_OLD = "OLD.kind = 'train' AND OLD.status NOT IN ('failed', 'dropped')"

# PostgreSQL: statement-level triggers with transition tables, so a statement that
# changes many sessions (a bulk claim, a bulk load) updates the counter row once, not once
# per session (each update leaves a dead version of that one row behind until vacuum).
_PG_FUNCTION = f"""
CREATE FUNCTION proxima_count_admitted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE delta bigint := 0;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        SELECT delta - count(*) INTO delta FROM old_rows AS o
        WHERE o.kind = 'train' AND o.status NOT IN ('failed', 'dropped');
    END IF;
    IF TG_OP <> 'DELETE' THEN
        SELECT delta + count(*) INTO delta FROM new_rows AS n
        WHERE n.kind = 'train' AND n.status NOT IN ('failed', 'dropped');
    END IF;
    IF delta <> 0 THEN
        UPDATE fleet_counters SET value = value + delta WHERE name = '{ADMITTED}';
    END IF;
    RETURN NULL;
END $$
"""
_PG_TRIGGERS = [
    "CREATE TRIGGER sessions_admitted_insert AFTER INSERT ON sessions "
    "REFERENCING NEW TABLE AS new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION proxima_count_admitted()",
    "CREATE TRIGGER sessions_admitted_update AFTER UPDATE ON sessions "
    "REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION proxima_count_admitted()",
    "CREATE TRIGGER sessions_admitted_delete AFTER DELETE ON sessions "
    "REFERENCING OLD TABLE AS old_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION proxima_count_admitted()",
]


def _sqlite_triggers() -> list[str]:
    add = f"UPDATE fleet_counters SET value = value + 1 WHERE name = '{ADMITTED}';"
    sub = f"UPDATE fleet_counters SET value = value - 1 WHERE name = '{ADMITTED}';"
    return [
        f"CREATE TRIGGER sessions_admitted_insert AFTER INSERT ON sessions "
        f"WHEN {_COUNTS_NEW} BEGIN {add} END",
        f"CREATE TRIGGER sessions_admitted_delete AFTER DELETE ON sessions "
        f"WHEN {_COUNTS_OLD} BEGIN {sub} END",
        f"CREATE TRIGGER sessions_admitted_gain AFTER UPDATE OF kind, status ON sessions "
        f"WHEN ({_COUNTS_NEW}) AND NOT ({_COUNTS_OLD}) BEGIN {add} END",
        f"CREATE TRIGGER sessions_admitted_loss AFTER UPDATE OF kind, status ON sessions "
        f"WHEN ({_COUNTS_OLD}) AND NOT ({_COUNTS_NEW}) BEGIN {sub} END",
    ]


def upgrade() -> None:
    op.create_table(
        "fleet_counters",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_fleet_counters")),
    )
    op.execute(
        f"INSERT INTO fleet_counters (name, value) SELECT '{ADMITTED}', count(*) FROM sessions "
        "WHERE kind = 'train' AND status NOT IN ('failed', 'dropped')"
    )
    op.create_index(op.f("ix_sessions_group_id"), "sessions", ["group_id"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_FUNCTION)
        for statement in _PG_TRIGGERS:
            op.execute(statement)
    else:
        for statement in _sqlite_triggers():
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for name in ("insert", "update", "delete"):
            op.execute(f"DROP TRIGGER sessions_admitted_{name} ON sessions")
        op.execute("DROP FUNCTION proxima_count_admitted()")
    else:
        for name in ("insert", "delete", "gain", "loss"):
            op.execute(f"DROP TRIGGER sessions_admitted_{name}")
    op.drop_index(op.f("ix_sessions_group_id"), table_name="sessions")
    op.drop_table("fleet_counters")
