"""Values a validator must refuse are 400s naming the field, never 500s, on SQLite and
PostgreSQL alike.

Each case was a 500 somewhere: ``logit_bias`` keys that are Unicode digits (``str.isdigit``
accepts ``"²"``, ``int()`` does not); a Messages thinking ``signature`` or a Responses
``encrypted_content`` holding non-ASCII characters (the seal's comparison refuses them);
an eval's ``items`` past its column (2**70 past SQLite's int64, 2**31 past PostgreSQL's
int32); on PostgreSQL, ``metadata`` holding NaN or -Infinity (its JSON has neither) and NUL
characters in a session id, a ``completion_id`` or an eval's name (its text has none).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxima.proxy.serving import ThreadedServer
from proxima.proxy.testing.fake_sglang import FakeBackend, create_fake_app
from proxima.proxy.testing.live import LiveProxy

from tests.pg import POSTGRES_PARAM, create_test_database


@pytest.fixture(scope="module", params=["sqlite", POSTGRES_PARAM])
def proxy(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("limits")
    if request.param == POSTGRES_PARAM:
        db_url = create_test_database(request)
    else:
        db_url = f"sqlite:///{work / 'store.db'}"
    with ThreadedServer(create_fake_app(FakeBackend())) as server:
        live = LiveProxy(
            tiny_model_dir,
            db_url=db_url,
            log_path=work / "serve.log",
            extra_args=["--backend", server.url],
        )
        live.start()
        try:
            yield live
        finally:
            live.stop()


def _send(
    proxy: LiveProxy, method: str, path: str, body: Any = None, raw: str | None = None
) -> httpx.Response:
    content = raw.encode() if raw is not None else None if body is None else json.dumps(body)
    return httpx.request(
        method,
        proxy.url + path,
        content=content,
        headers={**proxy.admin_headers(), "Content-Type": "application/json"},
        timeout=60,
    )


def _assert_400(response: httpx.Response, param: str) -> None:
    """A 400 naming ``param``: OpenAI's envelope says it in ``param``, Anthropic's (which has
    no such field) at the head of its message."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if "param" in error:
        assert error["param"] == param, error
    else:
        assert error["message"].startswith(f"{param}: "), error


def _chat(proxy: LiveProxy, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": proxy.model_name, "messages": messages, "max_tokens": 2, **extra}


@pytest.mark.parametrize("key", ["²", "①", "٣", "12345678901234567890", "-1", " 7", ""])
def test_logit_bias_keys_are_ascii_token_ids(proxy: LiveProxy, key: str) -> None:
    bias = {key: 1.0}
    _assert_400(
        _send(proxy, "POST", "/v1/chat/completions", _chat(proxy, logit_bias=bias)), "logit_bias"
    )
    completion = {"model": proxy.model_name, "prompt": "hi", "max_tokens": 2, "logit_bias": bias}
    _assert_400(_send(proxy, "POST", "/v1/completions", completion), "logit_bias")


def test_a_plain_logit_bias_is_served(proxy: LiveProxy) -> None:
    reply = _send(proxy, "POST", "/v1/chat/completions", _chat(proxy, logit_bias={"7": 5.0}))
    assert reply.status_code == 200, reply.text


# The seal's own prefix with a character past ASCII in its MAC or payload: the MAC comparison
# (hmac.compare_digest) raised TypeError on it.
NOT_ASCII = ["prx1.abc.é", "prx1.é.abc", "prx1.abc.\u2028", "prx1.e30.\U0001f600"]


@pytest.mark.parametrize("signature", NOT_ASCII)
def test_a_thinking_signature_is_ascii(proxy: LiveProxy, signature: str) -> None:
    assistant = [
        {"type": "thinking", "thinking": "hmm", "signature": signature},
        {"type": "text", "text": "ok"},
    ]
    body = {
        "model": proxy.model_name,
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": "again"},
        ],
    }
    _assert_400(_send(proxy, "POST", "/v1/messages", body), "messages[1].content[0].signature")


@pytest.mark.parametrize("content", NOT_ASCII)
def test_an_encrypted_content_is_ascii(proxy: LiveProxy, content: str) -> None:
    body = {
        "model": proxy.model_name,
        "max_output_tokens": 16,
        "input": [
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": content},
            {"role": "user", "content": "hi"},
        ],
    }
    _assert_400(_send(proxy, "POST", "/v1/responses", body), "input[0].encrypted_content")


@pytest.mark.parametrize("items", [2**70, 2**31, -1])
def test_eval_items_fit_their_column(proxy: LiveProxy, items: int) -> None:
    _assert_400(
        _send(proxy, "POST", "/admin/versions/0/evals", {"score": 0.5, "items": items}), "items"
    )
    assert (
        _send(
            proxy, "POST", "/admin/versions/0/evals", {"score": 0.5, "items": 2**31 - 1}
        ).status_code
        == 200
    )


@pytest.mark.parametrize(
    "metadata",
    ['{"x": NaN}', '{"x": -Infinity}', '{"x": [1, {"y": Infinity}]}', '{"x": 1e999}'],
)
def test_metadata_numbers_are_finite(proxy: LiveProxy, metadata: str) -> None:
    _assert_400(_send(proxy, "POST", "/rl/sessions", raw=f'{{"metadata": {metadata}}}'), "metadata")


def test_metadata_keeps_a_nul_and_huge_integers(proxy: LiveProxy) -> None:
    """JSON stores a NUL escaped (both databases) and integers of any size: not refused."""
    metadata = {"x\u0000": ["a\u0000b", 2**70]}
    created = _send(proxy, "POST", "/rl/sessions", {"metadata": metadata})
    assert created.status_code == 200, created.text
    read = _send(proxy, "GET", f"/rl/sessions/{created.json()['session_id']}")
    assert read.status_code == 200 and read.json()["metadata"] == metadata


def test_a_nul_in_an_id_or_name_is_refused(proxy: LiveProxy) -> None:
    session = proxy.new_session(metadata={"ok": [1.5, "text"]})
    sid = session["session_id"]
    for method, suffix in (("GET", ""), ("POST", "/reward"), ("POST", "/finish")):
        body = {"reward": 1.0} if suffix == "/reward" else None
        _assert_400(_send(proxy, method, f"/rl/sessions/a%00b{suffix}", body), "session_id")
    reward = {"reward": 1.0, "completion_id": "c\u0000"}
    _assert_400(_send(proxy, "POST", f"/rl/sessions/{sid}/reward", reward), "completion_id")
    evaluation = {"score": 0.5, "name": "held\u0000out"}
    _assert_400(_send(proxy, "POST", "/admin/versions/0/evals", evaluation), "name")
    # The session is intact and readable.
    got = _send(proxy, "GET", f"/rl/sessions/{sid}")
    assert got.status_code == 200 and got.json()["metadata"] == {"ok": [1.5, "text"]}
