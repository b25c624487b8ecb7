"""Adapters: many policies behind one endpoint (one base model, named LoRA adapters).

A *policy* is the base model (``adapter`` NULL) or one named adapter. This
revision gives every policy what the base had alone:

- ``sessions.adapter``: the policy a session generates with (set at creation);
  ``completions.adapter``: the policy of each completion (its per-token
  versions are that policy's versions); ``api_keys.adapter``: the policy a
  production key serves.
- ``adapter_versions``: each adapter's own version sequence (from 1; version
  0 is the base weights with no adapter). The base's sequence stays in
  ``policy_versions``, unchanged.
- ``version_evals.adapter`` and ``production_promotions.adapter``: the eval
  gate and the production history per policy.
- Admission per policy: ``fleet_counters`` holds one admitted-session count
  per policy, ``admitted_train_sessions`` for the base (as in 0005) and
  ``admitted_train_sessions:<adapter>`` for an adapter, kept by the same kind
  of triggers (they now add to the row of the session's policy, created on
  its first session).

Rows that exist when this runs are all the base's: NULL everywhere, every
count unchanged. Downgrading forgets the adapters: their sessions count as
the base's again.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 01:30:00
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ADMITTED = "admitted_train_sessions"
_ADAPTER = sa.String(64)
_TABLES = ("sessions", "completions", "api_keys", "version_evals", "production_promotions")

# The counter row of a session's policy: the base's, or ``admitted_train_sessions:<adapter>``
# (``'x' || NULL`` is NULL on both databases, so COALESCE picks the base's name).
_COUNTS = "{r}.kind = 'train' AND {r}.status NOT IN ('failed', 'dropped')"
_NAME = "COALESCE('" + ADMITTED + ":' || {r}.adapter, '" + ADMITTED + "')"

_PG_FUNCTION = f"""
CREATE FUNCTION proxima_count_admitted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO fleet_counters (name, value)
        SELECT {_NAME.format(r="n")}, count(*) FROM new_rows AS n
        WHERE {_COUNTS.format(r="n")} GROUP BY 1
        ON CONFLICT (name) DO UPDATE SET value = fleet_counters.value + EXCLUDED.value;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO fleet_counters (name, value)
        SELECT {_NAME.format(r="o")}, -count(*) FROM old_rows AS o
        WHERE {_COUNTS.format(r="o")} GROUP BY 1
        ON CONFLICT (name) DO UPDATE SET value = fleet_counters.value + EXCLUDED.value;
    ELSE
        INSERT INTO fleet_counters (name, value)
        SELECT name, sum(delta) FROM (
            SELECT {_NAME.format(r="n")} AS name, 1 AS delta FROM new_rows AS n
            WHERE {_COUNTS.format(r="n")}
            UNION ALL
            SELECT {_NAME.format(r="o")}, -1 FROM old_rows AS o
            WHERE {_COUNTS.format(r="o")}
        ) AS changes GROUP BY name HAVING sum(delta) <> 0
        ON CONFLICT (name) DO UPDATE SET value = fleet_counters.value + EXCLUDED.value;
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
    def bump(row: str, delta: int) -> str:
        return (
            f"INSERT INTO fleet_counters (name, value) VALUES ({_NAME.format(r=row)}, {delta}) "
            f"ON CONFLICT (name) DO UPDATE SET value = value + {delta};"
        )

    counts_new, counts_old = _COUNTS.format(r="NEW"), _COUNTS.format(r="OLD")
    return [
        f"CREATE TRIGGER sessions_admitted_insert AFTER INSERT ON sessions "
        f"WHEN {counts_new} BEGIN {bump('NEW', 1)} END",
        f"CREATE TRIGGER sessions_admitted_delete AFTER DELETE ON sessions "
        f"WHEN {counts_old} BEGIN {bump('OLD', -1)} END",
        f"CREATE TRIGGER sessions_admitted_gain AFTER UPDATE OF kind, status ON sessions "
        f"WHEN ({counts_new}) AND NOT ({counts_old}) BEGIN {bump('NEW', 1)} END",
        f"CREATE TRIGGER sessions_admitted_loss AFTER UPDATE OF kind, status ON sessions "
        f"WHEN ({counts_old}) AND NOT ({counts_new}) BEGIN {bump('OLD', -1)} END",
    ]


def _drop_triggers() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for name in ("insert", "update", "delete"):
            op.execute(f"DROP TRIGGER sessions_admitted_{name} ON sessions")
        op.execute("DROP FUNCTION proxima_count_admitted()")
    else:
        for name in ("insert", "delete", "gain", "loss"):
            op.execute(f"DROP TRIGGER sessions_admitted_{name}")


def _revision_0005() -> ModuleType:
    """0005's module: its triggers are put back on downgrade (one text of them)."""
    path = Path(__file__).with_name("0005_fleet_counters.py")
    spec = importlib.util.spec_from_file_location("proxima_migration_0005", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    for table in _TABLES:
        op.add_column(table, sa.Column("adapter", _ADAPTER, nullable=True))
    op.create_index(op.f("ix_sessions_adapter_status"), "sessions", ["adapter", "status"])
    op.create_table(
        "adapter_versions",
        sa.Column("adapter", _ADAPTER, nullable=False),
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("adapter", "version", name=op.f("pk_adapter_versions")),
    )
    _drop_triggers()
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_FUNCTION)
        for statement in _PG_TRIGGERS:
            op.execute(statement)
    else:
        for statement in _sqlite_triggers():
            op.execute(statement)


def downgrade() -> None:
    _drop_triggers()
    old = _revision_0005()
    if op.get_bind().dialect.name == "postgresql":
        op.execute(old._PG_FUNCTION)
        for statement in old._PG_TRIGGERS:
            op.execute(statement)
    else:
        for statement in old._sqlite_triggers():
            op.execute(statement)
    # Without adapters every admitted training session is the base's again.
    op.execute(f"DELETE FROM fleet_counters WHERE name <> '{ADMITTED}'")
    op.execute(
        f"UPDATE fleet_counters SET value = (SELECT count(*) FROM sessions "
        f"WHERE kind = 'train' AND status NOT IN ('failed', 'dropped')) WHERE name = '{ADMITTED}'"
    )
    op.drop_table("adapter_versions")
    op.drop_index(op.f("ix_sessions_adapter_status"), table_name="sessions")
    for table in reversed(_TABLES):
        op.drop_column(table, "adapter")
