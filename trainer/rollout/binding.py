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
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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


def _apply(request: Any) -> None:
    binding = _current.get()
    if binding is not None and binding.matches(str(request.url)):
        request.headers["Authorization"] = f"Bearer {binding.api_key}"


def _wrap_sync(send: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(send)
    def send_bound(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _apply(request)
        return send(self, request, *args, **kwargs)

    setattr(send_bound, _PATCHED_ATTR, True)
    return send_bound


def _wrap_async(send: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(send)
    async def send_bound(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _apply(request)
        return await send(self, request, *args, **kwargs)

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
                    cls.send = wrap(cls.send)
                    logger.debug(
                        "session binding hook installed", extra={"client": f"{name}.{cls_name}"}
                    )
            hooked.append(name)
    return hooked
