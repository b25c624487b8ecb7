"""The proxy's ``AppState`` for tests that mount some of its routers on a bare app.

``install_test_state`` builds it with ``build_state``, as the lifespan does, on
the store and pool the test hands in, with the tokenizer of ``settings.model``;
nothing is started (no engine, no group-commit task, no fleet follower).
"""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.config import Settings
from proxima.proxy.metrics import Metrics
from proxima.proxy.policies.deployments import TRAINING, Deployment, Deployments
from proxima.proxy.state import AppState, build_state, install_state

UNUSED_BACKEND = "http://127.0.0.1:9"
"""The backend of a pool no test request reaches (the discard port)."""


class NoKeys:
    """A store that knows no key: only the admin token is a caller (every other is a 401)."""

    async def get_session_by_key_hash(self, *, api_key_hash: str) -> None:
        return None

    async def get_api_key_by_hash(self, *, key_hash: str) -> None:
        return None


def install_test_state(
    app: FastAPI,
    *,
    settings: Settings,
    store: Any,
    pool: BackendPool | None = None,
    context_length: int = 2048,
) -> AppState:
    """Build the app state on ``store`` and ``pool`` (default: one backend nobody calls)
    and install it on ``app``; returns it."""
    from transformers import AutoTokenizer

    if pool is None:
        pool = BackendPool([UNUSED_BACKEND], http=httpx.AsyncClient())
    state = build_state(
        settings=settings,
        metrics=Metrics(),
        store=store,
        deployments=Deployments(Deployment(TRAINING, pool)),
        tokenizer=AutoTokenizer.from_pretrained(str(settings.model)),
        context_length=context_length,
    )
    install_state(app, state)
    return state
