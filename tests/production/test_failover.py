"""Backend failover: a backend SIGKILLed mid-stream costs the client nothing.

Two embedded-engine processes (the tiny real model) serve one proxy. A long
stream is cut by killing the backend that serves it; the proxy resumes the
completion from its partial tokens on the survivor, so the client's stream
ends normally and the stored completion is whole and aligned. The killed
backend, restarted on its port, is put back by the health checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.backends.pool import rendezvous_score
from proxima.proxy.testing.live import LiveProxy
from transformers import AutoTokenizer

from tests.production.procs import BackendProcess, wait_until

MAX_TOKENS = 1500


@pytest.fixture
def two_backends(tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[BackendProcess]]:
    backends = [
        BackendProcess.engine(tiny_model_dir, log_path=tmp_path / f"engine{i}.log")
        for i in range(2)
    ]
    try:
        for b in backends:
            b.start()
        yield backends
    finally:
        for b in backends:
            b.stop()


@pytest.fixture
def proxy(
    tiny_model_dir: Path, tmp_path: Path, two_backends: list[BackendProcess]
) -> Iterator[LiveProxy]:
    live = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{tmp_path / 'store.db'}",
        log_path=tmp_path / "serve.log",
        extra_args=[arg for b in two_backends for arg in ("--backend", b.url)],
        env={"PROXIMA_HEALTH_CHECK_INTERVAL": "0.5"},
    )
    live.start()
    yield live
    live.stop()


def _backends(proxy: LiveProxy) -> dict[str, dict]:
    return {b["url"]: b for b in httpx.get(proxy.url + "/health", timeout=10).json()["backends"]}


def test_backend_killed_mid_stream(proxy: LiveProxy, two_backends: list[BackendProcess]) -> None:
    s = proxy.new_session()
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "Tell a very long story."}],
        stream=True,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
    )
    text, chunks, finish, victim = "", 0, None, None
    for chunk in stream:
        if not chunk.choices:
            continue
        chunks += 1
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        if chunks == 20:
            serving = [url for url, b in _backends(proxy).items() if b["in_flight"] == 1]
            assert len(serving) == 1, _backends(proxy)
            victim = next(b for b in two_backends if b.url == serving[0])
            victim.kill()
    assert victim is not None, "the stream ended before the backend could be killed"
    assert finish == "length"

    health = _backends(proxy)
    assert health[victim.url]["healthy"] is False
    (survivor,) = (b for b in two_backends if b is not victim)
    assert health[survivor.url]["healthy"] is True

    (c,) = proxy.trajectory(s["session_id"])["completions"]
    assert (
        len(c["output_ids"]) == len(c["output_logprobs"]) == len(c["output_versions"]) == MAX_TOKENS
    )
    assert set(c["output_versions"]) == {0}
    assert all(lp <= 0.0 for lp in c["output_logprobs"])
    assert c["finish_reason"] == "length"
    tokenizer = AutoTokenizer.from_pretrained(proxy.model_dir)
    assert tokenizer.decode(c["output_ids"], skip_special_tokens=True) == text == c["response_text"]

    # Restarted on the same port, the backend rejoins at the next health check ...
    victim.start()
    wait_until(
        lambda: _backends(proxy)[victim.url]["healthy"], timeout=30, what="the backend to rejoin"
    )
    # ... and serves again: a session whose id rendezvous-hashes to it (as every replica
    # computes) is generated there, with the survivor healthy beside it.
    urls = [b.url for b in two_backends]
    while True:
        fresh = proxy.new_session()
        if max(urls, key=lambda u: rendezvous_score(fresh["session_id"], u)) == victim.url:
            break
    fresh_client = OpenAI(
        base_url=fresh["base_url"], api_key=fresh["api_key"], max_retries=0, timeout=300
    )
    probe = fresh_client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        max_tokens=300,
        extra_body={"ignore_eos": True},
    )
    assert sum(1 for _ in probe) > 0
    (c,) = proxy.trajectory(fresh["session_id"])["completions"]
    assert len(c["output_ids"]) == 300
    assert c["backend"] == victim.url
