"""Steps 6 and 7 of ``proxima.trainer.loop``: a trained version pushed, its step settled.

:class:`Publishing` is the part of :class:`~proxima.trainer.loop.Trainer` that makes the
weights in memory a served version and records it (the recovery rule of
``proxima.trainer.weights`` depends on their order):

- by disk (every sink; adapters; backends without in-memory HF tensors): export
  ``weights/v{n}``, write the pending step, push, then mark the sessions TRAINED, clear
  the pending step, prune old exports and checkpoint when due;
- from memory (a :class:`~proxima.trainer.weight_push.MemoryWeightSink`, the broadcast
  sink, with a backend that is :class:`~proxima.trainer.backends.base.InMemoryWeights`):
  write the pending step (``exported`` false), push the tensors straight from memory, and
  only then export ``weights/v{n}`` on the compute thread, a due checkpoint in the same
  job, so no model work of the next step runs before both; the sessions are marked TRAINED
  and the pending step cleared after the export. The export is off the push's path and
  overlaps the next step's wait for data; the next push, a checkpoint and ``close`` wait
  for it first.

Model work runs on the trainer's one compute thread (:meth:`Publishing._compute`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from proxima.proxy.store import SessionStatus, Store
from proxima.trainer.backends.base import InMemoryWeights, PPOBackend
from proxima.trainer.config import TrainerConfig
from proxima.trainer.log import TrainLog
from proxima.trainer.recovery import settle_pending_step
from proxima.trainer.weight_push import MemoryWeightSink
from proxima.trainer.weights import (
    PendingStep,
    PushResult,
    TrainerState,
    WeightSink,
    clear_pending,
    export_weights,
    prune_weights,
    read_pending,
    save_checkpoint,
    weights_dir,
    write_pending,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Publishing:
    """Pushing a trained version and settling its step (the module docstring)."""

    cfg: TrainerConfig
    store: Store
    sink: WeightSink
    backend: PPOBackend
    state: TrainerState
    log: TrainLog
    adapter: str | None
    home: Path
    _executor: ThreadPoolExecutor
    _checkpointed_step: int
    _weights_ahead: bool

    def _init_publishing(self) -> None:
        """Whether pushes go from memory; no version awaits its export yet."""
        self._from_memory = (
            self.adapter is None
            and isinstance(self.sink, MemoryWeightSink)
            and isinstance(self.backend, InMemoryWeights)
        )
        self._unexported: int | None = None  # pushed from memory, step 7 not begun
        self._exporting: asyncio.Future[None] | None = None  # its export and step 7

    async def checkpoint(self) -> Path | None:
        """Save model, optimizer and state now (skipped while weights are ahead of the proxy)."""
        await self._exported()
        if self._weights_ahead:
            logger.warning("not checkpointing: trained weights were never pushed")
            return None
        state = self.state
        path = await self._compute(
            lambda: save_checkpoint(self.home, state, self.backend.state_dict())
        )
        self._checkpointed_step = state.step
        return path

    async def _settle_interrupted_push(self) -> None:
        """Rule 1 of ``proxima.trainer.weights`` for this run's own failed push."""
        pending = read_pending(self.home)
        assert pending is not None
        pushed_version = await self.store.current_policy_version(adapter=self.adapter)
        await settle_pending_step(self.store, self.cfg.output_dir, pushed_version, self.adapter)
        if pending.version == pushed_version:  # it landed: the weights in memory are served
            if not pending.exported:  # pushed from memory: the recovery rule needs its export
                await self._compute(self._export, pending.version)
            self.state = dataclasses.replace(
                self.state, version=pending.version, step=self.state.step + 1
            )
            self._weights_ahead = False

    def _export(self, version: int) -> Path:
        """Export the weights as ``version`` (on the compute thread)."""
        return export_weights(self.cfg.output_dir, version, self.backend.export_hf, self.adapter)

    async def _export_and_push(
        self, new_version: int, trained_ids: list[str]
    ) -> tuple[PushResult, float, float]:
        """Step 6: export the weights as ``new_version`` and push them (the pending step
        written first), or push them from memory (the export follows in step 7); the push's
        result, and the export and push seconds."""
        await self._exported()  # the previous version's step 7 is over
        t = time.monotonic()
        if self._from_memory:
            assert isinstance(self.sink, MemoryWeightSink)
            assert isinstance(self.backend, InMemoryWeights)
            pending = PendingStep(self.state.trainer_id, new_version, trained_ids, exported=False)
            write_pending(self.home, pending)
            push = await self.sink.push_from(
                version=new_version,
                path=weights_dir(self.cfg.output_dir, new_version).resolve(),
                source=self.backend.hf_tensors,
                export=lambda: self._compute(self._export, new_version),
            )
            self._weights_ahead = False
            if push.transport == "broadcast":  # a fallback to disk exported it first
                self._unexported = new_version
            return push, 0.0, time.monotonic() - t
        path = await self._compute(self._export, new_version)
        export_s = time.monotonic() - t
        write_pending(self.home, PendingStep(self.state.trainer_id, new_version, trained_ids))
        if self.adapter is None:
            push = await self.sink.push(version=new_version, path=path)
        else:
            push = await self.sink.push(version=new_version, path=path, adapter=self.adapter)
        push_s = time.monotonic() - t - export_s
        self._weights_ahead = False
        return push, export_s, push_s

    async def _consume(self, trained_ids: list[str], new_version: int) -> None:
        """Step 7: the sessions are TRAINED into ``new_version``, the pending step cleared, the
        state advanced, old versions pruned, and a checkpoint written when one is due.

        A version pushed from memory is exported first, in a task (the state advances now):
        the export is queued on the compute thread ahead of the next step's model work, and
        the rest follows it (:meth:`_exported` waits for it)."""
        if self._unexported == new_version:
            self._unexported = None
            state = self.state = dataclasses.replace(
                self.state, version=new_version, step=self.state.step + 1
            )
            due = bool(self.cfg.checkpoint_every and state.step % self.cfg.checkpoint_every == 0)
            # Queued on the compute thread now, ahead of any model work of the next step.
            job = asyncio.get_running_loop().run_in_executor(
                self._executor, functools.partial(self._export_job, state, due)
            )
            self._exporting = asyncio.ensure_future(self._after_export(job, trained_ids, state))
            return
        await self._mark(trained_ids, new_version)
        self.state = dataclasses.replace(self.state, version=new_version, step=self.state.step + 1)
        await self._after_push(new_version)

    def _export_job(self, state: TrainerState, checkpoint: bool) -> float:
        """Export ``state.version`` (pushed from memory), then a due checkpoint: one compute
        job, so the next step cannot train in between. Its seconds."""
        started = time.monotonic()
        self._export(state.version)
        if checkpoint:
            save_checkpoint(self.home, state, self.backend.state_dict())
            self._checkpointed_step = state.step
        return time.monotonic() - started

    async def _after_export(
        self, job: asyncio.Future[float], trained_ids: list[str], state: TrainerState
    ) -> None:
        """Step 7 of a version pushed from memory, once its export is written."""
        seconds = await job
        await self._mark(trained_ids, state.version)
        self.log.event("exported", version=state.version, seconds=round(seconds, 3))
        await self._after_push(state.version, checkpoint=False)

    async def _exported(self) -> None:
        """Wait for the export (and step 7) of a version pushed from memory, if one runs."""
        exporting, self._exporting = self._exporting, None
        if exporting is not None:
            await exporting

    async def _mark(self, trained_ids: list[str], new_version: int) -> None:
        """The sessions are TRAINED into ``new_version``; the pending step is cleared."""
        await self.store.mark_sessions(
            session_ids=trained_ids, status=SessionStatus.TRAINED, trained_version=new_version
        )
        clear_pending(self.home)

    async def _after_push(self, new_version: int, *, checkpoint: bool = True) -> None:
        """Old versions pruned; a checkpoint written when one is due (and ``checkpoint``)."""
        cfg = self.cfg
        prune_weights(
            cfg.output_dir, keep=cfg.keep_versions, served_version=new_version, adapter=self.adapter
        )
        if checkpoint and cfg.checkpoint_every and self.state.step % cfg.checkpoint_every == 0:
            await self.checkpoint()

    async def _compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run model work on the compute thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))
