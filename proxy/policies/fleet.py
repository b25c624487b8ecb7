"""Replicas that follow the store: one policy version and one production state for the fleet.

``proxima serve`` replicas on one PostgreSQL database share backends, and a
weight push or a promotion goes through one of them. The others learn of it
from the store, never from each other:

- a change is recorded with a ``pg_notify`` on ``FLEET_CHANNEL`` in the same
  transaction (``proxima.proxy.store.fleet``); each replica LISTENs on a
  connection of its own and reacts within milliseconds of the commit;
- every ``poll_s`` seconds (0.5 s) it also reads the state (two indexed
  reads), the floor when a notice is lost (a dropped listening connection is
  reopened on the next round).

Every adapter's newest version is followed too (``BackendPool.follow_adapter``):
a restarted proxy serves each adapter at the version the store holds.

Following a version (``BackendPool.follow``) asks each backend what it serves
and adopts it: the replica that pushed has loaded the shared backends already,
so nothing is loaded twice; a backend that missed the push is loaded by one
replica under the fleet-wide publish lock.

On SQLite the workers of ``proxima serve --workers N`` are replicas too
(``store.shared``): they poll, with no notices. A single process on SQLite has
nothing to follow: no follower runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.policies.production import ProductionController
from proxima.proxy.store.errors import StoreUnavailable
from proxima.proxy.store.fleet import FLEET_CHANNEL
from proxima.proxy.store.store import Store

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""Seconds between two reads of the shared state when no notice arrives."""


class FleetFollower:
    def __init__(
        self,
        *,
        store: Store,
        pool: BackendPool,
        production: ProductionController | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.store = store
        self.pool = pool
        self.production = production
        self.poll_s = poll_s
        self.promotion_id = 0
        self.follows = 0  # versions adopted from the store (diagnostics)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._listener: Any = None  # asyncpg connection LISTENing on FLEET_CHANNEL

    async def sync(self) -> None:
        """Serve what the store says now: the newest version, the newest production state."""
        state = await self.store.fleet_state()
        if state.version > self.pool.version and await self.pool.follow(state.version, state.path):
            self.follows += 1
        for adapter, head in (await self.store.adapter_heads()).items():
            if head.version > self.pool.adapter_version(adapter) and await self.pool.follow_adapter(
                adapter, head.version, head.path
            ):
                self.follows += 1
        if self.production is not None and state.promotion_id != self.promotion_id:
            await self.production.follow()
            self.promotion_id = state.promotion_id

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet-follower")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._close_listener()

    async def _run(self) -> None:
        while True:
            if self.store.postgres and (self._listener is None or self._listener.is_closed()):
                await self._listen()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()
            try:
                await self.sync()
            except StoreUnavailable:  # logged by the store; the next round retries
                pass
            except Exception:  # a backend is down: the next round retries
                logger.exception("following the fleet's state failed")

    async def _listen(self) -> None:
        import asyncpg

        await self._close_listener()
        url = self.store.engine.url.set(drivername="postgresql")
        try:
            conn = await asyncpg.connect(url.render_as_string(hide_password=False), timeout=5)
            await conn.add_listener(FLEET_CHANNEL, self._notified)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            logger.warning("cannot LISTEN for fleet changes (polling meanwhile): %s", exc)
            return
        self._listener = conn

    def _notified(self, *_: Any) -> None:
        self._wake.set()

    async def _close_listener(self) -> None:
        conn, self._listener = self._listener, None
        if conn is not None and not conn.is_closed():
            with contextlib.suppress(Exception):
                await conn.close(timeout=5)
