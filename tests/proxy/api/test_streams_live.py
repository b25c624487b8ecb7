"""Streams and requests that end badly: failures mid-stream, finish, disconnects, big prompts.

Each test drives a live ``proxima serve`` (tiny model, embedded engine) the
way a client would, and checks what the client receives and what the store
keeps.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.store.store import Store
from proxima.proxy.testing.live import LiveProxy

LONG = {"max_tokens": 800, "ignore_eos": True}


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("streams-proxy")
    live = LiveProxy(
        tiny_model_dir, db_url=f"sqlite:///{work / 'store.db'}", log_path=work / "serve.log"
    )
    live.start()
    yield live
    live.stop()


def _chat_body(proxy: LiveProxy, **extra: Any) -> dict[str, Any]:
    return {"model": proxy.model_name, "messages": [{"role": "user", "content": "Go on."}], **extra}


def _data(line: str) -> Any:
    """The payload of one SSE ``data:`` line (``"[DONE]"`` stays a string)."""
    payload = line.removeprefix("data: ")
    return payload if payload == "[DONE]" else json.loads(payload)


def _assert_aborted_and_unrecorded(proxy: LiveProxy, session_id: str) -> None:
    """The backend request ends within 10 s and the session records no completion."""
    deadline = time.monotonic() + 10
    while _in_flight(proxy) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(proxy) == 0, "the backend request was not aborted"
    time.sleep(1.0)  # a completion that was (wrongly) still committing would land now
    assert proxy.trajectory(session_id)["completions"] == []


def _long_stream(proxy: LiveProxy, key: str, *, timeout: float) -> Any:
    """A streamed long chat completion (a context manager giving the response)."""
    return httpx.stream(
        "POST",
        proxy.base_url + "/chat/completions",
        json=_chat_body(proxy, stream=True, **LONG),
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )


def _stream_with(proxy: LiveProxy, key: str, act: Any) -> list[Any]:
    """Stream a long chat completion; call ``act()`` after the first content; all events."""
    events: list[Any] = []
    acted = False
    with _long_stream(proxy, key, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line:
                continue
            events.append(_data(line))
            delta = events[-1]["choices"][0]["delta"] if "choices" in events[-1] else {}
            if not acted and delta.get("content"):
                act()
                acted = True
    assert acted
    return events


def _in_flight(proxy: LiveProxy) -> int:
    return sum(b["in_flight"] for b in httpx.get(proxy.url + "/health").json()["backends"])


def test_a_trainer_claim_mid_stream_ends_the_stream_with_an_error_event(proxy: LiveProxy) -> None:
    s = proxy.new_session()
    url = f"{proxy.url}/rl/sessions/{s['session_id']}"

    def reward_finish_and_claim() -> None:
        httpx.post(url + "/reward", json={"reward": 1.0}, headers=proxy.admin_headers())
        httpx.post(url + "/finish", headers=proxy.admin_headers()).raise_for_status()

        async def claim() -> list[Any]:
            store = await Store.open(proxy.db_url)
            try:
                return await store.claim_sessions(limit=100, trainer_id="test-trainer")
            finally:
                await store.close()

        claimed = asyncio.run(claim())
        assert s["session_id"] in [c.id for c in claimed]

    events = _stream_with(proxy, s["api_key"], reward_finish_and_claim)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "conflict_error"
    assert "taken by a trainer" in error["message"]
    assert not any(e["choices"][0]["finish_reason"] for e in events[:-2] if e.get("choices"))
    assert proxy.trajectory(s["session_id"])["completions"] == []


def test_finish_during_a_stream_ends_it_with_an_error_and_records_nothing(
    proxy: LiveProxy,
) -> None:
    """A finished session never gains a completion: the stream runs to its end, and the
    commit, which checks the session's status in its own transaction, is refused."""
    s = proxy.new_session()
    url = f"{proxy.url}/rl/sessions/{s['session_id']}"

    def finish() -> None:
        httpx.post(url + "/finish", headers=proxy.admin_headers()).raise_for_status()

    events = _stream_with(proxy, s["api_key"], finish)
    assert events[-1] == "[DONE]"
    *tokens, error = events[:-1]
    assert all("error" not in e for e in tokens) and len(tokens) > 1
    assert error["error"]["code"] == "session_closed", error
    trajectory = proxy.trajectory(s["session_id"])
    assert trajectory["status"] == "finished"
    assert trajectory["completions"] == []
    # No new turn on the finished session.
    again = httpx.post(
        proxy.base_url + "/chat/completions",
        json=_chat_body(proxy, max_tokens=2),
        headers={"Authorization": f"Bearer {s['api_key']}"},
    )
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "session_closed"


def test_streamed_text_completion_sends_logprobs(proxy: LiveProxy) -> None:
    s = proxy.new_session()
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    tokens: list[str] = []
    logprobs: list[float] = []
    offsets: list[int] = []
    text = ""
    for chunk in client.completions.create(
        model=proxy.model_name,
        prompt="Once upon",
        max_tokens=24,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            logprobs += choice.logprobs.token_logprobs
            offsets += choice.logprobs.text_offset
            assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    (recorded,) = proxy.trajectory(s["session_id"])["completions"]
    assert len(logprobs) == len(recorded["output_ids"]) == 24
    assert all(
        math.isclose(a, b, abs_tol=1e-5)
        for a, b in zip(logprobs, recorded["output_logprobs"], strict=True)
    )
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert text == recorded["response_text"]


def test_a_non_streaming_client_that_leaves_aborts_generation(proxy: LiveProxy) -> None:
    """The client closes its connection once the generation is running (not after a fixed
    time, which a fast CPU can outrun), without having read a byte of the reply."""
    s = proxy.new_session()
    body = json.dumps(_chat_body(proxy, max_tokens=2000, ignore_eos=True)).encode()
    url = httpx.URL(proxy.base_url + "/chat/completions")
    head = (
        f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Authorization: Bearer {s['api_key']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while not _in_flight(proxy):
            assert time.monotonic() < deadline, "the generation never started"
            time.sleep(0.01)
    _assert_aborted_and_unrecorded(proxy, s["session_id"])


def test_a_huge_message_does_not_stall_other_clients(proxy: LiveProxy) -> None:
    s = proxy.new_session()
    body = _chat_body(proxy, max_tokens=4)
    # ~6.8 MB, under the 8 MiB body limit: several seconds of rendering and tokenizing here, so a
    # stall of the loop would show even on a machine a few times faster.
    body["messages"] = [{"role": "user", "content": "lorem ipsum dolor sit amet " * 250_000}]
    result: dict[str, Any] = {}

    def big() -> None:
        started = time.monotonic()
        result["resp"] = httpx.post(
            proxy.base_url + "/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {s['api_key']}"},
            timeout=300,
        )
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=big)
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        started = time.monotonic()
        assert httpx.get(proxy.url + "/health", timeout=60).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.05)
    thread.join()
    resp = result["resp"]
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert result["seconds"] > 1.0, "the message is too small to show a stall here"
    # Rendering and tokenizing on the loop would hold a probe for most of the request's time;
    # off the loop a probe waits only for its turn at the GIL, which a loaded host stretches
    # (a probe took 1.3 s of a 19.9 s request beside another test process): a third of it.
    assert slowest < result["seconds"] / 3, (slowest, result["seconds"])


def test_a_streaming_client_that_leaves_aborts_generation(proxy: LiveProxy) -> None:
    s = proxy.new_session()
    with _long_stream(proxy, s["api_key"], timeout=60) as resp:
        for line in resp.iter_lines():
            if line and "content" in _data(line)["choices"][0]["delta"]:
                break  # leaving the block closes the connection mid-stream
    _assert_aborted_and_unrecorded(proxy, s["session_id"])
