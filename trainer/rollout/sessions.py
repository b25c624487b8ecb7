"""The rollout's calls to the proxy's session API (``/rl/sessions``), with the admin token.

Open a session (waiting out ``429`` + ``Retry-After`` while the proxy has no
staleness capacity), post an agent's rewards, finish the session. Each call that is lost
in transport or answered "not now" (502/503/504: the store or an engine restarting) is
sent again for ``window_s`` seconds (``[rollout] retry_window_s``; ``proxima.trainer.retry``),
so a rollout outlives a PostgreSQL restart. A proxy that cannot be reached within it or
answers an unexpected status is a :class:`~proxima.trainer.rollout.agents.RolloutError`
(the rollout cannot go on); a rejected reward is an
:class:`~proxima.trainer.rollout.agents.AgentError` (that run's session fails).

Opening is idempotent: each session is asked for with a fresh ``Idempotency-Key``,
and a request lost in transport (a timeout, a dropped connection, a 502/503/504
from something in between, or from the proxy) is sent again with the same key. The
proxy may have opened the session for the lost request; the repeat then answers
that session (with a new session key) instead of opening a second one, which
would stay OPEN forever and keep its group from ever being trained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Any

import httpx
from proxima.trainer.retry import (
    GATEWAY_STATUSES,
    RETRY_WINDOW_S,
    Backoff,
    retry_after,
    retryable_answer,
)
from proxima.trainer.rollout.agents import AgentError, AgentReward, RolloutError

logger = logging.getLogger(__name__)

OPEN_BACKOFF_S = 1.0
"""Wait before the second try of a lost ``POST /rl/sessions``; doubled before each further one
(up to ``proxima.trainer.retry.MAX_DELAY_S``)."""
_LOST_IN_TRANSPORT = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
REWARD_ALREADY_SET = "reward_already_set"


async def open_session(
    client: httpx.AsyncClient,
    stopping: asyncio.Event,
    on_wait: Callable[[float], None],
    *,
    group_id: str,
    data_id: str,
    metadata: dict[str, Any],
    adapter: str | None = None,
    window_s: float = RETRY_WINDOW_S,
    backoff_s: float = OPEN_BACKOFF_S,
) -> dict[str, Any] | None:
    """``POST /rl/sessions``, waiting out 429s (each wait reported to ``on_wait(seconds)``);
    ``None`` once ``stopping`` is set while waiting for capacity. With ``adapter`` the
    session is that LoRA adapter's (it generates with it and trains it); without, the
    base model's.

    Every request carries one ``Idempotency-Key``; one lost in transport or answered
    502/503/504 (the store restarting: ``Retry-After`` says how long) is sent again with
    it for ``window_s`` seconds of such failures in a row (waiting ``backoff_s``, doubled
    each time, or what ``Retry-After`` asks; ``stopping`` does not cut these short: the
    proxy may hold the session already, and only a repeat returns it), then ``RolloutError``.
    """
    body: dict[str, Any] = {"group_id": group_id, "data_id": data_id, "metadata": metadata}
    if adapter is not None:
        body["adapter"] = adapter
    headers = {"Idempotency-Key": f"rollout-{secrets.token_hex(16)}"}
    backoff = Backoff(window_s, first_s=backoff_s)
    lost = False  # the last try was lost in transport or answered "not now"
    while lost or not stopping.is_set():
        hint = None
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
                lost, backoff = False, Backoff(window_s, first_s=backoff_s)
                delay = _capacity_wait(resp)
                on_wait(delay)
                logger.debug("no capacity for a new session; waiting", extra={"retry_after": delay})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), timeout=delay)
                continue
            failure = f"answered {resp.status_code}: {resp.text[:500]}"
            if resp.status_code not in GATEWAY_STATUSES:
                raise RolloutError(f"POST /rl/sessions {failure}")
            hint = retry_after(resp)
        lost = True
        if not await backoff.wait("POST /rl/sessions (same Idempotency-Key)", failure, hint):
            raise RolloutError(
                f"cannot open a session at {client.base_url} ({backoff.tries} tries with one "
                f"Idempotency-Key in {window_s:g}s): {failure}"
            )
    return None


def _capacity_wait(response: httpx.Response) -> float:
    """How long a 429 of the staleness gate asks to wait (1 s when it does not say)."""
    wait = retry_after(response)
    return 1.0 if wait is None else wait


async def _post(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], window_s: float
) -> tuple[httpx.Response, bool]:
    """``POST path``, sent again while it is lost in transport or answered "not now"
    (``proxima.trainer.retry``) for ``window_s``; the answer, and whether a try before it
    was lost (the first may have landed). A transport error past the window is raised."""
    backoff = Backoff(window_s)
    lost = False
    while True:
        try:
            resp = await client.post(path, json=body)
        except httpx.TransportError as exc:
            if not await backoff.wait(f"POST {path}", repr(exc)):
                raise
        else:
            if not retryable_answer(resp):
                return resp, lost
            failure = f"answered {resp.status_code}: {resp.text[:300]}"
            if not await backoff.wait(f"POST {path}", failure, retry_after(resp)):
                return resp, lost
        lost = True


async def post_rewards(
    client: httpx.AsyncClient,
    session_id: str,
    reward: AgentReward,
    *,
    window_s: float = RETRY_WINDOW_S,
) -> None:
    """``POST /rl/sessions/{id}/reward`` per completion reward, then the final one; each
    retried like :func:`_post` (a reward is write-once: after a lost try, "already set" is
    that try having landed)."""
    posts = [{"reward": r, "completion_id": cid} for cid, r in reward.per_completion.items()]
    if reward.final is not None:
        posts.append({"reward": reward.final})
    for body in posts:
        resp, lost = await _post(client, f"/rl/sessions/{session_id}/reward", body, window_s)
        if lost and resp.status_code == 409 and _error_code(resp) == REWARD_ALREADY_SET:
            continue
        if 400 <= resp.status_code < 500:
            raise AgentError(f"reward {body} rejected ({resp.status_code}): {resp.text}")
        resp.raise_for_status()


def _error_code(response: httpx.Response) -> str | None:
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


async def finish_session(
    client: httpx.AsyncClient,
    session_id: str,
    status: str,
    *,
    window_s: float = RETRY_WINDOW_S,
) -> None:
    """``POST /rl/sessions/{id}/finish`` with ``status`` (finishing again is a no-op: it is
    retried like :func:`_post`)."""
    path = f"/rl/sessions/{session_id}/finish"
    try:
        resp, _ = await _post(client, path, {"status": status}, window_s)
    except httpx.TransportError as exc:
        raise RolloutError(f"finishing session {session_id} failed: {exc!r}") from exc
    if resp.status_code != 200:
        raise RolloutError(
            f"finishing session {session_id} answered {resp.status_code}: {resp.text}"
        )
