"""Database URL normalization and SQLite connection settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from proxima.proxy.store.database import (
    SQLITE_BUSY_TIMEOUT_MS,
    create_engine,
    is_sqlite,
    normalize_db_url,
)
from sqlalchemy import text


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("sqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("sqlite:////abs/x.db", "sqlite+aiosqlite:////abs/x.db"),
        ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("x.db", "sqlite+aiosqlite:///x.db"),
        ("/tmp/run/x.db", "sqlite+aiosqlite:////tmp/run/x.db"),
        ("postgresql://u:p@h:5432/d", "postgresql+asyncpg://u:p@h:5432/d"),
        ("postgres://u@h/d", "postgresql+asyncpg://u@h/d"),
        ("postgresql+psycopg2://u@h/d", "postgresql+asyncpg://u@h/d"),
        ("postgresql+asyncpg://u@h/d", "postgresql+asyncpg://u@h/d"),
    ],
)
def test_normalize_db_url(given: str, expected: str) -> None:
    assert normalize_db_url(given) == expected


def test_normalize_rejects_empty() -> None:
    with pytest.raises(ValueError):
        normalize_db_url("  ")


def test_is_sqlite() -> None:
    assert is_sqlite("x.db")
    assert not is_sqlite("postgres://u@h/d")


async def test_sqlite_connections_use_wal_busy_timeout_and_foreign_keys(tmp_path: Path) -> None:
    engine = create_engine(tmp_path / "p.db")
    try:
        async with engine.connect() as conn:
            journal = (await conn.execute(text("PRAGMA journal_mode"))).scalar_one()
            busy = (await conn.execute(text("PRAGMA busy_timeout"))).scalar_one()
            foreign_keys = (await conn.execute(text("PRAGMA foreign_keys"))).scalar_one()
    finally:
        await engine.dispose()
    assert journal == "wal"
    assert busy == SQLITE_BUSY_TIMEOUT_MS
    assert foreign_keys == 1
