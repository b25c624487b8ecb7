"""Bind an unmodified agent's HTTP calls to its RL session, in-process.

The rollout controller runs many agents concurrently in one process, each
against its own proxy session. The agent code is not ours: it builds
``OpenAI(base_url=..., api_key="anything")`` or ``ChatOpenAI(...)`` wherever it
likes. Two pieces make its requests carry the right session key anyway:

- a :class:`contextvars.ContextVar` holding the current run's
  :class:`SessionBinding` (the controller sets it around each agent call;
  ``asyncio`` tasks and ``asyncio.to_thread`` copy the context, so it follows
  the agent into its own tasks and worker threads);
- a hook installed once on the HTTP clients (``Client.send`` and
  ``AsyncClient.send`` of ``httpx`` and of ``httpx2``, the fork that recent
  OpenAI SDKs use) that, for a request whose URL starts with the bound
  session's ``/v1`` base, replaces the ``Authorization`` header with
  ``Bearer <session key>``.

Requests to any other host or path are sent untouched, and outside a bound
context the hook does nothing, so the patch is safe to leave installed.

A bound request is also sent again, for the binding's ``retry_window_s``, while the
proxy answers "not now" (502/503/504, or 429 with ``Retry-After``: its store or every
engine restarting, ``proxima.trainer.retry``) or cannot be connected to, so that an
agent run outlives a short outage even when the agent's SDK retries nothing
(``max_retries=0``). Other answers, and a request whose body cannot be read again, are
handed to the agent as they are.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from proxima.trainer.retry import Backoff, retry_after, retryable_answer

logger = logging.getLogger(__name__)

# httpx and its fork httpx2 share the Client/AsyncClient/Request API.
HTTP_CLIENT_MODULES: tuple[str, ...] = ("httpx", "httpx2")
_PATCHED_ATTR = "__proxima_session_binding__"


@dataclass(frozen=True, slots=True)
class SessionBinding:
    """The session an agent run belongs to.

    ``prefixes`` are the URL prefixes whose requests get the session key: the
    session's ``base_url`` as the proxy returned it, plus any other spelling of
    the same ``/v1`` base the agent may have been given (for example the
    controller's ``proxy_url + "/v1"`` when the proxy announces another host).
    """

    session_id: str
    api_key: str
    base_url: str
    prefixes: tuple[str, ...] = ()
    retry_window_s: float = 0.0  # how long a "not now" of the proxy is retried (0: never)

    def matches(self, url: str) -> bool:
        """Whether a request to ``url`` goes to this session's ``/v1`` API."""
        return any(_under(url, prefix) for prefix in (self.base_url, *self.prefixes))


def _under(url: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/")
    return url == prefix or url.startswith(prefix + "/") or url.startswith(prefix + "?")


_current: contextvars.ContextVar[SessionBinding | None] = contextvars.ContextVar(
    "proxima_session_binding", default=None
)
_install_lock = threading.Lock()


def current_binding() -> SessionBinding | None:
    """The session bound to the running context, if any."""
    return _current.get()


@contextmanager
def bind_session(binding: SessionBinding) -> Iterator[SessionBinding]:
    """Bind ``binding`` for the code run inside the ``with`` block (this context only)."""
    install_http_hooks()
    token = _current.set(binding)
    try:
        yield binding
    finally:
        _current.reset(token)


def bound_context(binding: SessionBinding) -> contextvars.Context:
    """A copy of the current context with ``binding`` bound, for ``create_task(context=...)``."""
    install_http_hooks()
    ctx = contextvars.copy_context()
    ctx.run(_current.set, binding)
    return ctx


def _apply(request: Any) -> SessionBinding | None:
    """Put the bound session's key on ``request``; the binding when the request is its."""
    binding = _current.get()
    if binding is None or not binding.matches(str(request.url)):
        return None
    request.headers["Authorization"] = f"Bearer {binding.api_key}"
    return binding


def _retries(binding: SessionBinding | None, request: Any) -> Backoff | None:
    """The backoff of a bound request that may be sent again (its body is in memory)."""
    if binding is None or binding.retry_window_s <= 0:
        return None
    try:
        request.content  # noqa: B018 - raises for a streamed body not read yet
    except Exception:  # noqa: BLE001 - httpx's and httpx2's RequestNotRead alike
        return None
    return Backoff(binding.retry_window_s)


def _not_now(response: Any, backoff: Backoff) -> float | None:
    """How long to wait before sending again a request answered ``response``; None to
    hand the answer over."""
    if not retryable_answer(response):
        return None
    delay = backoff.delay(retry_after(response))
    if delay is not None:
        logger.info(
            "the proxy answered %s to an agent's request; sending it again in %.1fs",
            response.status_code,
            delay,
        )
    return delay


def _wrap_sync(send: Callable[..., Any], connect_error: type[Exception]) -> Callable[..., Any]:
    @functools.wraps(send)
    def send_bound(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        backoff = _retries(_apply(request), request)
        while True:
            try:
                response = send(self, request, *args, **kwargs)
            except connect_error:
                if backoff is None or (delay := backoff.delay()) is None:
                    raise
                time.sleep(delay)
                continue
            if backoff is None or (delay := _not_now(response, backoff)) is None:
                return response
            response.close()
            time.sleep(delay)

    setattr(send_bound, _PATCHED_ATTR, True)
    return send_bound


def _wrap_async(send: Callable[..., Any], connect_error: type[Exception]) -> Callable[..., Any]:
    @functools.wraps(send)
    async def send_bound(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        backoff = _retries(_apply(request), request)
        while True:
            try:
                response = await send(self, request, *args, **kwargs)
            except connect_error:
                if backoff is None or (delay := backoff.delay()) is None:
                    raise
                await asyncio.sleep(delay)
                continue
            if backoff is None or (delay := _not_now(response, backoff)) is None:
                return response
            await response.aclose()
            await asyncio.sleep(delay)

    setattr(send_bound, _PATCHED_ATTR, True)
    return send_bound


def install_http_hooks() -> list[str]:
    """Patch ``Client.send``/``AsyncClient.send`` of every installed httpx flavour, once.

    Idempotent and thread-safe. Returns the modules that carry the hook.
    """
    hooked: list[str] = []
    with _install_lock:
        for name in HTTP_CLIENT_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for cls_name, wrap in (("Client", _wrap_sync), ("AsyncClient", _wrap_async)):
                cls = getattr(module, cls_name)
                if not getattr(cls.send, _PATCHED_ATTR, False):
                    cls.send = wrap(cls.send, module.ConnectError)
                    logger.debug(
                        "session binding hook installed", extra={"client": f"{name}.{cls_name}"}
                    )
            hooked.append(name)
    return hooked
