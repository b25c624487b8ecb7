"""A trainer stand-in run in a separate OS process by the claim tests."""

from __future__ import annotations

import asyncio
from typing import Any

from proxima.proxy.store import Store


async def _claim_until_empty(url: str, trainer_id: str, barrier: Any, batch: int) -> list[str]:
    store = await Store.open(url)
    try:
        barrier.wait(timeout=60)  # both processes start claiming together
        claimed: list[str] = []
        while sessions := await store.claim_sessions(limit=batch, trainer_id=trainer_id):
            claimed.extend(s.id for s in sessions)
            await asyncio.sleep(0.01)  # let the other trainer in between batches
        return claimed
    finally:
        await store.close()


def claim_until_empty(url: str, trainer_id: str, barrier: Any, batch: int, results: Any) -> None:
    """Process target: claim batches until none is left; put ``(trainer_id, ids)`` on ``results``."""
    results.put((trainer_id, asyncio.run(_claim_until_empty(url, trainer_id, barrier, batch))))
