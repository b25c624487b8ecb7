"""``create_app(settings)``: the proxy's FastAPI application.

The lifespan (``open_state``) builds everything the routes use (store,
embedded engine or backend list, pool, tokenizer, completion service) into one
``AppState`` (``proxima.proxy.state``) and tears it down; there is no
module-level mutable state.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.telemetry import TelemetryConfig
from proxima.proxy.api import admin, health, models, rl
from proxima.proxy.api import deployments as deployments_api
from proxima.proxy.api.error_handlers import install_error_handlers
from proxima.proxy.api.middleware import AccessLogMiddleware, BodyLimitMiddleware
from proxima.proxy.api.routing import GenerationApp
from proxima.proxy.backends.errors import BackendError
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.backends.sglang import ADMIN_KEEPALIVE_S
from proxima.proxy.config import Settings
from proxima.proxy.embedded.launcher import EngineProcess
from proxima.proxy.embedded.startup import StartedEngines, start_engine, start_engines
from proxima.proxy.embedded.supervisor import EngineSupervisor
from proxima.proxy.inspector.routes import router as inspector_router
from proxima.proxy.logs import RequestIdMiddleware
from proxima.proxy.metrics import Metrics, MetricsMiddleware
from proxima.proxy.policies.deployments import CANARY, PRODUCTION, TRAINING, Deployment, Deployments
from proxima.proxy.rendering.context_length import ContextLengthMismatch, resolve_context_length
from proxima.proxy.state import AppState, build_state, install_state
from proxima.proxy.store.migrate import ensure_schema
from proxima.proxy.store.store import Store
from proxima.proxy.surfaces import SURFACES

logger = logging.getLogger(__name__)

GC_THRESHOLDS = (10_000, 10, 10)
"""The collector's thresholds once start-up is frozen (Python's default: 700, 10, 10).

Under load most objects the collector sees belong to requests still in flight: hundreds of
streams, each holding its body, prompt and token lists. After 700 allocations a pass finds
them alive and promotes them, so they reach the oldest generation, whose full passes walk
every record the proxy holds. At 200 streams of 16 tokens that came to ~0.4 ms of CPU per
request, a seventh of the proxy's. After 10,000 allocations far more of a request's objects
have already been freed by their counts, and full passes become rare. Measured with 200
streams (``bench/gc_cost.py``): collection ~0.16 ms per request against ~0.4, the proxy's
CPU per request 8-11% lower (docs/benchmarks.md); its longest pauses (34-60 ms) are shorter
than the default's full passes (124-142 ms)."""

# FastAPI's native OpenTelemetry off (``Settings.opentelemetry``): no spans, metrics or logs,
# and no per-request look for a global provider.
_NO_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}


async def _backend_context_length(pool: BackendPool) -> int | None:
    """The smallest ``max_context_length`` the backends report (None if none reports one)."""
    lengths = []
    for backend in pool.backends:
        try:
            info = await backend.client.model_info()
        except BackendError as exc:
            logger.warning("could not read %s's model info: %s", backend.url, exc)
            continue
        length = info.max_context_length
        if length is not None and length > 0:
            lengths.append(length)
    return min(lengths) if lengths else None


async def _deployment(
    name: str,
    settings: Settings,
    http: httpx.AsyncClient,
    urls: list[str],
    *,
    engines: Sequence[EngineProcess] = (),
) -> Deployment:
    """A deployment on ``urls``, or on ``engines`` (started here, and supervised: restarted
    when one dies) when given."""
    if engines:
        for engine in engines:
            await engine.wait_healthy()
        urls = [engine.url for engine in engines]
    pool = BackendPool(urls, http=http, version=0)
    pool.start_health_checks(settings.health_check_interval)
    supervisor = None
    if engines:
        supervisor = EngineSupervisor(pool, engines)
        supervisor.start()
    return Deployment(name, pool, tuple(engines), supervisor)


async def build_deployments(
    settings: Settings, http: httpx.AsyncClient, engines: StartedEngines
) -> Deployments:
    """``training`` always; ``production`` (and a canary) with the production flags.

    ``engines``: the embedded engines :func:`start_engines` started for ``settings`` (they
    load their models in parallel, and with the proxy's own start-up); stopped here on failure.
    """
    try:
        training = await _deployment(
            TRAINING, settings, http, list(settings.backends), engines=engines.training
        )
        production = None
        if settings.separate_production:
            production = await _deployment(
                PRODUCTION,
                settings,
                http,
                list(settings.production_backends),
                engines=engines.production,
            )
    except BaseException:
        engines.stop()
        raise

    canary_factory = None
    if settings.canary_backends:

        async def canary_factory() -> Deployment:
            return await _deployment(CANARY, settings, http, list(settings.canary_backends))

    elif settings.production_engine:

        async def canary_factory() -> Deployment:
            engine = start_engine(settings)
            try:
                return await _deployment(CANARY, settings, http, [], engines=[engine])
            except BaseException:
                engine.stop()
                raise

    return Deployments(training, production, canary_factory=canary_factory)


def _load_tokenizer(model: Path) -> Any:
    """The model's tokenizer; xgrammar is imported alongside (its first import takes seconds, and
    the first request with a JSON schema or a forced tool call would wait for it)."""
    import xgrammar  # noqa: F401
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def _http_client() -> httpx.AsyncClient:
    """The client of every backend call (generation and admin alike)."""
    return httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=4096,
            max_keepalive_connections=1024,
            keepalive_expiry=ADMIN_KEEPALIVE_S,
        )
    )


async def _start_tasks(state: AppState, store: Store, deployments: Deployments) -> None:
    """Catch up with the store, then start following it (replicas) and the group commit."""
    if store.shared:  # replicas (or workers): load weights once in the fleet

        def share(deployment: Deployment) -> None:
            deployment.pool.fleet_lock = store.publish_lock
            # Production's version goes back on a rollback: a backend is loaded with this
            # replica's version only while the store still says it.
            deployment.pool.fleet_version = state.production.recorded_version(deployment.name)

        for deployment in deployments.all():
            share(deployment)
        deployments.on_started = share  # the canary, started on its first use
    # A restarted proxy, or one more replica, serves the newest policy and production
    # state in the store: what the backends report is adopted, only those behind load.
    await state.follower.sync()
    if store.shared:
        state.follower.start()
    else:
        logger.info(
            "store on SQLite: one proxy process per database file (more on this host: "
            "--workers N; replicas on several hosts: PostgreSQL, --db postgresql://...)"
        )
    state.group_commit.start()


@asynccontextmanager
async def open_state(
    settings: Settings,
    metrics: Metrics,
    *,
    bound_port: int | None = None,
    engines: StartedEngines | None = None,
) -> AsyncIterator[AppState]:
    """Open the store, start the deployments, load the tokenizer, build the app state and
    its background tasks; close everything at exit.

    ``engines``: the embedded engines, when the caller started them already (``proxima
    serve`` does, before it imports this module); started here otherwise.
    """
    if engines is None:
        engines = start_engines(settings)
    # The tokenizer loads on another thread while the engines start in their own processes.
    tokenizer_load = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, settings.model))
    try:
        await ensure_schema(settings.db)
        # Workers of one `proxima serve --workers N` share the store as replicas do.
        store = await Store.open(settings.db, shared=True if settings.workers > 1 else None)
    except BaseException:
        engines.stop()
        await asyncio.gather(tokenizer_load, return_exceptions=True)  # a thread cannot be cancelled
        raise
    http = _http_client()
    deployments: Deployments | None = None
    try:
        deployments = await build_deployments(settings, http, engines)
        pool = deployments.training.pool
        try:
            context_length = resolve_context_length(settings, await _backend_context_length(pool))
        except ContextLengthMismatch as exc:
            logger.error("proxima serve: %s", exc)
            raise
        tokenizer = await tokenizer_load
        state = build_state(
            settings=settings,
            metrics=metrics,
            store=store,
            deployments=deployments,
            tokenizer=tokenizer,
            context_length=context_length,
            bound_port=bound_port,
        )
        await _start_tasks(state, store, deployments)
        # What start-up built lives as long as the process (modules, tokenizer: ~450k
        # objects). Frozen, it is not walked by the collector's full passes, each of which
        # would stall every request for a few hundred milliseconds.
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        logger.info(
            "proxy ready: model=%s deployments=%s",
            settings.model_name,
            {d.name: [b.url for b in d.pool.backends] for d in deployments.all()},
        )
        yield state
        await state.follower.close()
        await state.group_commit.close()
        state.service.close()
    finally:
        await asyncio.gather(tokenizer_load, return_exceptions=True)  # a thread cannot be cancelled
        if deployments is not None:
            await deployments.close()
        await http.aclose()
        await store.close()


def create_app(
    settings: Settings, *, bound_port: int | None = None, engines: StartedEngines | None = None
) -> FastAPI:
    """The proxy's app; ``bound_port``: the port its socket is bound to (``--port 0``);
    ``engines``: its embedded engines, already started (else the lifespan starts them)."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_state(settings, metrics, bound_port=bound_port, engines=engines) as state:
            install_state(app, state)
            yield

    private = settings.private_observability
    app = GenerationApp(
        title="Proxima proxy",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None if private else "/docs",
        redoc_url=None if private else "/redoc",
        openapi_url=None if private else "/openapi.json",
        # Else FastAPI looks for an OpenTelemetry provider on every request (in os.environ).
        telemetry=None if settings.opentelemetry else _NO_TELEMETRY,
    )
    install_error_handlers(app)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )

    # Added innermost first: RequestId wraps AccessLog wraps Metrics wraps BodyLimit wraps
    # the app (the request log sees the 413s and writes its line with the request id).
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if settings.access_log:
        app.add_middleware(AccessLogMiddleware)
    app.add_middleware(RequestIdMiddleware)
    for surface in SURFACES:  # the API surfaces: see proxima.proxy.surfaces
        for router in surface.routers:
            app.include_router(router)
    app.include_router(models.router)
    app.include_router(rl.router)
    app.include_router(admin.router)
    app.include_router(health.router)
    app.include_router(deployments_api.router)
    app.include_router(inspector_router)  # /ui: the trajectory inspector
    return app
