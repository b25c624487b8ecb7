"""A backend that restarts after a push serves the current weights before anything else.

A restarted SGLang server comes back with the model it was started with
(version 0). Two fake SGLang processes (which report the ``weight_version`` of
their last load, and ``0`` after a restart, as SGLang started with
``--weight-version 0`` does) serve one proxy; after a push to version 1 one of
them is SIGKILLed and restarted on its port. Every token generated afterwards
must carry version 1: the proxy reads the version each backend reports and
loads the current weights on a backend before routing to it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.testing.live import LiveProxy

from tests.production.procs import BackendProcess, wait_until


@pytest.fixture
def backends(tmp_path: Path) -> Iterator[list[BackendProcess]]:
    procs = [BackendProcess.fake(log_path=tmp_path / f"fake{i}.log") for i in range(2)]
    try:
        for proc in procs:
            proc.start()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def _serve(
    tiny_model_dir: Path, tmp_path: Path, backends: list[BackendProcess], health_interval: float
) -> LiveProxy:
    return LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        log_path=tmp_path / "serve.log",
        extra_args=[arg for b in backends for arg in ("--backend", b.url)],
        env={"PROXIMA_HEALTH_CHECK_INTERVAL": str(health_interval)},
    ).start()


def _push(proxy: LiveProxy, version: int) -> None:
    resp = httpx.post(
        proxy.url + "/admin/weights",
        json={"version": version, "path": f"/weights/v{version}"},
        headers=proxy.admin_headers(),
        timeout=60,
    )
    assert resp.status_code == 200, resp.text


def _reported(url: str) -> str:
    return httpx.get(url + "/model_info", timeout=10).json()["weight_version"]


def _versions_of_new_sessions(proxy: LiveProxy, n: int) -> list[set[int]]:
    seen = []
    for _ in range(n):
        s = proxy.new_session()
        client = OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0, timeout=60)
        client.chat.completions.create(
            model=proxy.model_name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        (c,) = proxy.trajectory(s["session_id"])["completions"]
        assert len(c["output_versions"]) == 8
        seen.append(set(c["output_versions"]))
    return seen


@pytest.mark.parametrize("seen_down", [True, False], ids=["seen-down", "between-probes"])
def test_restarted_backend_serves_current_version(
    tiny_model_dir: Path, tmp_path: Path, backends: list[BackendProcess], seen_down: bool
) -> None:
    # Between probes: no health check runs during the test, so the first request
    # routed to the restarted backend is what finds it stale.
    proxy = _serve(tiny_model_dir, tmp_path, backends, 0.5 if seen_down else 600)
    try:
        _push(proxy, 1)
        assert [_reported(b.url) for b in backends] == ["1", "1"]
        victim = backends[0]
        victim.kill()
        if seen_down:  # the health checks see it gone before it comes back
            wait_until(
                lambda: not _health(proxy)[victim.url]["healthy"], 10, what="the backend out"
            )
        victim.start()
        if not seen_down:
            assert _reported(victim.url) == "0"  # a restarted server: its start-up weights
        assert _versions_of_new_sessions(proxy, 6) == [{1}] * 6
        wait_until(lambda: _reported(victim.url) == "1", 10, what="the restarted backend loaded")
        wait_until(
            lambda: _health(proxy)[victim.url] == {**_health(proxy)[victim.url], "healthy": True},
            10,
            what="the restarted backend back in the pool",
        )
        assert _health(proxy)[victim.url]["version"] == 1
        assert _versions_of_new_sessions(proxy, 6) == [{1}] * 6
    finally:
        proxy.stop()


def _health(proxy: LiveProxy) -> dict[str, dict]:
    return {b["url"]: b for b in httpx.get(proxy.url + "/health", timeout=10).json()["backends"]}
