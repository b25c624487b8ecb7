"""Routing: which healthy backend serves a request.

Requests carrying a sticky key (the session) go to the healthy backend that rendezvous
hashing of the key over the healthy backends' URLs picks, so its prefix cache is reused;
every proxy replica computes the same choice without asking anyone, so a conversation whose
turns go through different replicas stays on one backend. Others go to the least-loaded
healthy backend. No backend is chosen while a weight update holds the gate (``wait_ready``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

from proxima.proxy.backends.errors import BackendUnavailable
from proxima.proxy.backends.members import Backend, PoolState


def rendezvous_score(key: str, url: str) -> int:
    """Highest-random-weight hashing: the backend with the top score serves ``key``.

    The same on every replica and across restarts (no per-process seed); when a
    backend leaves, only its keys move, spread over the others.
    """
    digest = hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Router:
    """Picks a backend for each request and counts the requests each one runs."""

    def __init__(self, state: PoolState) -> None:
        self._state = state

    async def wait_ready(self) -> None:
        """Block while a weight update is in progress."""
        await self._state.ready.wait()

    def choose(self, sticky_key: str | None = None) -> Backend:
        healthy = self._state.healthy_backends()
        if not healthy:
            raise BackendUnavailable("No healthy inference backend is available; retry shortly.")
        if sticky_key is not None and len(healthy) > 1:
            return max(healthy, key=lambda b: rendezvous_score(sticky_key, b.url))
        if sticky_key is not None:
            return healthy[0]
        return min(healthy, key=lambda b: b.in_flight)

    @contextmanager
    def lease(self, backend: Backend) -> Iterator[Backend]:
        backend.in_flight += 1
        try:
            yield backend
        finally:
            backend.in_flight -= 1
