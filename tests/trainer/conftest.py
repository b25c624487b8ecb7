"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from megatron.core import parallel_state
from proxima.proxy.store import Store, ensure_schema
from proxima.proxy.testing.live import LiveProxy

from tests.pg import select_postgres_items


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """PostgreSQL-parametrized trainer tests (outages) are deselected without the server."""
    select_postgres_items(config, items)


@pytest.fixture(scope="module")
def megatron_process_group() -> Iterator[None]:
    """A module's in-process megatron backends share one gloo group (world size 1).

    The backends create it on first use; it is torn down when the module ends so
    that the next module (or a spawned multi-rank test) starts clean.
    """
    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    """A fresh SQLite store (``tmp_path/store.db``, schema applied) for one test."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    await ensure_schema(url)
    opened = await Store.open(url)
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture
def proxy(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LiveProxy]:
    """A live ``proxima serve`` (embedded engine, tiny model, SQLite store) for one test.

    Its trainer batch size is 2 (``--train-batch-size``), which ``proxima trainer`` runs
    against it adopt (``proxima.trainer.proxy_settings``); no staleness gate.
    """
    live = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        log_path=tmp_path / "serve.log",
        extra_args=["--train-batch-size", "2"],
    )
    live.start()
    yield live
    live.stop()
