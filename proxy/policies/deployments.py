"""Deployments: which backend pool serves a request (docs/design.md, "Deployments").

One endpoint, up to three deployments, each a :class:`BackendPool` of its own
(health, failover, resume and weight loading are the pool's, per deployment):

- ``training``: RL sessions (and the admin token); follows every weight push.
- ``production``: production keys; serves a pinned version that changes only
  when an operator promotes one (``proxima.proxy.policies.production``).
- ``canary``: a fraction of production sessions, sticky per session (a hash
  of the session's id puts it in ``[0, 1)``; below the fraction: canary).

Without ``--production-backend``/``--production-engine`` there is no
production deployment and production keys are served by ``training``. A
request may also ask for a version by model
name, ``<served-name>@v<N>`` (admin token only: ``proxima eval --version``), or
an adapter's, ``<served-name>:<adapter>@v<N>``; it is served by whichever
deployment serves that version of that policy now.

Adapters: each pool serves every adapter at a version of its own
(``BackendPool.adapters``), so production pins each adapter's version
separately, and each adapter has its own canary split (``adapter_splits``):
a production key of adapter A goes to the canary pool (which serves A's
canary version) with A's fraction, whatever the base's split is.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.embedded.launcher import EngineProcess
from proxima.proxy.embedded.supervisor import EngineSupervisor
from proxima.proxy.errors import Conflict

logger = logging.getLogger(__name__)

TRAINING = "training"
PRODUCTION = "production"
CANARY = "canary"

_VERSIONED_MODEL = re.compile(r"^(?P<name>.+)@v(?P<version>\d+)$")


@dataclass(eq=False)
class Deployment:
    """A named pool of backends; the embedded engines it started are supervised (restarted
    when they die: ``supervisor``) and stopped with it."""

    name: str
    pool: BackendPool
    engines: tuple[EngineProcess, ...] = ()
    supervisor: EngineSupervisor | None = None

    @property
    def version(self) -> int:
        return self.pool.version

    async def close(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()  # first: an engine stopped here is not restarted
        await self.pool.close()
        for engine in self.engines:
            engine.stop()

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "version": self.pool.version,
            "updating": self.pool.updating,
            "embedded_engine": bool(self.engines),
            "embedded_engines": len(self.engines),
            "engine_restarts": 0 if self.supervisor is None else self.supervisor.restarts,
            "backends": [
                {"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "version": b.version}
                for b in self.pool.backends
            ],
        }


@dataclass(frozen=True, slots=True)
class CanarySplit:
    version: int
    fraction: float


def canary_bucket(key: str) -> float:
    """A session's fixed place in ``[0, 1)``: the same key always gets the same number."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_model_version(model: str) -> tuple[str, int | None]:
    """``"name@v3"`` -> ``("name", 3)``; any other name -> ``(name, None)``."""
    match = _VERSIONED_MODEL.match(model)
    if match is None:
        return model, None
    return match["name"], int(match["version"])


CanaryFactory = Callable[[], Awaitable[Deployment]]


class Deployments:
    """The deployments of one proxy and the rule that picks one per request."""

    def __init__(
        self,
        training: Deployment,
        production: Deployment | None = None,
        *,
        canary_factory: CanaryFactory | None = None,
    ):
        self.training = training
        self.production = production
        self.canary: Deployment | None = None  # started on the first canary promotion
        self.split: CanarySplit | None = None  # the base model's
        self.adapter_splits: dict[str, CanarySplit] = {}  # each adapter's, by name
        self._canary_factory = canary_factory
        # Called with a deployment started after the others (the canary): a replica of a
        # fleet shares the loading of its backends with the other replicas (``proxy/app.py``).
        self.on_started: Callable[[Deployment], None] | None = None

    def split_of(self, adapter: str | None) -> CanarySplit | None:
        """The canary split of a policy (the base's, or an adapter's)."""
        return self.split if adapter is None else self.adapter_splits.get(adapter)

    def set_split(self, adapter: str | None, split: CanarySplit | None) -> None:
        if adapter is None:
            self.split = split
        elif split is None:
            self.adapter_splits.pop(adapter, None)
        else:
            self.adapter_splits[adapter] = split

    @property
    def separate(self) -> bool:
        """True when production has its own backends (a pinned version)."""
        return self.production is not None

    @property
    def can_canary(self) -> bool:
        return self.canary is not None or self._canary_factory is not None

    async def canary_deployment(self) -> Deployment:
        """The canary deployment, started on first use (an embedded engine takes seconds)."""
        if self.canary is None:
            if self._canary_factory is None:
                raise Conflict(
                    "No canary backends: start proxima serve with --canary-backend URL "
                    "(or use --production-engine, whose canary engine starts on demand).",
                    param="canary",
                )
            self.canary = await self._canary_factory()
            if self.on_started is not None:
                self.on_started(self.canary)
        return self.canary

    def all(self) -> list[Deployment]:
        found = [self.training, self.production, self.canary]
        return [d for d in found if d is not None]

    def route(
        self,
        *,
        production: bool,
        sticky_key: str | None,
        version: int | None = None,
        adapter: str | None = None,
    ) -> Deployment:
        """The deployment that serves a request.

        ``production``: the caller is a production key. ``sticky_key``: its
        session (the canary split is sticky per key; without one, each
        request draws). ``version``: a version asked for explicitly.
        ``adapter``: the request's policy (its canary split decides).
        """
        if version is not None:
            return self.serving(version, adapter)
        if not production or self.production is None:
            return self.training
        split = self.split_of(adapter)
        if split is not None and self.canary is not None and split.fraction > 0:
            draw = canary_bucket(sticky_key) if sticky_key is not None else random.random()
            # A canary with no healthy backend sends its sessions to the stable version
            # until the health checks put one back: a canary never fails production traffic.
            if draw < split.fraction and self.canary.pool.healthy_backends():
                return self.canary
        return self.production

    def serving(self, version: int, adapter: str | None = None) -> Deployment:
        """A deployment whose backends serve ``version`` of the policy ``adapter`` (None: the
        base) now, production first."""
        canary = self.canary if self.split_of(adapter) else None
        for deployment in (self.production, canary, self.training):
            if deployment is not None and deployment.pool.policy(adapter)[0] == version:
                return deployment
        whose = "" if adapter is None else f" of adapter {adapter}"
        flag = "" if adapter is None else f" --adapter {adapter}"
        raise Conflict(
            f"No deployment serves version {version}{whose} now. To evaluate a version that "
            f"is not served, put it on the canary with fraction 0: proxima production promote "
            f"<current> --canary {version} --fraction 0{flag}.",
            param="model",
            code="version_not_served",
        )

    def names_serving(self, version: int) -> list[str]:
        names = []
        if self.training.version == version:
            names.append(TRAINING)
        production = self.production or self.training
        if production.version == version:
            names.append(PRODUCTION)
        if self.canary is not None and self.split is not None and self.canary.version == version:
            names.append(CANARY)
        return names

    async def close(self) -> None:
        for deployment in self.all():
            await deployment.close()
