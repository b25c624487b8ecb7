"""Version reconciliation: every backend routed to serves the pool's current weights.

A backend is routed to only while the weight version it reports (``/model_info``'s
``weight_version``, and the one on every generated chunk) is the pool's current version. A
backend that restarts comes back with the model it was started with (version 0); the health
checks see the difference, keep it out, and ``rejoin`` loads the current weights on it and
puts it back only once it reports them.

Weight updates (``update_weights``): close the gate so no new generation starts, pause every
backend in abort mode (in-flight requests return ``finish_reason: abort`` with their partial
tokens), load the new weights on each, resume, set the current version and open the gate.
The generation loop resumes each interrupted completion from its partial tokens.

A fleet of replicas shares backends: the version they all serve is the store's (``follow``,
called by ``proxima.proxy.policies.fleet``); a replica that learns of a version another
replica pushed adopts what the backends report and loads only those that do not report it,
one replica at a time (``PoolState.fleet_lock``), so a push is loaded once, not once per
replica.
"""

from __future__ import annotations

import asyncio
import logging
import time

from proxima.proxy.backends.adapter_sync import AdapterSync
from proxima.proxy.backends.errors import (
    BackendConnectionError,
    BackendError,
    BackendUnavailable,
)
from proxima.proxy.backends.members import (
    Backend,
    PoolState,
    WeightUpdate,
    ask_version,
    reported_version,
)

logger = logging.getLogger(__name__)


class VersionReconciler:
    """Loads weights on the backends: pushes, the fleet's versions, and stale backends."""

    def __init__(self, state: PoolState, adapters: AdapterSync) -> None:
        self._state = state
        self._adapters = adapters

    async def rejoin(self, backend: Backend) -> None:
        """Put a backend back once it reports the current version, loading it if needed.

        Loading happens under ``fleet_lock``: of several replicas that find the
        same backend behind, the first loads it and the others find it current.
        A backend that reports a *newer* version than this replica knows was
        loaded by another replica: it is never taken back to an older one; it
        rejoins once this replica follows the store to that version. Nor is one
        loaded while the store says the pool serves another version than this
        replica's (``fleet_version``, read under the lock): another replica rolled
        production back, or changed its canary, and this one has not followed yet;
        loading its version would undo the change on the shared backend.
        """
        state = self._state
        if backend.healthy:
            return
        async with state.fleet_lock(), state.update_lock:
            if backend.healthy:
                return  # brought back meanwhile
            version = state.version
            if await self._store_moved(backend, version):
                return
            try:
                info = await backend.client.model_info()
                reported = reported_version(info.weight_version)
                # A backend a failed push may have left half updated reloads even at the
                # current version (version 0's weights are the ones it started with).
                path = state.weights_path or (info.model_path if backend.must_reload else None)
                if (reported < version or backend.must_reload) and path is not None:
                    await backend.client.update_weights_from_disk(
                        model_path=path, weight_version=str(version)
                    )
                    backend.must_reload = False
                    reported = reported_version((await backend.client.model_info()).weight_version)
            except BackendError as exc:
                logger.warning("backend %s could not load v%s: %s", backend.url, version, exc)
                return
            backend.version = reported
            if reported == version and not await self._adapters.load_missing(backend):
                return
            if reported != version:
                backend.last_error = f"reports version {reported}, current is {version}"
                logger.log(
                    logging.INFO if reported > version else logging.ERROR,
                    "backend %s reports version %s, not this replica's %s: kept out of the "
                    "pool (%s)",
                    backend.url,
                    reported,
                    version,
                    "until this replica follows the store"
                    if reported > version
                    else "no weights of that version are known to load on it",
                )
                return
            backend.healthy = True
            logger.info("backend %s is back in the pool at version %s", backend.url, version)

    async def _store_moved(self, backend: Backend, version: int) -> bool:
        """Whether the store says the pool serves another version than ``version`` now; the
        backend then waits for this replica to follow the store (the follower's next round)."""
        read = self._state.fleet_version
        if read is None:
            return False
        try:
            stored = await read()
        except Exception as exc:
            # The store is down: the replica's own version, as before replicas shared one;
            # serving again outweighs a rollback that this replica may not have followed.
            logger.warning(
                "backend %s: the fleet's version cannot be read (%s); loading this replica's v%s",
                backend.url,
                exc,
                version,
            )
            return False
        if stored is None or stored == version:
            return False
        backend.last_error = f"the store serves version {stored}, this replica {version}"
        logger.info(
            "backend %s not loaded with v%s: the store says version %s; it rejoins once this "
            "replica follows the store",
            backend.url,
            version,
            stored,
        )
        return True

    async def follow(self, version: int, path: str | None) -> bool:
        """Serve ``version`` (at ``path``), which another replica published to the store.

        The backends are shared: those that report ``version`` already are
        adopted as they are; the others are taken out and brought to it (loaded
        under ``fleet_lock``, so once in the fleet), as after a restart. Returns
        whether this pool's version changed.
        """
        state = self._state
        async with state.update_lock:
            if version == state.version and path == state.weights_path:
                return False
            changed = version != state.version
            state.version = version
            if path is not None:
                state.weights_path = path
        if changed:
            logger.info("following the fleet to version %s", version)
        # ``/model_info`` only: SGLang's ``/health`` generates a token and answers at a
        # one-second poll, too slow for a fleet that follows a push within a second.
        reported = await asyncio.gather(*(ask_version(b) for b in state.backends))
        behind = []
        for backend, seen in zip(state.backends, reported, strict=True):
            if seen is None:
                if backend.healthy:
                    state.mark_failed(backend, BackendError("health check failed", url=backend.url))
                continue
            backend.version = seen
            if seen != version:
                if backend.healthy:
                    backend.healthy = False
                    backend.last_error = f"reports version {seen}, current is {version}"
                behind.append(backend)
            elif not backend.healthy:
                behind.append(backend)  # down or stale before, current now: back in
        await asyncio.gather(*(self.rejoin(b) for b in behind))
        return changed

    async def _paused(self, targets: list[Backend]) -> list[Backend]:
        """Pause ``targets`` in abort mode; those paused. One that cannot be reached (it died
        since its last check) is taken out, not counted against the push's path; with none
        paused, ``BackendUnavailable`` (a 503: the push may be sent again)."""
        results = await asyncio.gather(
            *(b.client.pause_generation(mode="abort") for b in targets), return_exceptions=True
        )
        paused = [b for b, r in zip(targets, results, strict=True) if r is None]
        for backend, result in zip(targets, results, strict=True):
            if isinstance(result, BackendConnectionError):
                self._state.mark_failed(backend, result)
        refused = [
            r for r in results if r is not None and not isinstance(r, BackendConnectionError)
        ]
        if refused or not paused:
            await asyncio.gather(
                *(b.client.continue_generation() for b in paused), return_exceptions=True
            )
            if refused:
                raise refused[0]
            raise BackendUnavailable("No healthy backend to load weights into.")
        return paused

    async def update_weights(self, *, version: int, path: str) -> WeightUpdate:
        """Interrupt generation everywhere, load ``path`` as ``version``, resume."""
        state = self._state
        async with state.update_lock:
            started = time.monotonic()
            state.updates_begun += 1
            state.ready.clear()
            try:
                targets = await self._paused(state.healthy_backends())
                try:
                    results = await asyncio.gather(
                        *(
                            b.client.update_weights_from_disk(
                                model_path=path, weight_version=str(version)
                            )
                            for b in targets
                        ),
                        return_exceptions=True,
                    )
                finally:
                    await asyncio.gather(
                        *(b.client.continue_generation() for b in targets), return_exceptions=True
                    )
                loaded = []
                for backend, result in zip(targets, results, strict=True):
                    if isinstance(result, BackendConnectionError):
                        state.mark_failed(backend, result)
                    elif isinstance(result, BaseException):
                        # It answered but refused (bad path, wrong shapes): it still serves
                        # the weights it has, which are no longer current once another
                        # backend loaded these. ``rejoin`` retries below if so.
                        logger.error("backend %s refused v%s: %s", backend.url, version, result)
                    else:
                        backend.version = version
                        loaded.append(backend.url)
                if not loaded:
                    first = next(r for r in results if isinstance(r, BaseException))
                    raise first
                state.version = version
                state.weights_path = path
                for backend in targets:
                    if backend.url not in loaded and backend.healthy:
                        state.mark_stale(backend, backend.version or 0)
            finally:
                state.ready.set()
            update = WeightUpdate(version, path, time.monotonic() - started, loaded)
            state.last_update = update
            logger.info(
                "weights v%s loaded on %d backend(s) in %.3fs", version, len(loaded), update.seconds
            )
            return update
