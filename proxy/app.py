"""``create_app(settings)``: the proxy's FastAPI application.

The lifespan builds everything the routes use (store, embedded engine or
backend list, pool, tokenizer, completion service) and tears it down; there
is no module-level mutable state.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from proxima.proxy.api import admin, openai, rl
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.completions import CompletionService
from proxima.proxy.config import Settings
from proxima.proxy.embedded.launcher import EngineProcess
from proxima.proxy.errors import install_error_handlers
from proxima.proxy.logs import RequestIdMiddleware
from proxima.proxy.metrics import Metrics, MetricsMiddleware
from proxima.proxy.middleware import BodyLimitMiddleware
from proxima.proxy.recorder import CompletionRecorder, SessionCache
from proxima.proxy.store.migrate import ensure_schema
from proxima.proxy.store.store import Store

logger = logging.getLogger(__name__)


def _context_length(settings: Settings) -> int:
    if settings.context_length:
        return settings.context_length
    config = json.loads((settings.model / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 4096)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    from transformers import AutoTokenizer

    await ensure_schema(settings.db)
    store = await Store.open(settings.db)
    engine: EngineProcess | None = None
    http = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=4096, max_keepalive_connections=1024)
    )
    try:
        urls = list(settings.backends)
        if not urls:
            engine = EngineProcess(
                settings.model, max_running_requests=settings.engine_max_running_requests
            )
            engine.start()
            await engine.wait_healthy()
            urls = [engine.url]
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(settings.model))
        pool = BackendPool(urls, http=http, version=0)
        versions = await store.list_policy_versions()
        latest = versions[-1] if versions else None
        if latest is not None and latest.version > 0 and latest.path:
            # Restarted proxy: serve the newest policy, not the base model.
            await pool.update_weights(version=latest.version, path=latest.path)
        pool.start_health_checks(settings.health_check_interval)
        app.state.store = store
        app.state.pool = pool
        app.state.tokenizer = tokenizer
        recorder = CompletionRecorder(store)
        recorder.start()
        app.state.cache = SessionCache()
        app.state.service = CompletionService(
            settings=settings,
            store=store,
            pool=pool,
            tokenizer=tokenizer,
            context_length=_context_length(settings),
            recorder=recorder,
            cache=app.state.cache,
            metrics=app.state.metrics,
        )
        app.state.admission_lock = asyncio.Lock()
        logger.info(
            "proxy ready: model=%s backends=%s version=%s", settings.model_name, urls, pool.version
        )
        yield
        await recorder.close()
        await pool.close()
    finally:
        await http.aclose()
        await store.close()
        if engine is not None:
            engine.stop()


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="Proxima proxy", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )

    app.state.metrics = Metrics()
    # Added innermost first: RequestId wraps Metrics wraps BodyLimit wraps the app.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(openai.router)
    app.include_router(rl.router)
    app.include_router(admin.router)
    return app
