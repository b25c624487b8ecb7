"""The trainer's store: the proxy's ``Store``, whose calls the trainer makes retry an outage.

``proxima trainer`` reads and writes the trajectory store directly (claims, completions,
marks, versions). A PostgreSQL restart makes each of those raise ``StoreUnavailable`` for a
few seconds; :class:`RetryingStore` retries them (``proxima.trainer.retry``) for
``retry_window_s`` (``[loop] retry_window_s``), so a step waits the outage out instead of
ending the run.

Every call retried here may be sent again: reads, ``release_claims`` (a no-op the second
time), and ``mark_sessions``, which refuses sessions no longer CLAIMED: after a try whose
answer was lost, a refusal whose sessions all carry the mark asked for is the first try
having landed, and is a success. ``claim_groups`` is not retried here: a claim whose answer
was lost may have taken sessions, which only the claimer can tell from the ones it held
(``proxima.trainer.batch_claims`` retries it and adopts them, from ``claimed_sessions``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from proxima.proxy.store import CompletionRecord, SessionRecord, SessionStatus, Store
from proxima.proxy.store.errors import Conflict
from proxima.proxy.store.records import PolicyVersionRecord
from proxima.trainer.retry import RETRY_WINDOW_S, Backoff, retryable_error, retrying

T = TypeVar("T")


class RetryingStore(Store):
    """A ``Store`` whose trainer-side calls retry an outage for ``retry_window_s`` seconds."""

    retry_window_s: float = RETRY_WINDOW_S

    @classmethod
    async def open_retrying(cls, url: str, *, window_s: float = RETRY_WINDOW_S) -> RetryingStore:
        """``Store.open`` (retried while the database is out of reach) as a ``RetryingStore``."""

        async def open_once() -> RetryingStore:
            store = await cls.open(url)
            assert isinstance(store, RetryingStore)
            return store

        store = await retrying(open_once, "opening the store", window_s=window_s)
        store.retry_window_s = window_s
        return store

    async def _retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        return await retrying(call, what, window_s=self.retry_window_s)

    async def list_completions(self, *, session_id: str) -> list[CompletionRecord]:
        parent = super().list_completions
        return await self._retry(
            "reading a session's completions", lambda: parent(session_id=session_id)
        )

    async def get_session(self, *, session_id: str) -> SessionRecord | None:
        parent = super().get_session
        return await self._retry("reading a session", lambda: parent(session_id=session_id))

    async def current_policy_version(self, *, adapter: str | None = None) -> int:
        parent = super().current_policy_version
        return await self._retry("reading the policy version", lambda: parent(adapter=adapter))

    async def list_policy_versions(
        self, *, adapter: str | None = None
    ) -> list[PolicyVersionRecord]:
        parent = super().list_policy_versions
        return await self._retry("reading the policy versions", lambda: parent(adapter=adapter))

    async def claimed_sessions(self, *, trainer_id: str) -> list[SessionRecord]:
        parent = super().claimed_sessions
        return await self._retry("reading the claims", lambda: parent(trainer_id=trainer_id))

    async def release_claims(self, *, trainer_id: str) -> int:
        parent = super().release_claims
        return await self._retry("releasing the claims", lambda: parent(trainer_id=trainer_id))

    async def mark_sessions(
        self,
        *,
        session_ids: Sequence[str],
        status: SessionStatus,
        trained_version: int | None = None,
    ) -> None:
        backoff = Backoff(self.retry_window_s)
        lost = False  # a try failed with the database out of reach: it may have landed
        while True:
            try:
                await super().mark_sessions(
                    session_ids=session_ids, status=status, trained_version=trained_version
                )
                return
            except Conflict:
                if lost and await self._marked(session_ids, status, trained_version):
                    return
                raise
            except Exception as exc:
                if not retryable_error(exc) or not await backoff.wait(
                    "marking sessions", repr(exc)
                ):
                    raise
                lost = True

    async def _marked(
        self, session_ids: Sequence[str], status: SessionStatus, trained_version: int | None
    ) -> bool:
        """Whether every session carries ``status`` (and ``trained_version``) already."""
        sessions = await asyncio.gather(*(self.get_session(session_id=i) for i in session_ids))
        return all(_carries(s, status, trained_version) for s in sessions)


def _carries(
    session: SessionRecord | None, status: SessionStatus, trained_version: int | None
) -> bool:
    return (
        session is not None
        and session.status == status
        and (trained_version is None or session.trained_version == trained_version)
    )
