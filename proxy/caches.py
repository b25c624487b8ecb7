"""The proxy's per-process caches in front of the store, one per thing held.

- ``PrincipalCache``: who holds a key (key hash -> ``Principal``), so a turn's
  caller costs no database read. Entries expire after ``ttl`` seconds, which
  bounds how long another process's change (a revoked key) goes unseen.
- ``HistoryCache``: each open session's completions, so a turn's prompt is
  built without reading the conversation back. Completions this process
  commits are appended as they are committed.

A session this process sees closed is forgotten by both (``forget_session``),
so its next request reads its key and its status from the store.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from proxima.proxy.auth import Principal
from proxima.proxy.store.records import CompletionRecord


class PrincipalCache:
    """Key hash -> the ``Principal`` holding that key, for ``ttl`` seconds."""

    def __init__(self, *, ttl: float = 30.0, capacity: int = 50_000):
        self.ttl = ttl
        self.capacity = capacity
        self._principals: OrderedDict[str, tuple[float, Principal]] = OrderedDict()
        self._key_of_session: dict[str, str] = {}

    def get(self, key_hash: str) -> Principal | None:
        entry = self._principals.get(key_hash)
        if entry is None:
            return None
        expires, principal = entry
        if expires < time.monotonic():
            del self._principals[key_hash]
            return None
        return principal

    def remember(self, key_hash: str, principal: Principal) -> None:
        self._principals[key_hash] = (time.monotonic() + self.ttl, principal)
        self._principals.move_to_end(key_hash)
        if principal.session is not None:
            self._key_of_session[principal.session.id] = key_hash
        while len(self._principals) > self.capacity:
            _, (_, old) = self._principals.popitem(last=False)
            if old.session is not None:
                self._key_of_session.pop(old.session.id, None)

    def forget_session(self, session_id: str) -> None:
        """Drop the principal of ``session_id``'s own key (if cached)."""
        key_hash = self._key_of_session.pop(session_id, None)
        if key_hash is not None:
            self._principals.pop(key_hash, None)


class HistoryCache:
    """Session id -> its completions in the order they were recorded."""

    def __init__(self, *, capacity: int = 50_000):
        self.capacity = capacity
        self._histories: OrderedDict[str, list[CompletionRecord]] = OrderedDict()

    def get(self, session_id: str) -> list[CompletionRecord] | None:
        history = self._histories.get(session_id)
        if history is not None:
            self._histories.move_to_end(session_id)
        return history

    def remember(self, session_id: str, completions: list[CompletionRecord]) -> None:
        self._histories[session_id] = list(completions)
        while len(self._histories) > self.capacity:
            self._histories.popitem(last=False)

    def append(self, completions: list[CompletionRecord]) -> None:
        """Add just-committed completions to the histories this cache holds."""
        for c in completions:
            history = self._histories.get(c.session_id)
            if history is not None:
                history.append(c)

    def forget_session(self, session_id: str) -> None:
        self._histories.pop(session_id, None)
