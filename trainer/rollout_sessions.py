"""The rollout's calls to the proxy's session API (``/rl/sessions``), with the admin token.

Open a session (waiting out ``429`` + ``Retry-After`` while the proxy has no
staleness capacity), post an agent's rewards, finish the session. A proxy
that cannot be reached or answers an unexpected status is a
:class:`~proxima.trainer.agents.RolloutError` (the rollout cannot go on); a
rejected reward is an :class:`~proxima.trainer.agents.AgentError` (that run's
session fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from proxima.trainer.agents import AgentError, AgentReward, RolloutError

logger = logging.getLogger(__name__)


def _retry_after(response: httpx.Response, default: float = 1.0) -> float:
    value = response.headers.get("Retry-After")
    if value is None:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return default


async def open_session(
    client: httpx.AsyncClient,
    stopping: asyncio.Event,
    on_wait: Callable[[float], None],
    *,
    group_id: str,
    data_id: str,
    metadata: dict[str, Any],
    adapter: str | None = None,
) -> dict[str, Any] | None:
    """``POST /rl/sessions``, waiting out 429s (each wait reported to ``on_wait(seconds)``);
    ``None`` once ``stopping`` is set. With ``adapter`` the session is that LoRA adapter's
    (it generates with it and trains it); without, the base model's."""
    body: dict[str, Any] = {"group_id": group_id, "data_id": data_id, "metadata": metadata}
    if adapter is not None:
        body["adapter"] = adapter
    while not stopping.is_set():
        try:
            resp = await client.post("/rl/sessions", json=body)
        except httpx.HTTPError as exc:
            raise RolloutError(f"cannot open a session at {client.base_url}: {exc!r}") from exc
        if resp.status_code == 429:
            delay = _retry_after(resp)
            on_wait(delay)
            logger.debug("no capacity for a new session; waiting", extra={"retry_after": delay})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=delay)
            continue
        if resp.status_code != 200:
            raise RolloutError(f"POST /rl/sessions answered {resp.status_code}: {resp.text}")
        return resp.json()
    return None


async def post_rewards(client: httpx.AsyncClient, session_id: str, reward: AgentReward) -> None:
    """``POST /rl/sessions/{id}/reward`` per completion reward, then the final one."""
    posts = [{"reward": r, "completion_id": cid} for cid, r in reward.per_completion.items()]
    if reward.final is not None:
        posts.append({"reward": reward.final})
    for body in posts:
        resp = await client.post(f"/rl/sessions/{session_id}/reward", json=body)
        if 400 <= resp.status_code < 500:
            raise AgentError(f"reward {body} rejected ({resp.status_code}): {resp.text}")
        resp.raise_for_status()


async def finish_session(client: httpx.AsyncClient, session_id: str, status: str) -> None:
    """``POST /rl/sessions/{id}/finish`` with ``status``."""
    resp = await client.post(f"/rl/sessions/{session_id}/finish", json={"status": status})
    if resp.status_code != 200:
        raise RolloutError(
            f"finishing session {session_id} answered {resp.status_code}: {resp.text}"
        )
