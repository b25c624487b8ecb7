"""The supervisor of a deployment's embedded engines: a dead engine is restarted and rejoins.

An SGLang backend that dies is somebody else's process: the health checks take it out and
bring it back once it answers again. An embedded engine is ``proxima serve``'s own child, and
nobody else would start it again, so :class:`EngineSupervisor` does, the way an SGLang
backend comes back:

1. every ``interval`` seconds it polls each engine's process; one that has exited is reaped
   (``EngineProcess.poll``: no zombie is left) and its backend is taken out of the pool at
   once (``mark_failed``) and marked ``restarting``: a request that finds no other healthy
   backend gets a 503 with ``Retry-After`` at once, not the pool's 30 s wait for a backend
   (the requests it was running fail over already: their stream broke);
2. the engine is started again on the same port (a start that fails is retried, waiting
   1, 2, 4... up to ``MAX_BACKOFF_S`` seconds between tries);
3. once it answers, it serves the model it was started with (version 0): the pool's health
   check hands it to ``rejoin`` (``proxima.proxy.backends.reconcile``), which loads the
   pool's current weights and every adapter's current version
   (``proxima.proxy.backends.adapter_sync``) and only then routes to it again.

``restarting`` is cleared when the engine is back in the pool, or when its rejoin has not
succeeded within ``rejoin_timeout_s`` (the periodic health checks keep trying then, and
requests wait for it as for any backend that is out).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from contextlib import suppress

from proxima.proxy.backends.errors import BackendConnectionError
from proxima.proxy.backends.pool import Backend, BackendPool
from proxima.proxy.embedded.launcher import EngineProcess

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
"""How often each engine's process is polled (a ``waitpid`` without waiting: cheap)."""
START_TIMEOUT_S = 180.0
"""How long a restarted engine has to answer its health check (it imports torch and loads
the model) before it is killed and started again."""
REJOIN_TIMEOUT_S = 120.0
"""How long the supervisor drives a restarted engine's rejoin before leaving it to the
periodic health checks."""
MAX_BACKOFF_S = 30.0


class EngineSupervisor:
    """Restarts the embedded engines of one pool when their processes die (module docstring)."""

    def __init__(
        self,
        pool: BackendPool,
        engines: Sequence[EngineProcess],
        *,
        interval: float = POLL_INTERVAL_S,
        start_timeout_s: float = START_TIMEOUT_S,
        rejoin_timeout_s: float = REJOIN_TIMEOUT_S,
    ) -> None:
        by_url = {backend.url: backend for backend in pool.backends}
        missing = [engine.url for engine in engines if engine.url not in by_url]
        if missing:
            raise ValueError(f"engines {missing} are not backends of the pool")
        self._pool = pool
        self._members = [(engine, by_url[engine.url]) for engine in engines]
        self._interval = interval
        self._start_timeout_s = start_timeout_s
        self._rejoin_timeout_s = rejoin_timeout_s
        self._watch: asyncio.Task[None] | None = None
        self._restarts: dict[EngineProcess, asyncio.Task[None]] = {}
        self.restarts = 0  # engines found dead and started again (counted at the start)

    def start(self) -> None:
        """Start watching (in a task of the running loop)."""
        self._watch = asyncio.create_task(self._watch_loop(), name="engine-supervisor")

    async def stop(self) -> None:
        """Stop watching and any restart under way (the engines themselves are stopped by
        their owner, ``Deployment.close``)."""
        tasks = [t for t in [self._watch, *self._restarts.values()] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task
        self._restarts.clear()

    async def _watch_loop(self) -> None:
        while True:
            for engine, backend in self._members:
                if engine in self._restarts:
                    continue
                status = engine.poll()
                if status is not None:
                    self._restarts[engine] = asyncio.create_task(
                        self._restart(engine, backend, status), name=f"restart {engine.url}"
                    )
            await asyncio.sleep(self._interval)

    async def _restart(self, engine: EngineProcess, backend: Backend, status: int) -> None:
        """Bring back the engine whose process exited with ``status``."""
        died = time.monotonic()
        backend.restarting = True
        self._pool.mark_failed(
            backend,
            BackendConnectionError(
                f"embedded engine (pid {engine.pid}) exited with status {status}", url=engine.url
            ),
        )
        logger.error(
            "embedded engine %s (pid %s) exited with status %s: restarting it",
            engine.url,
            engine.pid,
            status,
        )
        self.restarts += 1
        try:
            await self._start_until_up(engine, backend)
            await self._rejoin(backend)
            logger.info(
                "embedded engine %s (pid %s) is back%s after %.1fs",
                engine.url,
                engine.pid,
                f" at version {backend.version}" if backend.healthy else " (not yet in the pool)",
                time.monotonic() - died,
            )
        finally:
            backend.restarting = False
            self._restarts.pop(engine, None)

    async def _start_until_up(self, engine: EngineProcess, backend: Backend) -> None:
        """Start ``engine`` until one of its processes answers its health check."""
        backoff = 0.0
        while True:
            engine.start()
            if await self._answers(engine, backend):
                return
            status = engine.poll()
            engine.stop()
            backoff = min(MAX_BACKOFF_S, max(1.0, backoff * 2))
            logger.error(
                "restarted embedded engine %s %s; starting it again in %.0fs",
                engine.url,
                f"exited with status {status}"
                if status is not None
                else f"did not answer within {self._start_timeout_s:.0f}s",
                backoff,
            )
            await asyncio.sleep(backoff)

    async def _answers(self, engine: EngineProcess, backend: Backend) -> bool:
        """Whether the process just started answers ``/health`` before it exits or times out."""
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if engine.poll() is not None:
                return False
            if await backend.client.health():
                return True
            await asyncio.sleep(0.2)
        return False

    async def _rejoin(self, backend: Backend) -> None:
        """Have the health checks put ``backend`` back: ``rejoin`` loads the pool's current
        weights and adapters on it first (a check that overlaps a weight push counts for
        nothing, hence the loop)."""
        deadline = time.monotonic() + self._rejoin_timeout_s
        while not backend.healthy and time.monotonic() < deadline:
            await self._pool.check_health(fresh_s=5.0)  # spares healthy busy backends
            if not backend.healthy:
                await asyncio.sleep(0.2)
