"""Adapter sync: every backend serves every adapter's current version, pushes pause nothing.

A policy other than the base is a LoRA adapter, version ``v`` of adapter ``a`` loaded on
every backend under ``lora_name(a, v)`` (``a@v3``). A push (``update_adapter``) loads the new
name beside the old one, sends new requests of ``a`` with it, aborts the requests of ``a``
still running on the old name (the generation loop resumes them on the new one; it registers
each adapter request here while it runs, ``adapter_request``), and once none is left unloads
the old name. The base's and the other adapters' requests never notice. An adapter's
version 0 is the base weights with no adapter (no ``lora_path``).

A backend is routed to only while it has every adapter's current version loaded: one that
restarted (or missed a push) is taken out (``PoolState.mark_missing_adapter``) until
``load_missing`` has loaded them (version reconciliation's ``rejoin`` calls it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from proxima.proxy.backends.errors import (
    BackendConnectionError,
    BackendError,
    BackendUnavailable,
)
from proxima.proxy.backends.members import AdapterVersion, Backend, PoolState, WeightUpdate
from proxima.proxy.backends.protocol import lora_name

logger = logging.getLogger(__name__)

# How long a push waits for the requests still running on an adapter's old version to end
# (they are aborted, and aborted again every ``_ABORT_AGAIN_S``) before it unloads it.
RETIRE_WAIT_S = 30.0
_ABORT_AGAIN_S = 0.5


async def _load_lora(backend: Backend, name: str, path: str) -> None:
    """Load ``name`` on ``backend`` unless it has it already (a restarted proxy, or another
    replica, put it there: SGLang refuses a name already loaded)."""
    if name in await backend.client.loaded_lora_adapters():
        return
    await backend.client.load_lora_adapter(name, path)


class AdapterSync:
    """The adapter versions the pool serves, their pushes, and loading them on backends."""

    def __init__(self, state: PoolState) -> None:
        self._state = state

    def policy(self, adapter: str | None) -> tuple[int, str | None]:
        """``(version, lora name)`` a new request of ``adapter`` is served with now."""
        if adapter is None:
            return self._state.version, None
        current = self._state.adapters.get(adapter)
        return (0, None) if current is None else (current.version, current.lora)

    def adapter_version(self, adapter: str) -> int:
        """The adapter's current version (0: never pushed, the bare base)."""
        current = self._state.adapters.get(adapter)
        return 0 if current is None else current.version

    @contextmanager
    def adapter_request(
        self, adapter: str, backend: Backend, rid: str, lora: str | None
    ) -> Iterator[None]:
        """Register a running request of ``adapter`` (a push aborts it and waits for it)."""
        running = self._state.adapter_requests.setdefault(adapter, {})
        running[rid] = (backend, lora)
        try:
            yield
        finally:
            running.pop(rid, None)

    def _current_loras(self) -> dict[str, str]:
        """The lora name -> path of every adapter's current version (version 0 has none)."""
        return {
            a.lora: a.path
            for a in self._state.adapters.values()
            if a.lora is not None and a.path is not None
        }

    async def missing(self, backend: Backend) -> list[str] | None:
        """The current adapter names ``backend`` has not loaded (None: it does not answer)."""
        wanted = self._current_loras()
        if not wanted:
            return []
        try:
            loaded = await backend.client.loaded_lora_adapters()
        except BackendError:
            return None
        return sorted(set(wanted) - loaded)

    async def load_missing(self, backend: Backend) -> bool:
        """Load every adapter's current version that ``backend`` lacks; whether it has all."""
        wanted = self._current_loras()
        missing = await self.missing(backend)
        if missing is None:
            return False
        for name in missing:
            try:
                await backend.client.load_lora_adapter(name, wanted[name])
            except BackendError as exc:
                backend.last_error = f"could not load adapter {name}: {exc}"
                logger.warning("backend %s could not load adapter %s: %s", backend.url, name, exc)
                return False
        if missing:
            logger.info("backend %s loaded adapters %s", backend.url, ", ".join(missing))
        return True

    async def follow_adapter(self, adapter: str, version: int, path: str | None) -> bool:
        """Serve ``version`` of ``adapter``, which another replica pushed (or the store holds
        at start-up). The pushing replica loaded it on the shared backends; one that lacks
        it refuses the name and is taken out until ``rejoin`` loads it. This replica's
        requests still on the old name are aborted and resume on the new; the old name is
        the pusher's to unload. Returns whether the version changed."""
        async with self._state.update_lock:
            old = self._state.adapters.get(adapter)
            if old is not None and old.version >= version:
                return False
            self._state.adapters[adapter] = AdapterVersion(adapter, version, path)
        logger.info("following the fleet to adapter %s v%s", adapter, version)
        await self._retire(adapter, None if old is None else old.lora, [])
        return True

    async def update_adapter(self, *, adapter: str, version: int, path: str | None) -> WeightUpdate:
        """Serve ``path`` as ``version`` of ``adapter``; nothing else pauses (module docstring).

        Loads the new name on every healthy backend, switches new requests of
        ``adapter`` to it, aborts the requests still running on the old one (the
        generation loop resumes them on the new), and unloads the old name once
        they are gone. A backend that refuses is taken out until it loads it.
        Version 0 is the bare base (nothing to load: production going back to it).
        """
        name = lora_name(adapter, version)
        async with self._state.update_lock:
            started = time.monotonic()
            targets = self._state.healthy_backends()
            if not targets:
                raise BackendUnavailable("No healthy backend to load the adapter into.")
            if version == 0 or path is None:
                if version != 0:
                    raise ValueError(f"adapter {adapter} v{version} needs a path")
                results: list[Any] = [None] * len(targets)
            else:
                results = await asyncio.gather(
                    *(_load_lora(b, name, path) for b in targets), return_exceptions=True
                )
            loaded = []
            for backend, result in zip(targets, results, strict=True):
                if isinstance(result, BackendConnectionError):
                    self._state.mark_failed(backend, result)
                elif isinstance(result, BaseException):
                    logger.error("backend %s refused %s: %s", backend.url, name, result)
                else:
                    loaded.append(backend)
            if not loaded:
                first = next(r for r in results if isinstance(r, BaseException))
                raise first
            old = self._state.adapters.get(adapter)
            self._state.adapters[adapter] = AdapterVersion(adapter, version, path)
            for backend in targets:
                if backend not in loaded and backend.healthy:
                    self._state.mark_missing_adapter(backend, name)
        await self._retire(adapter, None if old is None else old.lora, loaded)
        update = WeightUpdate(
            version,
            path or "",
            time.monotonic() - started,
            [b.url for b in loaded],
            adapter=adapter,
        )
        logger.info(
            "adapter %s v%s loaded on %d backend(s) in %.3fs",
            adapter,
            version,
            len(loaded),
            update.seconds,
        )
        return update

    async def _retire(self, adapter: str, old: str | None, backends: list[Backend]) -> None:
        """Abort the requests of ``adapter`` still on its old name ``old`` (None: the bare
        base), wait until they have left, then unload ``old`` from ``backends``.

        No new request takes ``old`` (the switch came first), so the set only
        shrinks. An abort can reach a backend before the request it names; such a
        request is aborted again after ``_ABORT_AGAIN_S``. A name is unloaded only
        once no request of this pool uses it: SGLang loads an unloaded name again
        when a request names it.
        """
        deadline = time.monotonic() + RETIRE_WAIT_S
        while True:
            running = self._state.adapter_requests.get(adapter, {})
            stale = [(b, rid) for rid, (b, lora) in running.items() if lora == old]
            if not stale:
                break
            if time.monotonic() >= deadline:
                logger.error(
                    "%d request(s) of adapter %s still run on %s after %.0fs",
                    len(stale),
                    adapter,
                    old or "the base",
                    RETIRE_WAIT_S,
                )
                break
            await asyncio.gather(
                *(b.client.abort_request(rid=rid) for b, rid in stale), return_exceptions=True
            )
            again = time.monotonic() + _ABORT_AGAIN_S
            while time.monotonic() < again and any(rid in running for _, rid in stale):
                await asyncio.sleep(0.01)
        if old is None:
            return
        results = await asyncio.gather(
            *(b.client.unload_lora_adapter(old) for b in backends), return_exceptions=True
        )
        for backend, result in zip(backends, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("backend %s could not unload %s: %s", backend.url, old, result)
