"""``GroupCommit``: concurrent completions committed in shared transactions.

``GroupCommit.commit`` returns once its completions are committed (a response
never ends before its completion is durable), but concurrent callers share one
transaction (``Store.record_completions``): while a commit is in flight the
next ones queue up and go together. Under load that turns N commits into a few;
alone, a completion is committed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from proxima.proxy.store.errors import StoreUnavailable
from proxima.proxy.store.records import CompletionRecord
from proxima.proxy.store.store import Store

logger = logging.getLogger(__name__)

# A completion to commit, the record of its parent (if any), and who waits for it.
_Item = tuple[CompletionRecord, CompletionRecord | None, "asyncio.Future[None]"]


class GroupCommit:
    def __init__(self, store: Store, *, max_batch: int = 256):
        self.store = store
        self.max_batch = max_batch
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.commits = 0
        self.recorded = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="group-commit")

    async def close(self) -> None:
        if self._task is not None:
            # Drain: everything queued is committed before shutdown completes.
            while not self._queue.empty():
                await asyncio.sleep(0.01)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def commit(
        self, completions: list[CompletionRecord], *, parent: CompletionRecord | None = None
    ) -> None:
        """Commit ``completions``; returns when they are durable, raises if they are not.

        ``parent`` is the record of their ``parent_id`` (the store keeps what they add
        to it; without it, the store reads it).
        """
        loop = asyncio.get_running_loop()
        futures = []
        for c in completions:
            fut: asyncio.Future[None] = loop.create_future()
            self._queue.put_nowait((c, parent, fut))
            futures.append(fut)
        if len(futures) == 1:
            await futures[0]  # one choice, the common case: no gathering future
        else:
            await asyncio.gather(*futures)

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._commit(batch)

    async def _commit(self, batch: list[_Item]) -> None:
        try:
            await self.store.record_completions(
                completions=[c for c, _, _ in batch],
                parents={p.id: p for _, p, _ in batch if p is not None},
            )
        except Exception as exc:  # handed to the waiting request, which reports it
            if len(batch) == 1 or isinstance(exc, StoreUnavailable):
                # An outage fails the whole batch: retrying its records one by one would
                # only fail each again.
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                return
            # One bad record must not fail its neighbours: retry one by one.
            for item in batch:
                await self._commit([item])
            return
        self.commits += 1
        self.recorded += len(batch)
        for _, _, fut in batch:
            if not fut.done():
                fut.set_result(None)
