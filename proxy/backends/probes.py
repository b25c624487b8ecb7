"""Health probes: take dead and stale backends out of the pool, bring recovered ones back.

Generation itself takes a backend out at once when its connection fails (``mark_failed``)
or its tokens carry an older version than the pool's (``mark_stale``); the probes here find
dead idle backends, backends that restarted between two probes (they answer but serve their
start-up model) or lack an adapter, and hand every backend that is out to ``rejoin``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress

from proxima.proxy.backends.adapter_sync import AdapterSync
from proxima.proxy.backends.errors import BackendError, BackendUnavailable
from proxima.proxy.backends.members import Backend, PoolState, ask_version

logger = logging.getLogger(__name__)

RESTART_RETRY_AFTER_S = 2.0
"""The ``Retry-After`` of a request that found every backend restarting."""


class HealthChecker:
    """Probes the pool's backends, on demand and every ``interval`` seconds once started."""

    def __init__(self, state: PoolState, adapters: AdapterSync) -> None:
        self._state = state
        self._adapters = adapters
        self._task: asyncio.Task[None] | None = None

    async def wait_for_healthy(self, timeout: float) -> None:
        """Wait until some backend is healthy (health checks put them back); at once
        ``BackendUnavailable`` (with a ``Retry-After``) when every backend is ``restarting``:
        an engine takes seconds to start, and a caller retries better than it waits."""
        deadline = time.monotonic() + timeout
        while not self._state.healthy_backends():
            if all(b.restarting for b in self._state.backends):
                raise BackendUnavailable(
                    "Every inference backend is restarting; retry shortly.",
                    retry_after=RESTART_RETRY_AFTER_S,
                )
            if time.monotonic() >= deadline:
                raise BackendUnavailable(
                    "No healthy inference backend is available; retry shortly."
                )
            await self.check_health()
            if not self._state.healthy_backends():
                await asyncio.sleep(0.2)

    async def check_health(self, *, fresh_s: float = 0.0) -> None:
        """Probe the backends; one that comes back loads the current weights first.

        SGLang's ``/health`` generates one token: it blocks while generation is
        paused and answers 503 by itself after 20 s, so the probe waits longer
        than that (SGLang's verdict decides, not our timer) and:

        - no backend is probed, nor judged, while a weight update runs (every
          backend is paused on purpose); a probe that overlapped an update
          counts for nothing;
        - a healthy backend that answered a generation in the last ``fresh_s``
          seconds is not probed: it is busy and alive, and a probe would only
          add load.

        A backend that answers is asked the version it serves (``/model_info``):
        one that restarted between two probes answers the health check but serves
        its start-up model, and is taken out (``mark_stale``) and brought to the
        current version like one that was down.
        """
        state = self._state
        if state.updating:
            return
        begun = state.updates_begun
        now = time.monotonic()
        probed = [
            b for b in state.backends if not (b.healthy and fresh_s and now - b.last_ok < fresh_s)
        ]
        results = await asyncio.gather(*(self._probe(b) for b in probed))
        if state.updating or state.updates_begun != begun:
            return  # the backends were paused meanwhile: the answers say nothing
        for backend, reported in zip(probed, results, strict=True):
            if reported is None:
                if backend.healthy:
                    error = BackendError("health check failed", url=backend.url)
                    state.mark_failed(backend, error)
                continue
            if backend.healthy and reported != state.version:
                state.mark_stale(backend, reported)
            if backend.healthy and state.adapters:
                missing = await self._adapters.missing(backend)
                if missing is None or missing:
                    state.mark_missing_adapter(backend, ", ".join(missing or ["(unknown)"]))
            if not backend.healthy:
                await state.rejoin(backend)

    @staticmethod
    async def _probe(backend: Backend) -> int | None:
        """The version a live backend reports, or None when it fails its health check."""
        if not await backend.client.health():
            return None
        return await ask_version(backend)

    def start(self, interval: float) -> None:
        """Probe every ``interval`` seconds, sparing backends that answered meanwhile."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.check_health(fresh_s=interval)
                except Exception:  # keep probing; a probe bug must not end health checks
                    logger.exception("health check round failed")

        self._task = asyncio.create_task(loop(), name="backend-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
