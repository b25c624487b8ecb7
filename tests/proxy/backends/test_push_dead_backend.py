"""A weight push that finds a backend dead (it died since its last check) loads the others and
takes the dead one out; with none alive it is ``BackendUnavailable`` (a 503 the trainer sends
again), never the path's fault.

Before, the pause that starts a push raised the dead backend's connection error, which the
admin route answered 400 "Loading weights from <path> failed": ``proxima trainer`` took it
for a bad path and exited (an engine killed just before a push ended the run).
"""

from __future__ import annotations

import httpx
import pytest
from proxima.proxy.backends.errors import BackendUnavailable
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.serving import ThreadedServer, free_port
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app


async def test_a_push_loads_the_live_backends_and_takes_a_dead_one_out() -> None:
    fake = FakeBackend()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the process died
    with ThreadedServer(create_fake_app(fake)) as live:
        async with httpx.AsyncClient() as http:
            pool = BackendPool([live.url, dead], http=http)
            update = await pool.update_weights(version=1, path="/weights/v1")
            assert update.backends == [live.url] and pool.version == 1
            assert fake.weight_version == "1"
            alive, gone = pool.backends
            assert alive.healthy and not gone.healthy and "ConnectError" in (gone.last_error or "")
            assert not pool.updating  # the gate is open again


async def test_a_push_with_every_backend_dead_is_unavailable_and_changes_nothing() -> None:
    async with httpx.AsyncClient() as http:
        pool = BackendPool([f"http://127.0.0.1:{free_port()}"], http=http)
        with pytest.raises(BackendUnavailable):
            await pool.update_weights(version=1, path="/weights/v1")
        assert pool.version == 0 and not pool.backends[0].healthy and not pool.updating
