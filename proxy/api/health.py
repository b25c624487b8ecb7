"""Health routes: liveness, readiness, and ``/health`` (the details, for operators).

- ``GET /health/live``: 200 while the process serves requests (its event loop runs). It
  reads nothing, so a database or backend outage never fails it: the probe that restarts a
  process (Kubernetes' ``livenessProbe``) belongs here.
- ``GET /health/ready``: 200 when the store answers a query within
  :data:`CHECK_TIMEOUT_S` and the training deployment (and production's, when separate)
  has a healthy backend; 503 otherwise. The probe that takes a replica out of a load
  balancer (``readinessProbe``, haproxy's ``httpchk``) belongs here.
- ``GET /health``: kept for existing clients; never a 500 (a store outage is ``status:
  degraded`` with ``store: unavailable``). Its details (policy versions, every adapter's
  version, the backends' URLs and load, the deployments) go to the admin token, or to
  anyone when ``private_observability`` is off (as ``/metrics`` does); without them the
  answer is ``{"status": ...}`` alone.

None of them needs a token: a probe sends none.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from proxima.proxy.api.deps import StateDep
from proxima.proxy.auth import bearer_token, is_admin_token
from proxima.proxy.errors import AuthenticationFailed
from proxima.proxy.serving import this_worker
from proxima.proxy.state import AppState
from proxima.proxy.store.errors import StoreUnavailable
from proxima.proxy.store.records import PolicyVersionRecord

router = APIRouter(tags=["health"])

CHECK_TIMEOUT_S = 2.0
"""How long a health check waits for the store before it counts it unavailable."""


def _sees_details(state: AppState, request: Request) -> bool:
    """Whether the caller may read the details: the admin token, or nobody needs one."""
    settings = state.settings
    if not settings.private_observability:
        return True
    authorization = request.headers.get("authorization")
    api_key = request.headers.get("x-api-key")
    try:
        token = api_key.strip() if api_key and not authorization else bearer_token(authorization)
    except AuthenticationFailed:
        return False
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    return is_admin_token(token, admin)


async def _adapter_heads(state: AppState) -> dict[str, PolicyVersionRecord] | None:
    """Every adapter's newest version in the store; ``None`` when the store does not answer."""
    try:
        return await asyncio.wait_for(state.store.adapter_heads(), CHECK_TIMEOUT_S)
    except (StoreUnavailable, TimeoutError):
        return None


async def _store_answers(state: AppState) -> bool:
    try:
        await asyncio.wait_for(state.store.ping(), CHECK_TIMEOUT_S)
    except (StoreUnavailable, TimeoutError):
        return False
    return True


def _serving_deployments_healthy(state: AppState) -> bool:
    """Training, and production when it has its own backends, each have a healthy backend
    (a canary without one sends its traffic to production: it does not count)."""
    deployments = state.deployments
    serving = [deployments.training, deployments.production]
    return all(d.pool.healthy_backends() for d in serving if d is not None)


@router.get("/health/live")
async def live() -> dict[str, str]:
    """200 while the process serves: reads neither the store nor the backends."""
    return {"status": "alive"}


@router.get("/health/ready", response_model=None)
async def ready(state: StateDep) -> JSONResponse:
    """200 when the store and a backend of each serving deployment answer, else 503."""
    store_ok = await _store_answers(state)
    backends_ok = _serving_deployments_healthy(state)
    body = {
        "status": "ready" if store_ok and backends_ok else "unavailable",
        "store": "ok" if store_ok else "unavailable",
        "backends": "ok" if backends_ok else "unavailable",
    }
    return JSONResponse(body, status_code=200 if store_ok and backends_ok else 503)


@router.get("/health")
async def health(state: StateDep, request: Request) -> dict[str, Any]:
    """The training pool's state (top level) and every deployment's.

    ``adapters``: every LoRA adapter's current version, ``{name: version}``, read from
    the store (the fleet's record of what was pushed and loaded, which every replica
    shares), not from this process's pool; ``null`` while the store does not answer. A
    trainer whose push answer was lost reads it to tell that its retried push (answered
    409) had already landed.
    """
    pool = state.pool
    deployments = state.deployments.all()
    heads = await _adapter_heads(state)
    healthy = all(d.pool.healthy_backends() for d in deployments)
    status = "ok" if healthy and heads is not None else "degraded"
    if not _sees_details(state, request):
        return {"status": status}
    details: dict[str, Any] = {"status": status}
    worker = this_worker()
    if worker is not None:  # which of `proxima serve --workers N`'s processes answered
        details["worker"] = {"index": worker.index, "workers": worker.workers, "pid": os.getpid()}
    return details | {
        "store": "ok" if heads is not None else "unavailable",
        "version": pool.version,
        "adapters": None
        if heads is None
        else {name: record.version for name, record in sorted(heads.items())},
        "updating": pool.updating,
        "backends": [
            {"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "version": b.version}
            for b in pool.backends
        ],
        "deployments": {
            d.name: {
                "version": d.version,
                "healthy_backends": len(d.pool.healthy_backends()),
                "backends": len(d.pool.backends),
            }
            for d in deployments
        },
    }
