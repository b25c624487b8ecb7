"""Stop a non-streaming request's work when its client goes away.

A streaming response notices a disconnect by itself (Starlette cancels the
stream, the driver aborts the backend requests and records nothing). A
non-streaming route is not told; ``unless_disconnected`` makes it behave the
same: it watches the connection while ``work`` runs and cancels ``work`` when
the client disconnects, so the backend request is aborted and the
undelivered completion is not recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request
from proxima.proxy.errors import ClientDisconnected

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    # The body has been read: the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``await work``, or cancel it and raise ``ClientDisconnected`` if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected("The client disconnected before the response was ready.")
    return task.result()
