"""The rollout's calls to the proxy's session API (``/rl/sessions``), with the admin token.

Open a session (waiting out ``429`` + ``Retry-After`` while the proxy has no
staleness capacity), post an agent's rewards, finish the session. A proxy
that cannot be reached or answers an unexpected status is a
:class:`~proxima.trainer.rollout.agents.RolloutError` (the rollout cannot go on); a
rejected reward is an :class:`~proxima.trainer.rollout.agents.AgentError` (that run's
session fails).

Opening is idempotent: each session is asked for with a fresh ``Idempotency-Key``,
and a request lost in transport (a timeout, a dropped connection, a 502/503/504
from something in between) is sent again with the same key a few times. The
proxy may have opened the session for the lost request; the repeat then answers
that session (with a new session key) instead of opening a second one, which
would stay OPEN forever and keep its group from ever being trained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from proxima.trainer.rollout.agents import AgentError, AgentReward, RolloutError

logger = logging.getLogger(__name__)

OPEN_ATTEMPTS = 4
"""Tries of one ``POST /rl/sessions`` lost in transport (same key) before the rollout stops."""
OPEN_BACKOFF_S = 1.0
"""Wait before the second try; doubled before each further one (1, 2, 4 s)."""
_LOST_IN_TRANSPORT = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
_GATEWAY_STATUSES = frozenset({502, 503, 504})


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
    attempts: int = OPEN_ATTEMPTS,
    backoff_s: float = OPEN_BACKOFF_S,
) -> dict[str, Any] | None:
    """``POST /rl/sessions``, waiting out 429s (each wait reported to ``on_wait(seconds)``);
    ``None`` once ``stopping`` is set while waiting for capacity. With ``adapter`` the
    session is that LoRA adapter's (it generates with it and trains it); without, the
    base model's.

    Every request carries one ``Idempotency-Key``; one lost in transport or answered
    502/503/504 is sent again with it, ``attempts`` tries in a row at most (waiting
    ``backoff_s``, doubled each time; ``stopping`` does not cut these short: the proxy
    may hold the session already, and only a repeat returns it), then ``RolloutError``.
    """
    body: dict[str, Any] = {"group_id": group_id, "data_id": data_id, "metadata": metadata}
    if adapter is not None:
        body["adapter"] = adapter
    headers = {"Idempotency-Key": f"rollout-{secrets.token_hex(16)}"}
    lost = 0  # tries in a row lost in transport
    while lost or not stopping.is_set():
        try:
            resp = await client.post("/rl/sessions", json=body, headers=headers)
        except _LOST_IN_TRANSPORT as exc:
            failure = repr(exc)
        except httpx.HTTPError as exc:
            raise RolloutError(f"cannot open a session at {client.base_url}: {exc!r}") from exc
        else:
            if resp.status_code == 200:
                opened: dict[str, Any] = resp.json()
                return opened
            if resp.status_code == 429:
                lost = 0
                delay = _retry_after(resp)
                on_wait(delay)
                logger.debug("no capacity for a new session; waiting", extra={"retry_after": delay})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), timeout=delay)
                continue
            failure = f"answered {resp.status_code}: {resp.text[:500]}"
            if resp.status_code not in _GATEWAY_STATUSES:
                raise RolloutError(f"POST /rl/sessions {failure}")
        lost += 1
        if lost >= attempts:
            raise RolloutError(
                f"cannot open a session at {client.base_url} ({lost} tries with one "
                f"Idempotency-Key): {failure}"
            )
        delay = backoff_s * 2 ** (lost - 1)
        logger.warning(
            "POST /rl/sessions lost; sending it again with the same Idempotency-Key",
            extra={"attempt": lost + 1, "delay_s": delay, "error": failure},
        )
        await asyncio.sleep(delay)
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
