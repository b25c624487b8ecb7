"""Group commit of completions, and the hot-path caches in front of the store.

``CompletionRecorder.record`` returns once the completion is committed (a
response never ends before its completion is durable), but concurrent
completions share one transaction: while a commit is in flight the next ones
queue up and go together. Under load that turns N commits into a few; alone,
a completion is committed at once.

``SessionCache`` keeps, per process, who holds a key (principal) and each
open session's completions, so a turn of a conversation costs no database
read. Entries are invalidated when this process finishes a session or
records a completion; principals expire after ``ttl`` seconds, which bounds
how long another process's change (a revoked key) can go unseen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any

from proxima.proxy.store.records import CompletionRecord
from proxima.proxy.store.store import Store

logger = logging.getLogger(__name__)

# A completion to commit, the record of its parent (if any), and who waits for it.
_Item = tuple[CompletionRecord, CompletionRecord | None, "asyncio.Future[None]"]


class CompletionRecorder:
    def __init__(self, store: Store, *, max_batch: int = 256):
        self.store = store
        self.max_batch = max_batch
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.commits = 0
        self.recorded = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="completion-recorder")

    async def close(self) -> None:
        if self._task is not None:
            # Drain: everything queued is committed before shutdown completes.
            while not self._queue.empty():
                await asyncio.sleep(0.01)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def record(
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
            if len(batch) == 1:
                fut = batch[0][2]
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


class SessionCache:
    def __init__(self, *, ttl: float = 30.0, capacity: int = 50_000):
        self.ttl = ttl
        self.capacity = capacity
        self._principals: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self._histories: OrderedDict[str, list[CompletionRecord]] = OrderedDict()
        self._keys_of_session: dict[str, str] = {}

    def principal(self, key_hash: str) -> Any | None:
        entry = self._principals.get(key_hash)
        if entry is None:
            return None
        expires, principal = entry
        if expires < time.monotonic():
            del self._principals[key_hash]
            return None
        return principal

    def remember_principal(self, key_hash: str, principal: Any) -> None:
        self._principals[key_hash] = (time.monotonic() + self.ttl, principal)
        self._principals.move_to_end(key_hash)
        session = getattr(principal, "session", None)
        if session is not None:
            self._keys_of_session[session.id] = key_hash
        while len(self._principals) > self.capacity:
            _, (_, old) = self._principals.popitem(last=False)
            old_session = getattr(old, "session", None)
            if old_session is not None:
                self._keys_of_session.pop(old_session.id, None)

    def remember_new_session(self, key_hash: str, principal: Any) -> None:
        """A session just created here: its key and its (empty) history need no read."""
        self.remember_principal(key_hash, principal)
        self.remember_history(principal.session.id, [])

    def forget_session(self, session_id: str) -> None:
        key_hash = self._keys_of_session.pop(session_id, None)
        if key_hash is not None:
            self._principals.pop(key_hash, None)
        self._histories.pop(session_id, None)

    def history(self, session_id: str) -> list[CompletionRecord] | None:
        history = self._histories.get(session_id)
        if history is not None:
            self._histories.move_to_end(session_id)
        return history

    def remember_history(self, session_id: str, completions: list[CompletionRecord]) -> None:
        self._histories[session_id] = list(completions)
        while len(self._histories) > self.capacity:
            self._histories.popitem(last=False)

    def add_completions(self, completions: list[CompletionRecord]) -> None:
        for c in completions:
            history = self._histories.get(c.session_id)
            if history is not None:
                history.append(c)
