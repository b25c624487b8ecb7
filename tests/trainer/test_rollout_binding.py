"""In-process session binding: the httpx hook and the context variable (no server needed).

Requests go to an ``httpx.MockTransport`` that records the ``Authorization``
header the proxy would have seen.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from typing import Any

import pytest
from proxima.trainer.rollout.binding import (
    HTTP_CLIENT_MODULES,
    SessionBinding,
    bind_session,
    bound_context,
    current_binding,
    install_http_hooks,
)

BASE = "http://127.0.0.1:8000/v1"
BINDING = SessionBinding(
    session_id="s1", api_key="sk-sess-1", base_url=BASE, prefixes=("http://localhost:8000/v1",)
)
INSTALLED = [m for m in HTTP_CLIENT_MODULES if importlib.util.find_spec(m) is not None]


def recording_transport(module: Any, seen: list[tuple[str, str | None]]) -> Any:
    def handler(request: Any) -> Any:
        seen.append((str(request.url), request.headers.get("Authorization")))
        return module.Response(200, json={})

    return module.MockTransport(handler)


def test_matches_only_the_v1_api_of_the_proxy() -> None:
    assert BINDING.matches(BASE) and BINDING.matches(BASE + "/chat/completions")
    assert BINDING.matches(BASE + "?x=1") and BINDING.matches("http://localhost:8000/v1/models")
    assert not BINDING.matches("http://127.0.0.1:8000/v10/models")
    assert not BINDING.matches("http://127.0.0.1:8000/rl/sessions")
    assert not BINDING.matches("https://api.openai.com/v1/chat/completions")


@pytest.mark.parametrize("name", INSTALLED)
def test_sync_client_requests_carry_the_bound_key(name: str) -> None:
    module = importlib.import_module(name)
    seen: list[tuple[str, str | None]] = []
    headers = {"Authorization": "Bearer placeholder"}
    with module.Client(transport=recording_transport(module, seen), headers=headers) as client:
        client.post(BASE + "/chat/completions", json={})  # unbound: untouched
        with bind_session(BINDING):
            assert current_binding() is BINDING
            client.post(BASE + "/chat/completions", json={})
            client.get("http://localhost:8000/v1/models")
            client.get("http://127.0.0.1:8000/rl/sessions/s1")  # not the /v1 API
            client.get("http://elsewhere.test/v1/models")  # another host
        assert current_binding() is None
    assert [auth for _, auth in seen] == [
        "Bearer placeholder",
        "Bearer sk-sess-1",
        "Bearer sk-sess-1",
        "Bearer placeholder",
        "Bearer placeholder",
    ]


@pytest.mark.parametrize("name", INSTALLED)
async def test_async_client_tasks_and_threads_inherit_the_binding(name: str) -> None:
    module = importlib.import_module(name)
    seen: list[tuple[str, str | None]] = []
    other = SessionBinding(session_id="s2", api_key="sk-sess-2", base_url=BASE)

    async def agent(tag: str) -> None:
        async with module.AsyncClient(transport=recording_transport(module, seen)) as client:
            await client.get(f"{BASE}/models?agent={tag}")
            # A task the agent starts itself, and a worker thread (asyncio.to_thread copies context).
            await asyncio.create_task(client.get(f"{BASE}/models?agent={tag}-task"))

        def sync_call() -> None:
            with module.Client(transport=recording_transport(module, seen)) as client:
                client.get(f"{BASE}/models?agent={tag}-thread")

        await asyncio.to_thread(sync_call)

    # Two concurrent runs, each bound to its own session.
    await asyncio.gather(
        asyncio.create_task(agent("a"), context=bound_context(BINDING)),
        asyncio.create_task(agent("b"), context=bound_context(other)),
    )
    assert current_binding() is None
    by_agent = {url.split("agent=")[1]: auth for url, auth in seen}
    assert by_agent == {
        "a": "Bearer sk-sess-1",
        "a-task": "Bearer sk-sess-1",
        "a-thread": "Bearer sk-sess-1",
        "b": "Bearer sk-sess-2",
        "b-task": "Bearer sk-sess-2",
        "b-thread": "Bearer sk-sess-2",
    }


def test_hook_is_installed_once() -> None:
    assert install_http_hooks() == INSTALLED
    module = importlib.import_module(INSTALLED[0])
    send = module.Client.send
    install_http_hooks()
    assert module.Client.send is send
    assert not hasattr(send.__wrapped__, "__wrapped__")  # wrapped exactly once
