"""Weight updates during generation, and streaming that really streams."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.testing.live import LiveProxy
from proxima.proxy.testing.tiny_model import build_tiny_model
from transformers import AutoTokenizer

LONG = {"max_tokens": 1800, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("weights-proxy")
    live = LiveProxy(
        tiny_model_dir, db_url=f"sqlite:///{work / 'store.db'}", log_path=work / "serve.log"
    )
    live.start()
    yield live
    live.stop()


def _in_flight(proxy: LiveProxy) -> int:
    return sum(b["in_flight"] for b in httpx.get(proxy.url + "/health").json()["backends"])


def test_weight_update_mid_stream(proxy: LiveProxy, tmp_path: Path) -> None:
    new_weights = build_tiny_model(tmp_path / "v1", seed=1)
    s = proxy.new_session()
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    stream = client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "Tell a long story."}],
        stream=True,
        **LONG,
    )
    text, update = "", {}

    def push() -> None:
        update["resp"] = httpx.post(
            proxy.url + "/admin/weights",
            json={"version": 1, "path": str(new_weights)},
            headers=proxy.admin_headers(),
            timeout=120,
        )

    pusher = threading.Thread(target=push)
    for n, chunk in enumerate(stream, 1):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if n == 3:
            pusher.start()  # the update lands while this stream is being generated
        finish = chunk.choices[0].finish_reason if chunk.choices else None
    pusher.join()
    assert update["resp"].status_code == 200, update["resp"].text
    assert finish == "length"

    (c,) = proxy.trajectory(s["session_id"])["completions"]
    versions = c["output_versions"]
    assert len(c["output_ids"]) == len(versions) == len(c["output_logprobs"]) == 1800
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)  # one switch, old tokens first
    tokenizer = AutoTokenizer.from_pretrained(proxy.model_dir)
    assert tokenizer.decode(c["output_ids"], skip_special_tokens=True) == text == c["response_text"]
    assert httpx.get(proxy.url + "/health").json()["version"] == 1


def test_stream_delivers_before_generation_ends(proxy: LiveProxy) -> None:
    s = proxy.new_session()
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    stream = client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "Go on."}],
        stream=True,
        **LONG,
    )
    chunks = iter(stream)
    first_content = next(c for c in chunks if c.choices and c.choices[0].delta.content)
    assert first_content.choices[0].finish_reason is None
    # Event order: we hold the first tokens while the backend is still generating
    # and before the completion has been recorded.
    assert _in_flight(proxy) >= 1
    assert proxy.trajectory(s["session_id"])["completions"] == []
    rest = list(chunks)
    assert len(rest) > 10
    assert rest[-1].choices[0].finish_reason == "length"
    assert len(proxy.trajectory(s["session_id"])["completions"]) == 1


def test_n_choices_and_text_completions(proxy: LiveProxy) -> None:
    s = proxy.new_session()
    client = OpenAI(base_url=s["base_url"], api_key=s["api_key"])
    r = client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "hi"}],
        n=3,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content) >= 1 for c in r.choices)
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = client.chat.completions.create(
        model=proxy.model_name,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    seen = {c.choices[0].index for c in stream if c.choices}
    assert seen == {0, 1}
    t = client.completions.create(
        model=proxy.model_name, prompt="Once upon", max_tokens=6, logprobs=1
    )
    assert len(t.choices[0].logprobs.token_logprobs) == t.usage.completion_tokens
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=proxy.model_name, prompt="Once upon", max_tokens=6, stream=True
        )
    )
    assert isinstance(streamed, str)
    completions = proxy.trajectory(s["session_id"])["completions"]
    assert len(completions) == 3 + 2 + 1 + 1
