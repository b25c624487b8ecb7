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

Every bucket is checked before anything is swapped in, as a directory is before a disk
load: each tensor names a parameter or buffer of the model with its shape (checked as the
bucket arrives, before it is staged), and holds finite values. The values' check reads
every byte, so it runs in a thread while the next bucket is received (the sender waits
for no check) and the bucket that finishes the update waits for all of them: a bucket
with a NaN fails that last call, and nothing of the update is applied.
Answers are SGLang's: ``{"success", "message"}``, HTTP 400 when ``success`` is false.

No copy and no fresh memory in the steady state: a flattened bucket is received into a
spare buffer of its size (a new one only when none is spare: a fresh buffer costs a page
fault per page, more than the transfer itself on a loaded CPU), and the swap points the
model's parameters at the received tensors instead of copying them
(``weights.swap_state_dict``); the buffers the model no longer views become the spares of
the next push. The engine so holds the model twice once it has received a push (the
served weights and the spares), against twice for the length of a push before.
:attr:`WeightGroups.last_update` says where the last update's time went.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import torch.distributed as dist
from proxima.proxy.backends.protocol import (
    InitWeightsUpdateGroupBody,
    UpdateWeightsFromDistributedBody,
    WeightSyncResponse,
)
from proxima.proxy.embedded.process_group import (
    FLATTENED_BUCKET,
    LOAD_FORMATS,
    TensorSpec,
    bucket_nbytes,
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


class BufferPool:
    """Flat receive buffers by size: the spares, those staged, those the model views."""

    def __init__(self) -> None:
        self._spares: dict[int, list[torch.Tensor]] = {}
        self.staged: list[torch.Tensor] = []  # received in the open update
        self._served: list[torch.Tensor] = []  # swapped in: the model may view them
        self.reused = self.allocated = 0  # buffers taken in the current update

    def take(self, nbytes: int) -> torch.Tensor:
        """A spare buffer of ``nbytes`` bytes, else a new one; staged until released."""
        spares = self._spares.get(nbytes)
        if spares:
            buffer = spares.pop()
            self.reused += 1
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self.allocated += 1
        self.staged.append(buffer)
        return buffer

    def discard(self) -> None:
        """The staged buffers were not swapped in: spares again."""
        for buffer in self.staged:
            self._spares.setdefault(buffer.numel(), []).append(buffer)
        self.staged = []

    def swapped(self, targets: dict[str, torch.Tensor]) -> None:
        """The staged buffers were swapped in; every served buffer the model (``targets``,
        its state dict) no longer views becomes a spare."""
        self._served += self.staged
        self.staged = []
        in_use = {t.untyped_storage().data_ptr() for t in targets.values()}
        kept = []
        for buffer in self._served:
            if buffer.untyped_storage().data_ptr() in in_use:
                kept.append(buffer)
            else:
                self._spares.setdefault(buffer.numel(), []).append(buffer)
        self._served = kept


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
        self._buffers = BufferPool()
        self._times = {"receive_s": 0.0, "check_s": 0.0}
        self._checks: list[asyncio.Future[tuple[str | None, float]]] = []  # staged values
        self.last_update: dict[str, Any] | None = None
        """The last swapped-in update: seconds receiving, checking and swapping, buckets,
        bytes, and receive buffers reused or allocated."""

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
            self._times = {"receive_s": 0.0, "check_s": 0.0}
            self._buffers.reused = self._buffers.allocated = 0
            return _ok("Success")

    def _discard(self) -> None:
        """Drop what is staged (nothing of it is ever applied); its buffers are spares."""
        self._staged = {}
        self._checks = []  # a check still running reads a spare: its verdict is not read
        self._buffers.discard()

    async def end(self) -> WeightSyncResponse:
        """Close the session; tensors of an update that never finished are discarded."""
        async with self._lock:
            if self._staged is None:
                return _failed("no weight-update session is open; call begin_weight_update() first")
            staged, self._staged = self._staged, None
            self._checks = []
            self._buffers.discard()
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
            started = time.monotonic()
            try:
                specs = specs_of(body.names, body.dtypes, body.shapes)
                received = await asyncio.to_thread(self._receive, group, specs, body.load_format)
            except Exception as exc:  # a dead sender, a timeout, a bad list
                self._discard()  # nothing of this push is ever applied
                return _failed(f"Failed to receive weights: {exc}")
            self._times["receive_s"] += time.monotonic() - started
            problem = self._check_fit(received)
            if problem is not None:
                self._discard()
                return _failed(f"Failed to update parameter online: {problem}")
            self._checks.append(asyncio.ensure_future(asyncio.to_thread(self._check, received)))
            self._staged.update(received)
            if body.weight_version is None and not body.flush_cache:
                return _ok("Succeeded to update parameter online.")  # staged
            checks, self._checks = self._checks, []
            verdicts = await asyncio.gather(*checks)
            self._times["check_s"] += sum(seconds for _, seconds in verdicts)
            problem = next((p for p, _ in verdicts if p is not None), None)
            if problem is not None:
                self._discard()
                return _failed(f"Failed to update parameter online: {problem}")
            try:
                await self._swap(body.weight_version)
            except (RuntimeError, ValueError) as exc:
                return _failed(f"Failed to apply received weights: {exc}")
            message = "Succeeded to update parameter online."
            if body.weight_version is not None:
                message += f" Weight version updated to {body.weight_version}."
            return _ok(message)

    def _receive(
        self, group: dist.ProcessGroup, specs: list[TensorSpec], load_format: str | None
    ) -> list[tuple[str, torch.Tensor]]:
        """One bucket, a flattened one into a spare buffer (:class:`BufferPool`)."""
        if load_format != FLATTENED_BUCKET:
            return receive_bucket(group, specs, load_format)
        out = self._buffers.take(bucket_nbytes(specs))
        return receive_bucket(group, specs, load_format, out=out)

    async def _swap(self, weight_version: str | None) -> None:
        """Swap every staged tensor in (the model keeps them) and record the update."""
        assert self._staged is not None
        staged, self._staged = self._staged, {}
        started = time.monotonic()
        pool = self._buffers
        reused, allocated = pool.reused, pool.allocated
        try:
            await self._apply(staged, weight_version)
        finally:  # even a swap that failed midway: the buffers the model views stay served
            pool.swapped(self._targets)
            pool.reused = pool.allocated = 0
        times, self._times = self._times, {"receive_s": 0.0, "check_s": 0.0}
        self.last_update = {
            **times,
            "swap_s": time.monotonic() - started,
            "tensors": len(staged),
            "bytes": sum(t.nbytes for t in staged.values()),
            "buffers_reused": reused,
            "buffers_allocated": allocated,
            "weight_version": weight_version,
        }

    def _check_fit(self, received: list[tuple[str, torch.Tensor]]) -> str | None:
        """Why a received bucket's tensors do not fit the model (names, shapes), or None."""
        for name, tensor in received:
            target = self._targets.get(name)
            if target is None:
                return f"unexpected tensor (not in the model): {name}"
            if tensor.shape != target.shape:
                return f"shape mismatch: {name}: {tuple(tensor.shape)} != {tuple(target.shape)}"
        return None

    @staticmethod
    def _check(received: list[tuple[str, torch.Tensor]]) -> tuple[str | None, float]:
        """Why a received bucket's values cannot be served (NaN or inf), or None; and the
        seconds the check took (in a thread, beside the next receive)."""
        started = time.monotonic()
        problem = next(
            (
                f"non-finite values (NaN or inf) in tensor {name}"
                for name, tensor in received
                if not all_finite(tensor)
            ),
            None,
        )
        return problem, time.monotonic() - started

    async def close(self) -> None:
        """Release every group (the engine is stopping)."""
        for name in list(self._groups):
            await self.destroy_group(name)
