"""Admin routes: weight updates, the trainer's shared settings, metrics (health:
``proxima.proxy.api.health``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from proxima.proxy.api.deps import AdminDep, ObserverDep, PoolDep, SettingsDep, StateDep, StoreDep
from proxima.proxy.api.schemas import WeightsRequest
from proxima.proxy.api.weight_groups import push_by_broadcast
from proxima.proxy.api.weight_groups import router as weight_groups_router
from proxima.proxy.backends.errors import BackendError, BackendUnavailable
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.errors import BadRequest, Conflict
from proxima.proxy.policies.adapters import screen_adapter_dir
from proxima.proxy.store.records import SessionKind

router = APIRouter(tags=["admin"])
router.include_router(weight_groups_router)  # /admin/weights/group: broadcast pushes


@router.post("/admin/weights")
async def update_weights(
    body: WeightsRequest, _: AdminDep, state: StateDep, pool: PoolDep, store: StoreDep
) -> dict[str, Any]:
    """Interrupt generation, load ``path`` as policy ``version`` everywhere, resume.

    With ``adapter``: ``path`` is a LoRA adapter (a peft directory), ``version``
    that adapter's next version; it is loaded beside the others and only that
    adapter's generations are interrupted (``BackendPool.update_adapter``).

    With ``broadcast``: the trainer sends the full weights over its open weight-update
    group while every backend receives them (``proxima.proxy.api.weight_groups``);
    ``path`` is recorded (and loaded by a backend that rejoins later). Generation is
    interrupted, and the version recorded, exactly as for a disk push.

    The check that ``version`` is newer, the load and the record in the store
    are one critical section: of two concurrent pushes the second sees the
    first's version, so the store, the pool and every backend agree on which
    weights carry which number (a stale or duplicate version is 409, unloaded).
    """
    # One push at a time in the fleet (replicas on one PostgreSQL share the backends), then
    # in this process; the store's version is the fleet's, this pool may lag it a moment.
    adapter = body.adapter
    if adapter is not None:
        screen_adapter_dir(body.path)  # a bad adapter_config.json: 400 before any load
    async with store.publish_lock(), pool.publish_lock:
        recorded = await store.current_policy_version(adapter=adapter)
        if _loaded_unrecorded(pool, body, recorded):
            # The push's load landed, its record did not (the store went out of reach in
            # between, a 503): this retry records it, rather than a 409 that leaves the
            # store a version behind what the backends serve.
            await store.record_policy_version(version=body.version, path=body.path, adapter=adapter)
            return _pushed(body, body.version, 0.0, [b.url for b in pool.healthy_backends()])
        current = max(pool.policy(adapter)[0], recorded)
        if body.version <= current:
            whose = "" if adapter is None else f" of adapter {adapter}"
            raise Conflict(
                f"version {body.version} is not newer than the current version{whose} {current}.",
                param="version",
                code="version_not_newer",
            )
        try:
            if body.broadcast is not None:
                update = await push_by_broadcast(
                    pool, version=body.version, path=body.path, broadcast=body.broadcast
                )
            elif adapter is None:
                update = await pool.update_weights(version=body.version, path=body.path)
            else:
                update = await pool.update_adapter(
                    adapter=adapter, version=body.version, path=body.path
                )
        except BackendUnavailable:
            raise  # no backend to load into: a 503, not the path's fault
        except BackendError as exc:
            if body.broadcast is not None:
                raise  # the group or a backend failed, not the path: a 503 with why
            raise BadRequest(
                f"Loading {'weights' if adapter is None else 'the adapter'} from {body.path} "
                f"failed: {exc}",
                param="path",
            ) from exc
        await store.record_policy_version(version=body.version, path=body.path, adapter=adapter)
    state.metrics.weight_updates.observe(update.seconds)
    return _pushed(body, update.version, update.seconds, update.backends, update.path)


def _pushed(
    body: WeightsRequest,
    version: int,
    seconds: float,
    backends: list[str],
    path: str | None = None,
) -> dict[str, Any]:
    """The answer to a push that is served now."""
    return {
        "version": version,
        "path": body.path if path is None else path,
        "seconds": seconds,
        "backends": backends,
        "adapter": body.adapter,
        "transport": "disk" if body.broadcast is None else "broadcast",
    }


def _loaded_unrecorded(pool: BackendPool, body: WeightsRequest, recorded: int) -> bool:
    """Whether the pool serves ``body``'s version from ``body``'s path while the store has
    not recorded it: a push whose record failed after its load, sent again."""
    served, _ = pool.policy(body.adapter)
    if body.version != served or recorded >= body.version:
        return False
    if body.adapter is None:
        return pool.weights_path == body.path
    current = pool.adapters.get(body.adapter)
    return current is not None and current.path == body.path


@router.get("/admin/config")
async def trainer_settings(_: AdminDep, settings: SettingsDep) -> dict[str, Any]:
    """The settings the proxy and the trainer share, declared once, here.

    ``train_batch_size`` (B) and ``max_staleness`` (eta, null: no admission
    gate) are the two numbers of the staleness rule ``N < (version + eta + 1) * B``
    (``proxima serve --train-batch-size/--max-staleness``). The trainer reads
    them at start and refuses a config that says otherwise
    (``proxima.trainer.proxy_settings``).
    """
    return {"train_batch_size": settings.train_batch_size, "max_staleness": settings.max_staleness}


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root() -> dict[str, str]:
    """200 at the root: Claude Code sends ``HEAD /`` to its base URL before its first request
    (a connectivity check). Names nothing about the model (``/v1/models`` needs a key)."""
    return {"service": "proxima", "api": "/v1"}


@router.get("/metrics", include_in_schema=False)
async def metrics(_: ObserverDep, state: StateDep) -> Response:
    """Prometheus exposition; gauges are read from the pool and the store at scrape time."""
    m, store, deployments = state.metrics, state.store, state.deployments
    m.policy_version.set(state.pool.version)
    for deployment in deployments.all():
        m.deployment_version.labels(deployment.name).set(deployment.version)
    m.canary_fraction.set(deployments.split.fraction if deployments.split else 0.0)
    for backend in (b for d in deployments.all() for b in d.pool.backends):
        m.backend_healthy.labels(backend.url).set(1 if backend.healthy else 0)
        m.backend_in_flight.labels(backend.url).set(backend.in_flight)
    for kind in SessionKind:
        counts = await store.count_sessions_by_status(kind=kind)
        for status, count in counts.items():
            m.sessions.labels(kind.value, status.value).set(count)
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
