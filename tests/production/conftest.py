"""Fixtures of the production-readiness tests (processes in ``procs.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg import postgres_cluster, select_postgres_items  # noqa: F401  (a fixture)
from tests.production.procs import BackendProcess


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    select_postgres_items(config, items)


@pytest.fixture
def fake_backend(tmp_path: Path) -> Iterator[BackendProcess]:
    """A fake SGLang backend decoding at 400 tokens/s per request."""
    backend = BackendProcess.fake(tokens_per_s=400, chunk_tokens=4, log_path=tmp_path / "fake.log")
    backend.start()
    yield backend
    backend.stop()
