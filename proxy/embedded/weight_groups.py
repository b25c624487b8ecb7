"""Weights over a process group on the embedded engine: SGLang's distributed weight update.

The engine serves SGLang's routes for it (``proxima.proxy.embedded.app``):
``/init_weights_update_group`` joins the trainer's process group as rank ``rank_offset``
(the engine is one worker, SGLang's ``tp_size`` 1); ``/begin_weight_update`` opens a
session; each ``/update_weights_from_distributed`` receives one bucket by broadcast from
rank 0 (``proxima.proxy.embedded.process_group``); ``/end_weight_update`` closes the
session; ``/destroy_weights_update_group`` releases a group.

Unlike SGLang, which loads every bucket as it arrives (a trainer that dies mid-push leaves
its model half updated, which is why the proxy reloads such a backend), the engine
receives into a staging area and swaps the model's weights only at the bucket that
finishes an update, in one step of its worker, together with the version it reports. A
bucket finishes the update when it carries ``weight_version`` or ``flush_cache`` (SGLang's
default; a push in several buckets sets it on the last one only, as the proxy does). A
receive that fails (the trainer died, the group timed out) discards the staging area, and
so does ``/end_weight_update`` for an update that never finished: the engine keeps serving,
and reporting, the old weights.

Every bucket is checked before it is staged, as a directory is before a disk load: each
tensor names a parameter or buffer of the model with its shape, and holds finite values.
Answers are SGLang's: ``{"success", "message"}``, HTTP 400 when ``success`` is false.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable

import torch
import torch.distributed as dist
from proxima.proxy.backends.protocol import (
    InitWeightsUpdateGroupBody,
    UpdateWeightsFromDistributedBody,
    WeightSyncResponse,
)
from proxima.proxy.embedded.process_group import (
    LOAD_FORMATS,
    destroy_process_group,
    init_custom_process_group,
    receive_bucket,
    specs_of,
)
from proxima.proxy.embedded.weights import all_finite

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "PROXIMA_WEIGHT_GROUP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0

ApplyWeights = Callable[[dict[str, torch.Tensor], str | None], Awaitable[None]]
"""Swap checked tensors into the model between two worker steps, and set the version."""


def group_timeout_s() -> float:
    """How long a rendezvous or one receive may wait: ``$PROXIMA_WEIGHT_GROUP_TIMEOUT_S``
    (seconds), else 300. SGLang's request carries no timeout (SGLang waits torch's default,
    30 minutes), so the engine takes its own from the environment ``proxima serve`` passes
    to it."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    value = float(raw)
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def _ok(message: str) -> WeightSyncResponse:
    return WeightSyncResponse(success=True, message=message)


def _failed(message: str) -> WeightSyncResponse:
    logger.warning("weight update: %s", message)
    return WeightSyncResponse(success=False, message=message)


class WeightGroups:
    """The engine's weight-update groups and its staging area (one session at a time)."""

    def __init__(
        self, model: torch.nn.Module, apply: ApplyWeights, *, timeout_s: float | None = None
    ) -> None:
        self._targets = model.state_dict(keep_vars=True)
        self._apply = apply
        self.timeout_s = timeout_s if timeout_s is not None else group_timeout_s()
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._staged: dict[str, torch.Tensor] | None = None  # None: no session open
        self._lock = asyncio.Lock()  # one session call at a time

    @property
    def groups(self) -> list[str]:
        """The names of the groups this engine belongs to."""
        return sorted(self._groups)

    @property
    def session_open(self) -> bool:
        return self._staged is not None

    async def init_group(self, body: InitWeightsUpdateGroupBody) -> WeightSyncResponse:
        """Join ``body.group_name`` as rank ``rank_offset`` (blocks until all ranks joined)."""
        if not body.group_name:
            return _failed("Group name cannot be empty")
        rank = body.rank_offset  # the engine's one worker is SGLang's tp_rank 0
        old = self._groups.pop(body.group_name, None)
        if old is not None:  # torch registers a group's name once per process
            with contextlib.suppress(Exception):  # a broken group may not close cleanly
                await asyncio.to_thread(destroy_process_group, old)
        try:
            group = await asyncio.to_thread(
                init_custom_process_group,
                backend=body.backend,
                master_address=body.master_address,
                master_port=body.master_port,
                world_size=body.world_size,
                rank=rank,
                group_name=body.group_name,
                timeout_s=self.timeout_s,
            )
        except Exception as exc:  # torch raises DistStoreError, RuntimeError, ValueError...
            return _failed(f"Failed to initialize custom process group: {exc}.")
        self._groups[body.group_name] = group
        logger.info(
            "joined weight-update group %s as rank %d of %d",
            body.group_name,
            rank,
            body.world_size,
        )
        return _ok("Succeeded to initialize custom process group.")

    async def destroy_group(self, name: str) -> WeightSyncResponse:
        group = self._groups.pop(name, None)
        if group is None:
            return _failed("The group to be destroyed does not exist.")
        try:
            await asyncio.to_thread(destroy_process_group, group)
        except Exception as exc:  # a broken group may fail to close cleanly; it is gone
            return _failed(f"Failed to destroy custom process group: {exc}.")
        return _ok("Succeeded to destroy custom process group.")

    async def begin(self) -> WeightSyncResponse:
        async with self._lock:
            if self._staged is not None:
                return _failed(
                    "a weight-update session is already open; call end_weight_update() first"
                )
            self._staged = {}
            return _ok("Success")

    async def end(self) -> WeightSyncResponse:
        """Close the session; tensors of an update that never finished are discarded."""
        async with self._lock:
            if self._staged is None:
                return _failed("no weight-update session is open; call begin_weight_update() first")
            staged, self._staged = self._staged, None
            if staged:
                logger.warning(
                    "weight update: %d staged tensors of an unfinished update discarded",
                    len(staged),
                )
            return _ok("Success")

    async def update(self, body: UpdateWeightsFromDistributedBody) -> WeightSyncResponse:
        """Receive one bucket into the staging area; the bucket that finishes the update
        (``weight_version`` or ``flush_cache`` set) swaps every staged tensor in."""
        async with self._lock:
            if self._staged is None:
                return _failed(
                    "update_weights_from_distributed must run between begin_weight_update() "
                    "and end_weight_update()"
                )
            group = self._groups.get(body.group_name)
            if group is None:
                return _failed(
                    f"Failed to receive weights: Group {body.group_name} not in "
                    f"{self.groups}. Please call `init_weights_update_group` first."
                )
            if body.load_format not in LOAD_FORMATS:
                return _failed(f"Unknown load_format={body.load_format}")
            try:
                specs = specs_of(body.names, body.dtypes, body.shapes)
                received = await asyncio.to_thread(receive_bucket, group, specs, body.load_format)
            except Exception as exc:  # a dead sender, a timeout, a bad list
                self._staged = {}  # nothing of this push is ever applied
                return _failed(f"Failed to receive weights: {exc}")
            problem = self._check(received)
            if problem is not None:
                self._staged = {}
                return _failed(f"Failed to update parameter online: {problem}")
            self._staged.update(received)
            if body.weight_version is None and not body.flush_cache:
                return _ok("Succeeded to update parameter online.")  # staged
            staged, self._staged = self._staged, {}
            try:
                await self._apply(staged, body.weight_version)
            except (RuntimeError, ValueError) as exc:
                return _failed(f"Failed to apply received weights: {exc}")
            message = "Succeeded to update parameter online."
            if body.weight_version is not None:
                message += f" Weight version updated to {body.weight_version}."
            return _ok(message)

    def _check(self, received: list[tuple[str, torch.Tensor]]) -> str | None:
        """Why a received bucket cannot replace the model's tensors, or None."""
        for name, tensor in received:
            target = self._targets.get(name)
            if target is None:
                return f"unexpected tensor (not in the model): {name}"
            if tensor.shape != target.shape:
                return f"shape mismatch: {name}: {tuple(tensor.shape)} != {tuple(target.shape)}"
            if not all_finite(tensor):
                return f"non-finite values (NaN or inf) in tensor {name}"
        return None

    async def close(self) -> None:
        """Release every group (the engine is stopping)."""
        for name in list(self._groups):
            await self.destroy_group(name)
