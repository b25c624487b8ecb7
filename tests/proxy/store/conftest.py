"""Store test fixtures: every test gets its own database, on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from proxima.proxy.store import Store, ensure_schema

from tests.pg import (  # noqa: F401  (postgres_cluster is a fixture)
    POSTGRES_PARAM,
    create_test_database,
    postgres_cluster,
    report_postgres_deselection,
    select_postgres_items,
)

BACKENDS = ["sqlite", POSTGRES_PARAM]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    select_postgres_items(config, items)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    report_postgres_deselection(terminalreporter)


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database owned by this test: a temp SQLite file or a fresh Postgres database."""
    if request.param == POSTGRES_PARAM:
        return create_test_database(request)
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    """A ``Store`` on a database migrated to head."""
    await ensure_schema(db_url)
    opened = await Store.open(db_url)
    try:
        yield opened
    finally:
        await opened.close()
