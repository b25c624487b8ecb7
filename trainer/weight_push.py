"""The push: a new weight version made the one the proxy serves.

:class:`WeightSink` is where a trainer's new versions go; :class:`ProxyWeightSink` is the
proxy's ``POST /admin/weights`` (the backends load the version from disk,
``proxima.trainer.weights``'s layout), answered with a :class:`PushResult` or raised as a
:class:`WeightPushError`. ``proxima.trainer.weights`` re-exports all four. A sink that can
also push straight from the trainer's memory is a :class:`MemoryWeightSink` (the broadcast
sink, ``proxima.trainer.weight_broadcast``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import httpx
from proxima.trainer.retry import RETRY_WINDOW_S, Backoff, retry_after, retryable_answer

logger = logging.getLogger(__name__)


class WeightPushError(RuntimeError):
    """The proxy did not take a new weight version (the message has its answer)."""


@dataclass(frozen=True)
class PushResult:
    """A weight version the proxy now serves."""

    version: int
    path: str
    proxy_seconds: float  # the proxy's own time to interrupt, load everywhere and resume
    http_seconds: float  # wall time of the request(s), as the trainer saw it
    transport: Literal["disk", "broadcast"] = "disk"  # how the weights reached the backends
    # Where a broadcast push's time went on the trainer (seconds opening the group, filling
    # buckets, on the wire, waiting for a bucket to fill; the bucket count); None: disk.
    breakdown: dict[str, float] | None = None


class WeightSink(Protocol):
    """Where new weight versions go (the proxy, in production)."""

    async def push(self, *, version: int, path: Path, adapter: str | None = None) -> PushResult:
        """Make ``version`` (HF directory ``path``; with ``adapter``, that adapter's peft
        directory) the served version of the policy, or raise."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


@runtime_checkable
class MemoryWeightSink(Protocol):
    """A sink that pushes full weights straight from the trainer's memory."""

    async def push_from(
        self,
        *,
        version: int,
        path: Path,
        source: Callable[[], Iterable[tuple[str, Any]]],
        export: Callable[[], Awaitable[Path]],
    ) -> PushResult:
        """Make ``version`` the served one from ``source`` (the model's tensors by HF name),
        writing nothing; ``path`` is where the version will be exported (recorded as its).
        A push that falls back to disk first calls ``export()`` (it writes ``path``) and
        answers with ``transport`` "disk"."""
        ...


class ProxyWeightSink:
    """``POST {proxy}/admin/weights {version, path}`` with the admin token.

    An adapter's push adds ``"adapter": name`` to the body: ``path`` is then a
    peft directory and ``version`` that adapter's next version; the proxy
    loads it beside the other policies and only interrupts that adapter's
    generations.

    ``proxy_url`` is one proxy, a fleet's load balancer, or several replicas
    (comma-separated). Replicas on one database share the pushed version: a
    push goes through one replica (the first that answers; a transport error
    moves to the next), and the others follow it through the store within a
    second; the push then waits (``confirm_s``) until every listed replica
    reports the version, warning about any that does not.

    Transport errors (including a timeout; the next URL is tried) and answers that say "not
    now" (502/503/504, 429 with ``Retry-After``: the store restarting, every engine
    restarting) are retried for ``retry_window_s`` (``proxima.trainer.retry``); a 409 answer
    is success if the proxy already serves ``version`` (an earlier attempt landed) and an
    error otherwise (another trainer is pushing).
    """

    def __init__(
        self,
        proxy_url: str,
        *,
        admin_token: str | None,
        timeout_s: float = 600.0,
        confirm_s: float = 10.0,
        retry_window_s: float = RETRY_WINDOW_S,
    ) -> None:
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.proxy_urls = [u.strip().rstrip("/") for u in proxy_url.split(",") if u.strip()]
        if not self.proxy_urls:
            raise ValueError("ProxyWeightSink needs a proxy URL")
        self.proxy_url = self.proxy_urls[0]
        self.confirm_s = confirm_s
        self.retry_window_s = retry_window_s
        self._client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0)
        )

    async def push(self, *, version: int, path: Path, adapter: str | None = None) -> PushResult:
        """Push ``version`` and wait until every backend of the proxy loaded it."""
        started = time.monotonic()
        body: dict[str, Any] = {"version": version, "path": str(path)}
        if adapter is not None:
            body["adapter"] = adapter
        urls = self.proxy_urls
        backoff = Backoff(self.retry_window_s)
        attempt = 0
        while True:
            url = urls[attempt % len(urls)]
            attempt += 1
            try:
                resp = await self._client.post(url + "/admin/weights", json=body)
            except httpx.TransportError as exc:
                # Every URL failed this round: back off (a transport error moves to the next).
                if attempt % len(urls) == 0 and not await backoff.wait(
                    f"weight push to {url}", repr(exc)
                ):
                    raise WeightPushError(
                        f"POST /admin/weights failed {attempt} times on {', '.join(urls)} "
                        f"within {self.retry_window_s:.0f}s: {exc!r}"
                    ) from exc
                continue
            if resp.status_code == 200:
                answer = resp.json()
                if adapter is None:  # replicas report the base's version on /health
                    await self.confirm(version, pushed_to=url)
                return PushResult(
                    version=version,
                    path=str(path),
                    proxy_seconds=float(answer.get("seconds", 0.0)),
                    http_seconds=time.monotonic() - started,
                )
            if resp.status_code == 409:
                served = await self.served_version(url, adapter=adapter)
                if served == version:  # an earlier try landed (its answer was lost)
                    return PushResult(version, str(path), 0.0, time.monotonic() - started)
                whose = "" if adapter is None else f" of adapter {adapter}"
                raise WeightPushError(
                    f"the proxy refused version {version}{whose}: it serves version {served}; is "
                    "another trainer pushing to this proxy?"
                )
            failure = f"POST {url}/admin/weights answered {resp.status_code}: {resp.text}"
            if not retryable_answer(resp) or not await backoff.wait(
                "weight push", failure[:300], retry_after(resp)
            ):
                raise WeightPushError(failure)
            attempt -= 1  # a "not now" is asked again of the same URL

    async def confirm(self, version: int, *, pushed_to: str) -> None:
        """Wait until every other listed replica serves ``version`` (they follow the store)."""
        waiting = [u for u in self.proxy_urls if u != pushed_to]
        deadline = time.monotonic() + self.confirm_s
        while waiting and time.monotonic() < deadline:
            answers = await asyncio.gather(
                *(self.served_version(u) for u in waiting), return_exceptions=True
            )
            waiting = [u for u, v in zip(waiting, answers, strict=True) if v != version]
            if waiting:
                await asyncio.sleep(0.05)
        if waiting:
            logger.warning(
                "version %s was pushed through %s, but %s did not report it within %.0fs "
                "(are they on the same database?)",
                version,
                pushed_to,
                ", ".join(waiting),
                self.confirm_s,
            )

    async def served_version(self, url: str | None = None, *, adapter: str | None = None) -> int:
        """The version ``GET /health`` reports (of ``url``, default the first proxy URL).

        An adapter's is in ``adapters``: ``{name: version}`` (-1 when the proxy lists none).
        """
        resp = await self._client.get((url or self.proxy_url) + "/health")
        resp.raise_for_status()
        answer = resp.json()
        if adapter is None:
            return int(answer["version"])
        return int((answer.get("adapters") or {}).get(adapter, -1))

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()
