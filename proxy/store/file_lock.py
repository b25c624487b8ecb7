"""A lock held across the processes of one host: an exclusive ``flock`` on a file.

The publish lock of ``proxima serve --workers N`` on one SQLite file (PostgreSQL has its
advisory locks): one weight push at a time among the workers. The kernel frees the lock
when its holder closes the file or dies, so a crashed worker never leaves it taken. The
wait polls (``poll_s``) instead of blocking a thread, so a cancelled waiter leaves nothing
behind.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

POLL_S = 0.02


def sqlite_lock_path(database: str | None) -> str:
    """The lock file beside a SQLite database file ``database``."""
    if not database or database == ":memory:":
        raise ValueError("an in-memory SQLite database is one process's: it has no lock file")
    return f"{database}-publish.lock"


@asynccontextmanager
async def file_lock(path: str, *, poll_s: float = POLL_S) -> AsyncIterator[None]:
    """Hold the exclusive lock on ``path`` (created if missing) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(poll_s)
        yield
    finally:
        os.close(fd)  # frees the lock
