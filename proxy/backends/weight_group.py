"""Weight pushes by broadcast: the trainer's process group with the backends, and a push over it.

A disk push tells each backend where to read the new weights; a broadcast push has the
trainer send them, rank 0 of a torch process group whose other ranks are the backends'
workers (SGLang's ``/init_weights_update_group`` and ``/update_weights_from_distributed``;
the wire is :mod:`proxima.proxy.backends.protocol`'s). The proxy stays the one place that
pauses generation and records versions: the trainer asks it to open the group and to push,
and the proxy relays each call to every backend while the trainer broadcasts.

Opening (``open``): :meth:`WeightGroups.plan` lists the members (every backend that
answers ``/server_info``, in the pool or not: a backend kept out because it could not load
the current weights from disk is brought up to date by the next push) and their ranks
(SGLang's ``tp_size``; rank offsets follow the backends' order from 1, the trainer is 0).
The trainer joins as rank 0 while the proxy relays ``/init_weights_update_group`` to every
member; any failure (a rendezvous timeout, a refused call) destroys what formed and raises.
A new group replaces the old one, which is destroyed on its members.

Pushing (``push``): refused before anything pauses (``WeightGroupStale``) unless every
member still runs the process that joined (its ``/server_info`` ``startup_time``) and every
routed backend is a member, so the trainer opens a new group (or pushes from disk) instead.
Then, as a disk push: the gate closes, every member pauses in abort mode, and for each
bucket in order every member is sent its ``/update_weights_from_distributed`` (the last
bucket carries ``weight_version``; a member that fails one is sent no more), then
``/end_weight_update``, resume, gate opens. The version changes if a member loaded it all.

SGLang loads each bucket as it arrives, so a member that failed mid-push may hold half
updated weights while it reports the old version: every such member is reloaded from disk
at the pool's current version before the gate opens, and one that cannot be (dead, or no
path it can read) is taken out with ``must_reload`` set, which ``rejoin`` honours before it
ever routes to it again. The group is broken after any failure and forgotten.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from proxima.proxy.backends.errors import (
    BackendConnectionError,
    BackendError,
    BackendOperationFailed,
    BackendUnavailable,
)
from proxima.proxy.backends.members import Backend, PoolState, WeightUpdate
from proxima.proxy.backends.protocol import (
    InitWeightsUpdateGroupBody,
    UpdateWeightsFromDistributedBody,
)
from proxima.proxy.errors import Conflict

logger = logging.getLogger(__name__)

_PROBE_S = 10.0  # how long a member may take to answer /server_info before a push
# A relayed call waits this much longer than the group's own timeout, so the backend's
# verdict (its receive failed or timed out) arrives before the proxy gives up on it.
_RELAY_MARGIN_S = 10.0
_RESTORE_S = 120.0  # how long reloading a member after a failed push may take


class WeightGroupStale(Conflict):
    """The group the trainer names is not this pool's current one, or a member left it."""


class WeightGroupFailed(BackendOperationFailed):
    """The group could not form (a member refused, or the rendezvous timed out)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = "weight_group_failed"


@dataclass(frozen=True, slots=True)
class GroupMember:
    backend: Backend
    rank_offset: int
    ranks: int
    startup: object  # what /server_info reported as startup_time when it joined

    def describe(self) -> dict[str, object]:
        return {"url": self.backend.url, "rank_offset": self.rank_offset, "ranks": self.ranks}


@dataclass(frozen=True, slots=True)
class WeightGroup:
    name: str
    backend: str
    world_size: int
    members: tuple[GroupMember, ...]


@dataclass(frozen=True, slots=True)
class Bucket:
    """One ``/update_weights_from_distributed`` call: tensors in broadcast order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


async def _ranks(backend: Backend) -> tuple[int, object]:
    """How many ranks ``backend`` takes in a group, and its start-up time."""
    info = await backend.client.server_info()
    tp, dp, pp = (int(info.get(k) or 1) for k in ("tp_size", "dp_size", "pp_size"))
    if dp > 1 or pp > 1:
        raise BackendOperationFailed(
            f"weights cannot be broadcast to a server with dp_size {dp}, pp_size {pp} "
            "(SGLang supports update_weights_from_distributed with tp only)",
            url=backend.url,
        )
    return tp, info.get("startup_time")


def _first_error(errors: dict[Backend, BaseException]) -> str:
    return "; ".join(f"{b.url}: {e}" for b, e in errors.items())


class WeightGroups:
    """The pool's weight-update group (at most one) and the pushes that go over it."""

    def __init__(self, state: PoolState) -> None:
        self._state = state
        self.group: WeightGroup | None = None

    async def plan(self) -> list[GroupMember]:
        """The members a group opened now would have, with their rank offsets."""
        backends = self._state.backends
        answers = await asyncio.gather(*(_ranks(b) for b in backends), return_exceptions=True)
        members, offset = [], 1
        for backend, answer in zip(backends, answers, strict=True):
            if isinstance(answer, BackendOperationFailed) and "dp_size" in str(answer):
                raise answer
            if isinstance(answer, BaseException):
                continue  # down: not a member (it rejoins from disk, or a later group)
            ranks, startup = answer
            members.append(GroupMember(backend, offset, ranks, startup))
            offset += ranks
        if not members:
            raise BackendUnavailable("No backend answers: no weight-update group can form.")
        return members

    async def open(
        self,
        *,
        name: str,
        master_address: str,
        master_port: int,
        backend: str,
        world_size: int,
        timeout_s: float,
    ) -> WeightGroup:
        """Relay ``/init_weights_update_group`` to every member while the trainer joins as
        rank 0; ``world_size`` must be the plan's (the trainer read it from :meth:`plan`)."""
        await self.close()
        members = await self.plan()
        expected = 1 + sum(m.ranks for m in members)
        if world_size != expected:
            raise WeightGroupStale(
                f"world_size {world_size} is not this pool's: {expected} (the trainer and "
                f"{len(members)} backend(s)); read GET /admin/weights/group again",
                param="world_size",
                code="weight_group_stale",
            )

        async def join(member: GroupMember) -> None:
            body = InitWeightsUpdateGroupBody(
                master_address=master_address,
                master_port=master_port,
                rank_offset=member.rank_offset,
                world_size=world_size,
                group_name=name,
                backend=backend,
            )
            await member.backend.client.init_weights_update_group(
                body, timeout_s=timeout_s + _RELAY_MARGIN_S
            )

        # SGLang's scheduler waits in the rendezvous (its /health too): a health probe
        # that overlaps the join says nothing, as one that overlaps a push.
        self._state.updates_begun += 1
        try:
            results = await asyncio.gather(*(join(m) for m in members), return_exceptions=True)
        finally:
            self._state.updates_begun += 1
        errors = {m.backend: r for m, r in zip(members, results, strict=True) if r is not None}
        group = WeightGroup(name, backend, world_size, tuple(members))
        if errors:
            joined = [m for m in members if m.backend not in errors]
            await _destroy(name, joined)
            raise WeightGroupFailed(
                f"the weight-update group {name!r} could not form: {_first_error(errors)}"
            )
        self.group = group
        logger.info("weight-update group %s formed: world size %d", name, world_size)
        return group

    async def close(self) -> None:
        """Destroy the current group on its members (best effort) and forget it."""
        group, self.group = self.group, None
        if group is not None:
            await _destroy(group.name, group.members)

    async def check(self, name: str) -> WeightGroup:
        """The current group, if it is ``name`` and whole; else ``WeightGroupStale``."""
        group = self.group
        if group is None or group.name != name:
            current = "none is open" if group is None else f"the current one is {group.name!r}"
            raise WeightGroupStale(
                f"no weight-update group {name!r} ({current}); open one with "
                "POST /admin/weights/group",
                code="weight_group_stale",
            )
        members = {m.backend for m in group.members}
        outsiders = [b.url for b in self._state.healthy_backends() if b not in members]
        answers = await asyncio.gather(
            *(asyncio.wait_for(_ranks(m.backend), _PROBE_S) for m in group.members),
            return_exceptions=True,
        )
        left = [
            m.backend.url
            for m, answer in zip(group.members, answers, strict=True)
            if isinstance(answer, BaseException) or answer[1] != m.startup
        ]
        if outsiders or left:
            await self.close()
            why = f"{', '.join(left)} left it" if left else f"{', '.join(outsiders)} joined"
            raise WeightGroupStale(
                f"the weight-update group {name!r} is stale ({why}); open a new one",
                code="weight_group_stale",
            )
        return group

    async def push(
        self,
        *,
        version: int,
        path: str,
        name: str,
        buckets: Sequence[Bucket],
        load_format: str | None,
        timeout_s: float,
    ) -> WeightUpdate:
        """Interrupt generation, have every member receive the buckets, resume."""
        group = await self.check(name)
        state = self._state
        async with state.update_lock:
            started = time.monotonic()
            state.updates_begun += 1
            state.ready.clear()
            try:
                members = [m.backend for m in group.members]
                await asyncio.gather(
                    *(b.client.pause_generation(mode="abort") for b in members),
                    return_exceptions=True,
                )
                try:
                    failed = await _relay(group, buckets, version, load_format, timeout_s)
                    loaded = [b for b in members if b not in failed]
                    if loaded:
                        state.version, state.weights_path = version, path
                    self._settle(loaded, failed, version)
                    await self._restore(failed)  # still paused: at the current version
                finally:
                    await asyncio.gather(
                        *(b.client.continue_generation() for b in members), return_exceptions=True
                    )
                if failed:
                    await self.close()  # the group broke with the push
                if not loaded:
                    raise BackendOperationFailed(
                        f"no backend received version {version}: {_first_error(failed)}"
                    )
            finally:
                state.ready.set()
            update = WeightUpdate(
                version, path, time.monotonic() - started, [b.url for b in loaded]
            )
            state.last_update = update
            logger.info(
                "weights v%s broadcast to %d backend(s) in %.3fs",
                version,
                len(loaded),
                update.seconds,
            )
            return update

    def _settle(self, loaded: list[Backend], failed: dict[Backend, BaseException], v: int) -> None:
        """Members that received every bucket serve ``v``; the others did not get it."""
        for backend in loaded:
            backend.version = v
            backend.must_reload = False
            if not backend.healthy:
                self._state.schedule_rejoin(backend)
        for backend, error in failed.items():
            logger.error("backend %s did not receive v%s: %s", backend.url, v, error)

    async def _restore(self, failed: dict[Backend, BaseException]) -> None:
        """Reload members a failed push may have left half updated, at the pool's current
        version, from disk; one that cannot is taken out with ``must_reload`` set."""
        for backend in failed:
            backend.must_reload = True
        await asyncio.gather(*(_reload(self._state, b) for b in failed))


async def _reload(state: PoolState, backend: Backend) -> None:
    """Load the pool's current version on a member a failed push may have half updated; a
    member that does not answer is taken out as failed, one that cannot load it is taken out
    to reload later (``must_reload`` stays set either way)."""
    try:
        info = await backend.client.model_info()
        path = state.weights_path or info.model_path
        await asyncio.wait_for(
            backend.client.update_weights_from_disk(
                model_path=path, weight_version=str(state.version)
            ),
            _RESTORE_S,
        )
    except BackendConnectionError as exc:
        state.mark_failed(backend, exc)  # ``rejoin`` reloads it when it answers again
        return
    except (BackendError, TimeoutError) as exc:
        state.mark_must_reload(backend, f"could not be restored to v{state.version}: {exc!r}")
        return
    backend.must_reload = False
    backend.version = state.version
    logger.info("backend %s restored to v%s from disk", backend.url, state.version)


async def _begin(backend: Backend) -> None:
    try:
        await backend.client.begin_weight_update()
    except BackendOperationFailed as exc:
        if "already open" not in str(exc):
            raise
        await backend.client.end_weight_update()  # a session an earlier push left open
        await backend.client.begin_weight_update()


async def _relay(
    group: WeightGroup,
    buckets: Sequence[Bucket],
    version: int,
    load_format: str | None,
    timeout_s: float,
) -> dict[Backend, BaseException]:
    """Send every bucket to every member in order; the members that failed, with why.

    The push stops at the first failure (a member that died, refused a bucket, or timed
    out): the trainer's broadcast of that bucket failed with it and it sends no more, so the
    other members would only wait out their receive timeout for the next one. Every member
    is then failed; each session that began is ended.
    """
    members = [m.backend for m in group.members]
    begun = await asyncio.gather(*(_begin(b) for b in members), return_exceptions=True)
    failed: dict[Backend, BaseException] = {
        b: r for b, r in zip(members, begun, strict=True) if isinstance(r, BaseException)
    }
    for index, bucket in enumerate(buckets):
        if failed:
            stopped = BackendOperationFailed(
                f"the push stopped at bucket {index + 1} of {len(buckets)}: {_first_error(failed)}"
            )
            failed.update({b: stopped for b in members if b not in failed})
            break
        last = index == len(buckets) - 1
        body = UpdateWeightsFromDistributedBody(
            names=bucket.names,
            dtypes=bucket.dtypes,
            shapes=bucket.shapes,
            group_name=group.name,
            flush_cache=last,  # the swap: the engine stages the buckets before it
            weight_version=str(version) if last else None,
            load_format=load_format,
        )
        relay_s = timeout_s + _RELAY_MARGIN_S
        results = await asyncio.gather(
            *(b.client.update_weights_from_distributed(body, timeout_s=relay_s) for b in members),
            return_exceptions=True,
        )
        failed.update(
            {b: r for b, r in zip(members, results, strict=True) if isinstance(r, BaseException)}
        )
    began = [b for b, r in zip(members, begun, strict=True) if not isinstance(r, BaseException)]
    await asyncio.gather(*(b.client.end_weight_update() for b in began), return_exceptions=True)
    return failed


async def _destroy(name: str, members: Sequence[GroupMember]) -> None:
    await asyncio.gather(
        *(m.backend.client.destroy_weights_update_group(name) for m in members),
        return_exceptions=True,
    )
