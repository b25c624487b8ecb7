"""Backend pool: routing, session stickiness, health, and weight updates, in one object.

``BackendPool`` is what the rest of the proxy holds; it composes the parts that do the work
and forwards to them:

- ``routing``: the healthy backend a request goes to (rendezvous hashing of the session
  for sticky requests, least-loaded for the others), and the count of requests each runs;
- ``probes``: the health checks that take dead or stale backends out and bring recovered ones back;
- ``reconcile``: version reconciliation: weight pushes (``update_weights``: close the gate,
  pause every backend in abort mode, load, resume), following the fleet's version
  (``follow``), and loading the current weights on a backend that is behind (``rejoin``);
- ``adapter_sync``: LoRA adapter pushes that pause nothing (``update_adapter``,
  ``follow_adapter``), the adapter requests running now, and loading the current adapters
  on a backend that lacks them;
- ``members``: each ``Backend``'s state and the ``PoolState`` the parts share, with the
  ``mark_*`` transitions that take a backend out;
- ``weight_group``: the trainer's weight-update group with the backends and the pushes by
  broadcast over it (``weight_groups``, used directly by the admin routes).

A backend is routed to only while it reports the pool's current weight version and has
every adapter's current version loaded; ``Backend.version`` is what the backend last
reported, never a guess. The methods here forward to those parts (see each for its contract);
every name other code imports from this module stays importable from here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager

import httpx
from proxima.proxy.backends.adapter_sync import RETIRE_WAIT_S, AdapterSync
from proxima.proxy.backends.members import (
    AdapterVersion,
    Backend,
    PoolState,
    WeightUpdate,
    reported_version,
)
from proxima.proxy.backends.probes import HealthChecker
from proxima.proxy.backends.reconcile import VersionReconciler
from proxima.proxy.backends.routing import Router, rendezvous_score
from proxima.proxy.backends.weight_group import WeightGroups

__all__ = [
    "RETIRE_WAIT_S",
    "AdapterVersion",
    "Backend",
    "BackendPool",
    "WeightUpdate",
    "rendezvous_score",
    "reported_version",
]


class BackendPool:
    """The proxy's inference backends: one object over routing, health, versions, adapters."""

    def __init__(self, urls: list[str], *, http: httpx.AsyncClient, version: int = 0):
        self._state = PoolState(urls, http=http, version=version)
        self._router = Router(self._state)
        self._adapters = AdapterSync(self._state)
        self._versions = VersionReconciler(self._state, self._adapters)
        self._health = HealthChecker(self._state, self._adapters)
        self._state.rejoin = self._versions.rejoin
        self.backends = self._state.backends
        self.adapters = self._state.adapters  # adapter -> its current version (absent: 0)
        self.publish_lock = self._state.publish_lock  # PoolState.publish_lock
        self.weight_groups = WeightGroups(self._state)  # broadcast pushes

    # -- the shared state ------------------------------------------------------
    @property
    def version(self) -> int:
        """The base weights' current version."""
        return self._state.version

    @property
    def weights_path(self) -> str | None:
        """Where the current version's weights are (None: the start-up model)."""
        return self._state.weights_path

    @property
    def last_update(self) -> WeightUpdate | None:
        return self._state.last_update

    @property
    def fleet_lock(self) -> Callable[[], AbstractAsyncContextManager[None]]:
        """Held fleet-wide around loading weights on a backend (``PoolState.fleet_lock``)."""
        return self._state.fleet_lock

    @fleet_lock.setter
    def fleet_lock(self, lock: Callable[[], AbstractAsyncContextManager[None]]) -> None:
        self._state.fleet_lock = lock

    @property
    def fleet_version(self) -> Callable[[], Awaitable[int | None]] | None:
        """The version the store says this pool serves (``PoolState.fleet_version``)."""
        return self._state.fleet_version

    @fleet_version.setter
    def fleet_version(self, read: Callable[[], Awaitable[int | None]] | None) -> None:
        self._state.fleet_version = read

    def healthy_backends(self) -> list[Backend]:
        return self._state.healthy_backends()

    def mark_failed(self, backend: Backend, error: BaseException) -> None:
        self._state.mark_failed(backend, error)

    def mark_stale(self, backend: Backend, reported: int) -> None:
        self._state.mark_stale(backend, reported)

    def mark_missing_adapter(self, backend: Backend, name: str) -> None:
        self._state.mark_missing_adapter(backend, name)

    # -- routing ---------------------------------------------------------------
    @property
    def updating(self) -> bool:
        return self._state.updating

    async def wait_ready(self) -> None:
        await self._router.wait_ready()

    def choose(self, sticky_key: str | None = None) -> Backend:
        return self._router.choose(sticky_key)

    def lease(self, backend: Backend) -> AbstractContextManager[Backend]:
        return self._router.lease(backend)

    # -- health ----------------------------------------------------------------
    async def wait_for_healthy(self, timeout: float) -> None:
        await self._health.wait_for_healthy(timeout)

    async def check_health(self, *, fresh_s: float = 0.0) -> None:
        await self._health.check_health(fresh_s=fresh_s)

    def start_health_checks(self, interval: float) -> None:
        self._health.start(interval)

    async def close(self) -> None:
        await self._health.stop()
        for backend in self.backends:
            backend.client.close()

    # -- versions --------------------------------------------------------------
    async def follow(self, version: int, path: str | None) -> bool:
        return await self._versions.follow(version, path)

    async def update_weights(self, *, version: int, path: str) -> WeightUpdate:
        return await self._versions.update_weights(version=version, path=path)

    # -- adapters --------------------------------------------------------------
    def policy(self, adapter: str | None) -> tuple[int, str | None]:
        return self._adapters.policy(adapter)

    def adapter_version(self, adapter: str) -> int:
        return self._adapters.adapter_version(adapter)

    def adapter_request(
        self, adapter: str, backend: Backend, rid: str, lora: str | None
    ) -> AbstractContextManager[None]:
        return self._adapters.adapter_request(adapter, backend, rid, lora)

    async def follow_adapter(self, adapter: str, version: int, path: str | None) -> bool:
        return await self._adapters.follow_adapter(adapter, version, path)

    async def update_adapter(self, *, adapter: str, version: int, path: str | None) -> WeightUpdate:
        return await self._adapters.update_adapter(adapter=adapter, version=version, path=path)
