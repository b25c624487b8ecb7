"""Backend pool: routing, session stickiness, health, and weight updates.

Routing: requests carrying a sticky key (the session) go to the healthy
backend that rendezvous hashing of the key over the healthy backends' URLs
picks, so its prefix cache is reused; every proxy replica computes the same
choice without asking anyone, so a conversation whose turns go through
different replicas stays on one backend. Others go to the least-loaded
healthy backend.

A fleet of replicas shares backends: the version they all serve is the
store's (``follow``, called by ``proxima.proxy.policies.fleet``); a replica that
learns of a version another replica pushed adopts what the backends report
and loads only those that do not report it, one replica at a time
(``fleet_lock``), so a push is loaded once, not once per replica.

Versions: a backend is routed to only while the weight version it reports
(``/model_info``'s ``weight_version``, and the one on every generated chunk)
is the pool's current version. A backend that restarts comes back with the
model it was started with (version 0); the health checks see the difference,
keep it out, load the current weights on it and put it back only once it
reports them. ``Backend.version`` is what the backend last reported, never a
guess.

Weight updates (``update_weights``): close the gate so no new
generation starts, pause every backend in abort mode (in-flight requests
return ``finish_reason: abort`` with their partial tokens), load the new
weights on each, resume, set the current version and open the gate. The
generation loop resumes each interrupted completion from its partial tokens.

Adapters (``update_adapter``): a policy other than the base is a LoRA adapter,
version ``v`` of adapter ``a`` loaded on every backend under
``lora_name(a, v)`` (``a@v3``). Nothing pauses: the new name is loaded beside
the old one, new requests of ``a`` are sent with it, the requests of ``a``
still running on the old name are aborted (and resumed on the new one by the
generation loop, which registers each adapter request here while it runs),
and once none is left the old name is unloaded. The base's and the other
adapters' requests never notice. An adapter's version 0 is the base weights
with no adapter (no ``lora_path``). A backend is routed to only while it has
every adapter's current version loaded: one that restarted (or missed a push)
is kept out until ``_rejoin`` has loaded them, as for the base weights.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import httpx
from proxima.proxy.backends.errors import (
    BackendConnectionError,
    BackendError,
    BackendUnavailable,
)
from proxima.proxy.backends.protocol import lora_name
from proxima.proxy.backends.sglang import SGLangClient

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Backend:
    client: SGLangClient
    healthy: bool = True
    in_flight: int = 0
    version: int | None = None  # the version it last reported (None: not known now)
    failures: int = 0
    last_error: str | None = None
    last_ok: float = 0.0  # monotonic time of its last answer to a generation

    @property
    def url(self) -> str:
        return self.client.base_url


def reported_version(raw: str | None) -> int:
    """The policy version a backend reports as its ``weight_version``.

    The proxy names versions with integers (``update_weights_from_disk(weight_version="N")``).
    Anything else (SGLang's ``"default"`` when started without ``--weight-version``, or no
    value at all) is the model the server was started with: version 0, the base model.
    """
    if raw is None:
        return 0
    try:
        return int(raw)
    except ValueError:
        return 0


async def _load_lora(backend: Backend, name: str, path: str) -> None:
    """Load ``name`` on ``backend`` unless it has it already (a restarted proxy, or another
    replica, put it there: SGLang refuses a name already loaded)."""
    if name in await backend.client.loaded_lora_adapters():
        return
    await backend.client.load_lora_adapter(name, path)


def rendezvous_score(key: str, url: str) -> int:
    """Highest-random-weight hashing: the backend with the top score serves ``key``.

    The same on every replica and across restarts (no per-process seed); when a
    backend leaves, only its keys move, spread over the others.
    """
    digest = hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(slots=True)
class WeightUpdate:
    version: int
    path: str
    seconds: float
    backends: list[str] = field(default_factory=list)
    adapter: str | None = None  # None: the base weights


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """The version of one adapter the pool serves, and where its files are."""

    adapter: str
    version: int
    path: str | None

    @property
    def lora(self) -> str | None:
        """The name requests carry as ``lora_path``; None at version 0 (the bare base)."""
        return None if self.version == 0 else lora_name(self.adapter, self.version)


# How long a push waits for the requests still running on an adapter's old version to end
# (they are aborted, and aborted again every ``_ABORT_AGAIN_S``) before it unloads it.
RETIRE_WAIT_S = 30.0
_ABORT_AGAIN_S = 0.5


class BackendPool:
    def __init__(self, urls: list[str], *, http: httpx.AsyncClient, version: int = 0):
        if not urls:
            raise ValueError("a backend pool needs at least one backend URL")
        self.backends = [Backend(SGLangClient(u, http=http), version=version) for u in urls]
        self.version = version
        self.weights_path: str | None = None
        self._ready = asyncio.Event()
        self._ready.set()
        self._update_lock = asyncio.Lock()
        # Held by whoever picks the next version (POST /admin/weights) across its
        # "newer than current" check, ``update_weights`` and recording the version,
        # so concurrent pushes cannot both pass the check.
        self.publish_lock = asyncio.Lock()
        # Held fleet-wide around loading weights on a backend (the store's publish lock on
        # PostgreSQL; nothing to share in one process). Taken before ``_update_lock``.
        self.fleet_lock: Callable[[], AbstractAsyncContextManager[None]] = nullcontext
        self._health_task: asyncio.Task[None] | None = None
        self._rejoining: set[Backend] = set()  # stale backends being brought up to date
        self._updates_begun = 0  # weight updates started; health probes that overlap one are void
        self.last_update: WeightUpdate | None = None
        # Every adapter's current version (absent: version 0, the base weights).
        self.adapters: dict[str, AdapterVersion] = {}
        # The adapter requests running now: adapter -> rid -> (backend, the lora name sent).
        self._adapter_requests: dict[str, dict[str, tuple[Backend, str | None]]] = {}

    # -- routing -------------------------------------------------------------
    @property
    def updating(self) -> bool:
        return not self._ready.is_set()

    async def wait_ready(self) -> None:
        """Block while a weight update is in progress."""
        await self._ready.wait()

    def healthy_backends(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def choose(self, sticky_key: str | None = None) -> Backend:
        healthy = self.healthy_backends()
        if not healthy:
            raise BackendUnavailable("No healthy inference backend is available; retry shortly.")
        if sticky_key is not None and len(healthy) > 1:
            return max(healthy, key=lambda b: rendezvous_score(sticky_key, b.url))
        if sticky_key is not None:
            return healthy[0]
        return min(healthy, key=lambda b: b.in_flight)

    @contextmanager
    def lease(self, backend: Backend) -> Iterator[Backend]:
        backend.in_flight += 1
        try:
            yield backend
        finally:
            backend.in_flight -= 1

    def mark_failed(self, backend: Backend, error: BaseException) -> None:
        if backend.healthy:
            logger.warning("backend %s taken out of the pool: %s", backend.url, error)
        backend.healthy = False
        backend.version = None  # whatever answers next may be a restarted server
        backend.failures += 1
        backend.last_error = repr(error)

    def mark_stale(self, backend: Backend, reported: int) -> None:
        """Take out a backend that reports another version than the pool's current one.

        A task loads the current weights on it at once and puts it back once it
        reports them (``_rejoin``; the health checks retry if that fails).
        """
        if backend.healthy:
            logger.warning(
                "backend %s reports version %s, not the current %s: taken out until it "
                "loads the current weights",
                backend.url,
                reported,
                self.version,
            )
        backend.healthy = False
        backend.version = reported
        backend.last_error = f"reports version {reported}, current is {self.version}"
        self._schedule_rejoin(backend)

    def mark_missing_adapter(self, backend: Backend, name: str) -> None:
        """Take out a backend that lacks the current adapter ``name`` (it restarted, or
        missed a push); ``_rejoin`` loads every current adapter on it and puts it back."""
        if backend.healthy:
            logger.warning(
                "backend %s lacks adapter %s: taken out until it loads it", backend.url, name
            )
        backend.healthy = False
        backend.last_error = f"lacks adapter {name}"
        self._schedule_rejoin(backend)

    def _schedule_rejoin(self, backend: Backend) -> None:
        if backend not in self._rejoining:
            self._rejoining.add(backend)
            task = asyncio.get_running_loop().create_task(self._rejoin(backend))
            task.add_done_callback(lambda _: self._rejoining.discard(backend))

    async def wait_for_healthy(self, timeout: float) -> None:
        """Wait until some backend is healthy (health checks put them back)."""
        deadline = time.monotonic() + timeout
        while not self.healthy_backends():
            if time.monotonic() >= deadline:
                raise BackendUnavailable(
                    "No healthy inference backend is available; retry shortly."
                )
            await self.check_health()
            if not self.healthy_backends():
                await asyncio.sleep(0.2)

    # -- health --------------------------------------------------------------
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

        Generation itself takes a backend out at once when its connection
        fails (``mark_failed``) or its tokens carry an older version than the
        pool's (``mark_stale``); probes find dead idle backends and bring
        recovered ones back.
        """
        if self.updating:
            return
        begun = self._updates_begun
        now = time.monotonic()
        probed = [
            b for b in self.backends if not (b.healthy and fresh_s and now - b.last_ok < fresh_s)
        ]
        results = await asyncio.gather(*(self._probe(b) for b in probed))
        if self.updating or self._updates_begun != begun:
            return  # the backends were paused meanwhile: the answers say nothing
        for backend, reported in zip(probed, results, strict=True):
            if reported is None:
                if backend.healthy:
                    error = BackendError("health check failed", url=backend.url)
                    self.mark_failed(backend, error)
                continue
            if backend.healthy and reported != self.version:
                self.mark_stale(backend, reported)
            if backend.healthy and self.adapters:
                missing = await self._missing_adapters(backend)
                if missing is None or missing:
                    self.mark_missing_adapter(backend, ", ".join(missing or ["(unknown)"]))
            if not backend.healthy:
                await self._rejoin(backend)

    @staticmethod
    async def _probe(backend: Backend) -> int | None:
        """The version a live backend reports, or None when it fails its health check."""
        if not await backend.client.health():
            return None
        try:
            return reported_version((await backend.client.model_info()).weight_version)
        except BackendError:
            return None

    @staticmethod
    async def _reported(backend: Backend) -> int | None:
        """The version a backend reports, or None when it does not answer."""
        try:
            return reported_version((await backend.client.model_info()).weight_version)
        except BackendError:
            return None

    async def _rejoin(self, backend: Backend) -> None:
        """Put a backend back once it reports the current version, loading it if needed.

        Loading happens under ``fleet_lock``: of several replicas that find the
        same backend behind, the first loads it and the others find it current.
        A backend that reports a *newer* version than this replica knows was
        loaded by another replica: it is never taken back to an older one; it
        rejoins once this replica follows the store to that version.
        """
        if backend.healthy:
            return
        async with self.fleet_lock(), self._update_lock:
            if backend.healthy:
                return  # brought back meanwhile
            version = self.version
            try:
                reported = reported_version((await backend.client.model_info()).weight_version)
                if reported < version and self.weights_path is not None:
                    await backend.client.update_weights_from_disk(
                        model_path=self.weights_path, weight_version=str(version)
                    )
                    reported = reported_version((await backend.client.model_info()).weight_version)
            except BackendError as exc:
                logger.warning("backend %s could not load v%s: %s", backend.url, version, exc)
                return
            backend.version = reported
            if reported == version and not await self._load_adapters(backend):
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

    async def follow(self, version: int, path: str | None) -> bool:
        """Serve ``version`` (at ``path``), which another replica published to the store.

        The backends are shared: those that report ``version`` already are
        adopted as they are; the others are taken out and brought to it (loaded
        under ``fleet_lock``, so once in the fleet), as after a restart. Returns
        whether this pool's version changed.
        """
        async with self._update_lock:
            if version == self.version and path == self.weights_path:
                return False
            changed = version != self.version
            self.version = version
            if path is not None:
                self.weights_path = path
        if changed:
            logger.info("following the fleet to version %s", version)
        # ``/model_info`` only: SGLang's ``/health`` generates a token and answers at a
        # one-second poll, too slow for a fleet that follows a push within a second.
        reported = await asyncio.gather(*(self._reported(b) for b in self.backends))
        behind = []
        for backend, seen in zip(self.backends, reported, strict=True):
            if seen is None:
                if backend.healthy:
                    self.mark_failed(backend, BackendError("health check failed", url=backend.url))
                continue
            backend.version = seen
            if seen != version:
                if backend.healthy:
                    backend.healthy = False
                    backend.last_error = f"reports version {seen}, current is {version}"
                behind.append(backend)
            elif not backend.healthy:
                behind.append(backend)  # down or stale before, current now: back in
        await asyncio.gather(*(self._rejoin(b) for b in behind))
        return changed

    def start_health_checks(self, interval: float) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.check_health(fresh_s=interval)
                except Exception:  # keep probing; a probe bug must not end health checks
                    logger.exception("health check round failed")

        self._health_task = asyncio.create_task(loop(), name="backend-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._health_task
        for backend in self.backends:
            backend.client.close()

    # -- adapters --------------------------------------------------------------
    def policy(self, adapter: str | None) -> tuple[int, str | None]:
        """``(version, lora name)`` a new request of ``adapter`` is served with now."""
        if adapter is None:
            return self.version, None
        current = self.adapters.get(adapter)
        return (0, None) if current is None else (current.version, current.lora)

    def adapter_version(self, adapter: str) -> int:
        """The adapter's current version (0: never pushed, the bare base)."""
        current = self.adapters.get(adapter)
        return 0 if current is None else current.version

    @contextmanager
    def adapter_request(
        self, adapter: str, backend: Backend, rid: str, lora: str | None
    ) -> Iterator[None]:
        """Register a running request of ``adapter`` (a push aborts it and waits for it)."""
        running = self._adapter_requests.setdefault(adapter, {})
        running[rid] = (backend, lora)
        try:
            yield
        finally:
            running.pop(rid, None)

    def _current_loras(self) -> dict[str, str]:
        """The lora name -> path of every adapter's current version (version 0 has none)."""
        return {
            a.lora: a.path
            for a in self.adapters.values()
            if a.lora is not None and a.path is not None
        }

    async def _missing_adapters(self, backend: Backend) -> list[str] | None:
        """The current adapter names ``backend`` has not loaded (None: it does not answer)."""
        wanted = self._current_loras()
        if not wanted:
            return []
        try:
            loaded = await backend.client.loaded_lora_adapters()
        except BackendError:
            return None
        return sorted(set(wanted) - loaded)

    async def _load_adapters(self, backend: Backend) -> bool:
        """Load every adapter's current version that ``backend`` lacks; whether it has all."""
        wanted = self._current_loras()
        missing = await self._missing_adapters(backend)
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

    def restore_adapters(self, versions: Mapping[str, tuple[int, str | None]]) -> None:
        """Serve these adapter versions (a proxy that starts: the store's newest); backends
        that lack them are loaded by the health checks before they serve."""
        for adapter, (version, path) in versions.items():
            self.adapters[adapter] = AdapterVersion(adapter, version, path)

    async def follow_adapter(self, adapter: str, version: int, path: str | None) -> bool:
        """Serve ``version`` of ``adapter``, which another replica pushed (or the store holds
        at start-up). The pushing replica loaded it on the shared backends; one that lacks
        it refuses the name and is taken out until ``_rejoin`` loads it. This replica's
        requests still on the old name are aborted and resume on the new; the old name is
        the pusher's to unload. Returns whether the version changed."""
        async with self._update_lock:
            old = self.adapters.get(adapter)
            if old is not None and old.version >= version:
                return False
            self.adapters[adapter] = AdapterVersion(adapter, version, path)
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
        async with self._update_lock:
            started = time.monotonic()
            targets = self.healthy_backends()
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
                    self.mark_failed(backend, result)
                elif isinstance(result, BaseException):
                    logger.error("backend %s refused %s: %s", backend.url, name, result)
                else:
                    loaded.append(backend)
            if not loaded:
                first = next(r for r in results if isinstance(r, BaseException))
                raise first
            old = self.adapters.get(adapter)
            self.adapters[adapter] = AdapterVersion(adapter, version, path)
            for backend in targets:
                if backend not in loaded and backend.healthy:
                    self.mark_missing_adapter(backend, name)
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
            running = self._adapter_requests.get(adapter, {})
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

    # -- weights ---------------------------------------------------------------
    async def update_weights(self, *, version: int, path: str) -> WeightUpdate:
        """Interrupt generation everywhere, load ``path`` as ``version``, resume."""
        async with self._update_lock:
            started = time.monotonic()
            self._updates_begun += 1
            self._ready.clear()
            try:
                targets = self.healthy_backends()
                if not targets:
                    raise BackendUnavailable("No healthy backend to load weights into.")
                await asyncio.gather(*(b.client.pause_generation(mode="abort") for b in targets))
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
                        self.mark_failed(backend, result)
                    elif isinstance(result, BaseException):
                        # It answered but refused (bad path, wrong shapes): it still serves
                        # the weights it has, which are no longer current once another
                        # backend loaded these. ``_rejoin`` retries below if so.
                        logger.error("backend %s refused v%s: %s", backend.url, version, result)
                    else:
                        backend.version = version
                        loaded.append(backend.url)
                if not loaded:
                    first = next(r for r in results if isinstance(r, BaseException))
                    raise first
                self.version = version
                self.weights_path = path
                for backend in targets:
                    if backend.url not in loaded and backend.healthy:
                        self.mark_stale(backend, backend.version or 0)
            finally:
                self._ready.set()
            update = WeightUpdate(version, path, time.monotonic() - started, loaded)
            self.last_update = update
            logger.info(
                "weights v%s loaded on %d backend(s) in %.3fs", version, len(loaded), update.seconds
            )
            return update
