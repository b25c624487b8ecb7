"""``proxima serve --engines 2``: two embedded engine processes behind the training pool.

Each engine is its own process with its own copy of the model; sessions stick to one
(rendezvous hashing, as with SGLang servers), a weight push reaches both, and each
reports the pushed version itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("engines")
    proxy = LiveProxy(
        build_tiny_model(work / "tiny"),
        db_url=f"sqlite:///{work / 'store.db'}",
        extra_args=["--engines", "2"],
        log_path=work / "serve.log",
    )
    proxy.start()
    yield proxy
    proxy.stop()


def _backends(proxy: LiveProxy) -> list[dict]:
    state = httpx.get(proxy.url + "/admin/production", headers=proxy.admin_headers(), timeout=30)
    assert state.status_code == 200, state.text
    training = state.json()["deployments"]["production"]  # production follows training here
    assert training["embedded_engines"] == 2
    return training["backends"]


def test_two_engines_serve_sessions_and_both_take_a_push(
    two_engines: LiveProxy, tmp_path: Path
) -> None:
    proxy = two_engines
    backends = _backends(proxy)
    urls = [b["url"] for b in backends]
    assert len(set(urls)) == 2 and all(b["healthy"] for b in backends)

    # Sessions spread over both engines (random session ids: all 20 on one is 2e-6 likely).
    served_before = [
        httpx.get(u + "/get_server_info", timeout=30).json()["stats"]["prefills"] for u in urls
    ]
    for _ in range(20):
        session = proxy.new_session()
        reply = httpx.post(
            session["base_url"] + "/chat/completions",
            headers={"Authorization": f"Bearer {session['api_key']}"},
            json={
                "model": proxy.model_name,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    served = [
        httpx.get(u + "/get_server_info", timeout=30).json()["stats"]["prefills"] - before
        for u, before in zip(urls, served_before, strict=True)
    ]
    assert sum(served) == 20 and min(served) >= 1, served

    # A push reaches both engines: each reports version 1 itself.
    proxy.push_weights(1, build_tiny_model(tmp_path / "v1", seed=1))
    for url in urls:
        info = httpx.get(url + "/model_info", timeout=30).json()
        assert info["weight_version"] == "1", (url, info)
    assert [b["version"] for b in _backends(proxy)] == [1, 1]
