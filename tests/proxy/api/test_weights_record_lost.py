"""A weight push whose load landed but whose record in the store failed (the database went out
of reach in between: a 503) is recorded by its retry, not refused.

Before, the retry found the pool at the pushed version and answered 409; the trainer took
that for success (the proxy serves the version), and the store stayed a version behind what
the backends served: a trainer resumed after its last push refused to start (a checkpoint
ahead of the store). The route runs in-process on the real pool and a real store whose
first record fails as an outage does; the backend is the fake SGLang app.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxima.proxy.store import Store
from proxima.proxy.store.errors import StoreUnavailable
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app

from tests.proxy.api.admin_app import admin_app

BACKEND = "http://sglang"


class FirstRecordLost(Store):
    """A store whose first ``record_policy_version`` meets the database out of reach."""

    failed = False

    async def record_policy_version(self, **kw: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise StoreUnavailable()
        return await super().record_policy_version(**kw)


@pytest.fixture
async def setup(
    tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeBackend, Store]]:
    fake = FakeBackend()
    async with admin_app(
        tmp_path,
        tiny_model_dir,
        create_fake_app(fake),
        backend_url=BACKEND,
        store_type=FirstRecordLost,
    ) as (client, store):
        yield client, fake, store


async def test_the_retry_of_a_push_whose_record_was_lost_records_it(
    setup: tuple[httpx.AsyncClient, FakeBackend, Store],
) -> None:
    client, fake, store = setup
    push = {"version": 1, "path": "/w/one"}
    lost = await client.post("/admin/weights", json=push)
    assert lost.status_code == 503 and lost.headers["Retry-After"], lost.text
    assert fake.weight_version == "1"  # the load landed before the record failed
    assert await store.current_policy_version() == 0

    retried = await client.post("/admin/weights", json=push)
    assert retried.status_code == 200, retried.text
    assert retried.json()["version"] == 1 and retried.json()["path"] == "/w/one"
    assert [(v.version, v.path) for v in await store.list_policy_versions()] == [(1, "/w/one")]

    # Not a loophole: the same version from another path, or again, is still refused.
    other = await client.post("/admin/weights", json={"version": 1, "path": "/w/other"})
    again = await client.post("/admin/weights", json=push)
    assert (other.status_code, again.status_code) == (409, 409), (other.text, again.text)
