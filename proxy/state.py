"""``AppState``: everything the proxy's routes use, in one typed object.

``build_state`` assembles it from the parts the lifespan opens (store,
deployments, tokenizer); the lifespan (``proxima.proxy.app``) starts its
background tasks, puts it on the app, and closes it. Routes reach it one way:
the dependencies of ``proxima.proxy.api.deps``, which all read ``state_of``.
Tests build it with the same ``build_state``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.caches import HistoryCache, PrincipalCache
from proxima.proxy.config import Settings
from proxima.proxy.metrics import Metrics
from proxima.proxy.policies.deployments import Deployments
from proxima.proxy.policies.fleet import FleetFollower
from proxima.proxy.policies.production import ProductionController
from proxima.proxy.service import CompletionService
from proxima.proxy.store.group_commit import GroupCommit
from proxima.proxy.store.store import Store
from starlette.requests import HTTPConnection


@dataclass(kw_only=True, eq=False)
class AppState:
    """What the lifespan built; lives as long as the app serves."""

    settings: Settings
    metrics: Metrics
    store: Store
    deployments: Deployments
    production: ProductionController
    follower: FleetFollower
    service: CompletionService
    group_commit: GroupCommit
    principals: PrincipalCache
    histories: HistoryCache
    base_url: str
    """Handed to agents in new sessions (``--public-base-url``, else the bound address)."""
    admission_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Keeps this process's session creations from each holding a database connection
    while they wait for the fleet's admission lock."""

    @property
    def pool(self) -> BackendPool:
        """The training deployment's pool."""
        return self.deployments.training.pool


def build_state(
    *,
    settings: Settings,
    metrics: Metrics,
    store: Store,
    deployments: Deployments,
    tokenizer: Any,
    context_length: int,
    bound_port: int | None = None,
) -> AppState:
    """Assemble the app state from what the lifespan opened; starts nothing."""
    pool = deployments.training.pool
    production = ProductionController(
        deployments=deployments, store=store, base_model_path=str(settings.model)
    )
    group_commit = GroupCommit(store)
    principals = PrincipalCache(ttl=settings.key_cache_seconds)
    histories = HistoryCache()
    service = CompletionService(
        settings=settings,
        store=store,
        pool=pool,
        tokenizer=tokenizer,
        context_length=context_length,
        group_commit=group_commit,
        principals=principals,
        histories=histories,
        metrics=metrics,
        deployments=deployments,
    )
    return AppState(
        settings=settings,
        metrics=metrics,
        store=store,
        deployments=deployments,
        production=production,
        follower=FleetFollower(store=store, pool=pool, production=production),
        service=service,
        group_commit=group_commit,
        principals=principals,
        histories=histories,
        base_url=settings.base_url(bound_port),
    )


def install_state(app: FastAPI, state: AppState) -> None:
    """Make ``state`` what ``state_of`` returns for requests to ``app``."""
    app.state.proxima = state


def state_of(connection: HTTPConnection) -> AppState:
    """The app state of the app serving ``connection``."""
    state: AppState = connection.app.state.proxima
    return state
