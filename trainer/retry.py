"""Retrying what may be retried: the trainer's and the rollout's calls to the proxy and the store.

A run must outlive a short outage: PostgreSQL restarting (the proxy answers 503 with
``Retry-After`` meanwhile, the trainer's own store reads raise ``StoreUnavailable``), an
embedded engine restarting (503 with ``Retry-After``), a proxy behind a balancer that drops a
connection. What is retried, for up to ``window_s`` seconds (``retry_window_s`` in the
trainer's ``[loop]`` and the run's ``[rollout]`` config, default :data:`RETRY_WINDOW_S`):

- an HTTP answer 502, 503 or 504 (a gateway's or the proxy's "not now"), and a 429 that
  says when to come back (``Retry-After``; a 429 without one is a refusal, not a pause);
- a transport error (``httpx.TransportError``: refused, reset, timed out);
- the store out of reach (``proxima.proxy.store.errors.is_outage``: ``StoreUnavailable``,
  or a driver's connection error).

Between tries :class:`Backoff` waits what ``Retry-After`` says, else 0.5 s doubled each try
up to :data:`MAX_DELAY_S`; past the window the last error is raised. Anything else (a 4xx,
a bug) is raised at once. Whether a call may be sent again at all is the caller's
judgement: every call retried here is idempotent or made so (an ``Idempotency-Key``, an
answer that says the first try landed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from email.utils import parsedate_to_datetime
from typing import TypeVar

import httpx
from proxima.proxy.store.errors import is_outage
from proxima.trainer.config import RETRY_WINDOW_S

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "RETRY_WINDOW_S",
    "Backoff",
    "retry_after",
    "retryable_answer",
    "retryable_error",
    "retrying",
]

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 5.0
GATEWAY_STATUSES = frozenset({502, 503, 504})


def retry_after(response: httpx.Response) -> float | None:
    """Seconds the ``Retry-After`` header asks for (a number or an HTTP date), None without
    one (or with one that is neither)."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def retryable_answer(response: httpx.Response) -> bool:
    """Whether ``response`` says "try again later": 502/503/504, or 429 with ``Retry-After``."""
    if response.status_code in GATEWAY_STATUSES:
        return True
    return response.status_code == 429 and retry_after(response) is not None


def retryable_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an outage that passes: a transport error or the store out of reach."""
    return isinstance(exc, httpx.TransportError) or is_outage(exc)


class Backoff:
    """The waits between the tries of one call, within ``window_s`` from its creation."""

    def __init__(self, window_s: float = RETRY_WINDOW_S, *, first_s: float | None = None) -> None:
        self.window_s = window_s
        self.deadline = time.monotonic() + window_s
        self.tries = 0
        self._next = FIRST_DELAY_S if first_s is None else first_s

    def delay(self, hint: float | None = None) -> float | None:
        """How long to wait before the next try (``hint``: the answer's ``Retry-After``),
        or None when the window is spent."""
        self.tries += 1
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        wait = self._next if hint is None else max(hint, 0.05)
        self._next = min(MAX_DELAY_S, self._next * 2)
        return min(wait, left)

    async def wait(self, what: str, failure: object, hint: float | None = None) -> bool:
        """Sleep before the next try of ``what`` (logged with ``failure``); False when the
        window is spent (the caller raises)."""
        delay = self.delay(hint)
        if delay is None:
            return False
        logger.warning(
            "%s failed, retrying in %.1fs: %s",
            what,
            delay,
            failure,
            extra={"try": self.tries, "retry_window_s": self.window_s},
        )
        await asyncio.sleep(delay)
        return True


async def retrying(
    call: Callable[[], Awaitable[T]],
    what: str,
    *,
    window_s: float = RETRY_WINDOW_S,
    retryable: Callable[[BaseException], bool] = retryable_error,
) -> T:
    """``await call()``, tried again on a ``retryable`` error until ``window_s`` has passed."""
    backoff = Backoff(window_s)
    while True:
        try:
            return await call()
        except Exception as exc:
            if not retryable(exc) or not await backoff.wait(what, repr(exc)):
                raise
