"""The backend pool's members and the state the pool's parts share.

A ``Backend`` is one inference server as the pool sees it: whether it is routed to, the
requests it runs now, the weight version it last reported (never a guess). ``PoolState`` is
what every part of the pool (routing, health checks, version reconciliation, adapter sync)
reads and changes: the backends, the version and adapter versions served, the gate a weight
update closes, and the locks.

``PoolState``'s ``mark_*`` methods are the only ways a backend is taken out of the pool.
``mark_stale``, ``mark_must_reload`` and ``mark_missing_adapter`` also hand the backend to
``rejoin`` (the pool sets it to version reconciliation's), which loads what it lacks and puts
it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import httpx
from proxima.proxy.backends.errors import BackendError
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
    # A push failed part-way on it (it may hold half-updated weights while it reports the
    # current version): it is routed to again only after ``rejoin`` reloads the current weights.
    must_reload: bool = False
    # Its process died and is being started again (an embedded engine's supervisor sets it):
    # a request that finds no other backend healthy is answered 503 at once, not kept waiting.
    restarting: bool = False

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


async def ask_version(backend: Backend) -> int | None:
    """The version a backend reports (``/model_info``), or None when it does not answer."""
    try:
        return reported_version((await backend.client.model_info()).weight_version)
    except BackendError:
        return None


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


async def _no_rejoin(backend: Backend) -> None:
    raise RuntimeError("the pool has not set how a backend rejoins")


class PoolState:
    """The backends and what the pool serves, shared by the pool's parts."""

    def __init__(self, urls: list[str], *, http: httpx.AsyncClient, version: int) -> None:
        if not urls:
            raise ValueError("a backend pool needs at least one backend URL")
        self.backends = [Backend(SGLangClient(u, http=http), version=version) for u in urls]
        self.version = version
        self.weights_path: str | None = None
        # Set while no weight update runs: generation waits on it.
        self.ready = asyncio.Event()
        self.ready.set()
        self.update_lock = asyncio.Lock()
        # Held by whoever picks the next version (POST /admin/weights) across its
        # "newer than current" check, ``update_weights`` and recording the version,
        # so concurrent pushes cannot both pass the check.
        self.publish_lock = asyncio.Lock()
        # Held fleet-wide around loading weights on a backend (the store's publish lock on
        # PostgreSQL; nothing to share in one process). Taken before ``update_lock``.
        self.fleet_lock: Callable[[], AbstractAsyncContextManager[None]] = nullcontext
        # The version the fleet's store says this pool serves now (replicas; None: one
        # process, or no opinion). Read under ``fleet_lock`` before a stale backend is loaded:
        # a replica that has not yet followed a rollback must not load its old version back.
        self.fleet_version: Callable[[], Awaitable[int | None]] | None = None
        self.updates_begun = 0  # weight updates started; health probes that overlap one are void
        self.last_update: WeightUpdate | None = None
        # Every adapter's current version (absent: version 0, the base weights).
        self.adapters: dict[str, AdapterVersion] = {}
        # The adapter requests running now: adapter -> rid -> (backend, the lora name sent).
        self.adapter_requests: dict[str, dict[str, tuple[Backend, str | None]]] = {}
        # Brings a backend that was taken out back (version reconciliation's ``rejoin``).
        self.rejoin: Callable[[Backend], Coroutine[Any, Any, None]] = _no_rejoin
        self._rejoining: set[Backend] = set()  # stale backends being brought up to date

    @property
    def updating(self) -> bool:
        return not self.ready.is_set()

    def healthy_backends(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

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
        reports them (``rejoin``; the health checks retry if that fails).
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
        self.schedule_rejoin(backend)

    def mark_must_reload(self, backend: Backend, reason: str) -> None:
        """Take out a backend whose weights may be half updated (a broadcast push failed on
        it); ``rejoin`` reloads the current version before it is routed to again."""
        if backend.healthy:
            logger.warning("backend %s taken out until it reloads: %s", backend.url, reason)
        backend.healthy = False
        backend.must_reload = True
        backend.last_error = reason
        self.schedule_rejoin(backend)

    def mark_missing_adapter(self, backend: Backend, name: str) -> None:
        """Take out a backend that lacks the current adapter ``name`` (it restarted, or
        missed a push); ``rejoin`` loads every current adapter on it and puts it back."""
        if backend.healthy:
            logger.warning(
                "backend %s lacks adapter %s: taken out until it loads it", backend.url, name
            )
        backend.healthy = False
        backend.last_error = f"lacks adapter {name}"
        self.schedule_rejoin(backend)

    def schedule_rejoin(self, backend: Backend) -> None:
        """Bring ``backend`` back in a task (once at a time): ``rejoin`` loads what it lacks."""
        if backend not in self._rejoining:
            self._rejoining.add(backend)
            task = asyncio.get_running_loop().create_task(self.rejoin(backend))
            task.add_done_callback(lambda _: self._rejoining.discard(backend))
