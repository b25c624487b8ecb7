"""Weight-update groups: the trainer opens one with every backend, then pushes over it.

A broadcast push (``[trainer.weights] transport = "broadcast"``) takes two kinds of call, the
proxy relaying each to every backend (``proxima.proxy.backends.weight_group``):

1. ``GET /admin/weights/group``: the members a group would have now, their rank offsets and
   the world size (the trainer is rank 0); ``group`` names the open group, if any.
2. ``POST /admin/weights/group {group_name, master_address, master_port, backend,
   world_size, timeout_s}``: while the trainer joins its process group as rank 0 (hosting
   the rendezvous at ``master_address:master_port``), the proxy has every member join; it
   answers once all did. A member that refuses or a rendezvous that times out is a 503
   ``weight_group_failed`` naming the backend; a ``world_size`` that is no longer the pool's
   (a backend came or went since step 1) is a 409 ``weight_group_stale``.
3. ``POST /admin/weights {version, path, broadcast: {group_name, buckets, load_format,
   timeout_s}}`` (``proxima.proxy.api.admin``): the push itself, while the trainer
   broadcasts the buckets in order. A group that lost or gained a member since it opened is
   a 409 ``weight_group_stale`` before anything pauses (open a new one, or push from disk).

``DELETE /admin/weights/group`` destroys the open group on its members.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from proxima.proxy.api.deps import AdminDep, PoolDep
from proxima.proxy.api.schemas import BroadcastPush, WeightGroupRequest
from proxima.proxy.backends.members import WeightUpdate
from proxima.proxy.backends.pool import BackendPool
from proxima.proxy.backends.weight_group import Bucket, GroupMember

router = APIRouter(tags=["admin"])


def _members(members: tuple[GroupMember, ...] | list[GroupMember]) -> list[dict[str, object]]:
    return [m.describe() for m in members]


@router.get("/admin/weights/group")
async def weight_group_plan(_: AdminDep, pool: PoolDep) -> dict[str, Any]:
    """The members a group opened now would have (every backend that answers, in order,
    with its rank offset and rank count), the world size, and the open group's name."""
    members = await pool.weight_groups.plan()
    group = pool.weight_groups.group
    return {
        "group": group.name if group is not None else None,
        "world_size": 1 + sum(m.ranks for m in members),
        "members": _members(members),
    }


@router.post("/admin/weights/group")
async def open_weight_group(body: WeightGroupRequest, _: AdminDep, pool: PoolDep) -> dict[str, Any]:
    """Have every backend join the trainer's process group (see the module docstring)."""
    async with pool.publish_lock:  # not during a push
        group = await pool.weight_groups.open(
            name=body.group_name,
            master_address=body.master_address,
            master_port=body.master_port,
            backend=body.backend,
            world_size=body.world_size,
            timeout_s=body.timeout_s,
        )
    return {
        "group_name": group.name,
        "world_size": group.world_size,
        "members": _members(group.members),
    }


@router.delete("/admin/weights/group")
async def close_weight_group(_: AdminDep, pool: PoolDep) -> dict[str, Any]:
    """Destroy the open group on its members; ``closed`` names it (null: none was open)."""
    async with pool.publish_lock:
        group = pool.weight_groups.group
        await pool.weight_groups.close()
    return {"closed": group.name if group is not None else None}


async def push_by_broadcast(
    pool: BackendPool, *, version: int, path: str, broadcast: BroadcastPush
) -> WeightUpdate:
    """The push of ``POST /admin/weights`` with ``broadcast`` (the caller holds the publish
    locks and records the version)."""
    return await pool.weight_groups.push(
        version=version,
        path=path,
        name=broadcast.group_name,
        buckets=[Bucket(b.names, b.dtypes, b.shapes) for b in broadcast.buckets],
        load_format=broadcast.load_format,
        timeout_s=broadcast.timeout_s,
    )
