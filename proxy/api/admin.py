"""Admin routes: weight updates, health."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from proxy.api.deps import AdminDep, PoolDep, StoreDep
from proxy.api.schemas import WeightsRequest
from proxy.backends.errors import BackendError
from proxy.errors import BadRequest, Conflict

router = APIRouter(tags=["admin"])


@router.post("/admin/weights")
async def update_weights(
    body: WeightsRequest, _: AdminDep, pool: PoolDep, store: StoreDep
) -> dict[str, Any]:
    """Interrupt generation, load ``path`` as policy ``version`` everywhere, resume."""
    if body.version <= pool.version:
        raise Conflict(
            f"version {body.version} is not newer than the current version {pool.version}.",
            param="version",
        )
    try:
        update = await pool.update_weights(version=body.version, path=body.path)
    except BackendError as exc:
        raise BadRequest(f"Loading weights from {body.path} failed: {exc}", param="path") from exc
    await store.record_policy_version(version=body.version, path=body.path)
    return {
        "version": update.version,
        "path": update.path,
        "seconds": update.seconds,
        "backends": update.backends,
    }


@router.get("/health")
async def health(pool: PoolDep) -> dict[str, Any]:
    return {
        "status": "ok" if pool.healthy_backends() else "degraded",
        "version": pool.version,
        "updating": pool.updating,
        "backends": [
            {"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "version": b.version}
            for b in pool.backends
        ],
    }
