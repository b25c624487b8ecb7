"""Hostile clients against a live proxy: bad strings, loose types, closed sessions, races.

Every case here was a 500, a silent coercion or a wrong record before it was
fixed; each must now get OpenAI's error envelope with the right status and
``param``, or be served and recorded correctly.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from proxima.proxy.auth import PRODUCTION_KEY_PREFIX, SESSION_KEY_PREFIX, hash_key, new_key
from proxima.proxy.store import Store
from proxima.proxy.store.records import SessionKind
from proxima.proxy.testing.live import LiveProxy

from tests.proxy.store.factories import completion

T = TypeVar("T")
BODY_LIMIT = 64 * 1024
KEY_CACHE_SECONDS = 1.0


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    work = tmp_path_factory.mktemp("hostile-proxy")
    live = LiveProxy(
        tiny_model_dir,
        db_url=f"sqlite:///{work / 'store.db'}",
        log_path=work / "serve.log",
        env={
            "PROXIMA_MAX_BODY_BYTES": str(BODY_LIMIT),
            "PROXIMA_KEY_CACHE_SECONDS": str(KEY_CACHE_SECONDS),
            "PROXIMA_PRIVATE_OBSERVABILITY": "true",
        },
    )
    live.start()
    yield live
    live.stop()


def _in_store(proxy: LiveProxy, use: Callable[[Store], Awaitable[T]]) -> T:
    """Run ``use`` on a store opened on the live proxy's own database."""

    async def run() -> T:
        store = await Store.open(proxy.db_url)
        try:
            return await use(store)
        finally:
            await store.close()

    return asyncio.run(run())


def _production_key(proxy: LiveProxy) -> tuple[str, str]:
    """A recording production key, as ``proxima keys create`` makes one: (key, key id)."""
    key = new_key(PRODUCTION_KEY_PREFIX)
    record = _in_store(
        proxy, lambda s: s.create_api_key(name="app", key_hash=hash_key(key), record=True)
    )
    return key, record.id


def _post(
    proxy: LiveProxy, path: str, body: Any, key: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(
        proxy.url + path,
        content=json.dumps(body).encode(),  # ensure_ascii: a lone surrogate goes as "\ud800"
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        | (headers or {}),
        timeout=120,
    )


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _chat(proxy: LiveProxy, **over: Any) -> dict[str, Any]:
    return {
        "model": proxy.model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **over,
    }


BAD = "ok\ud800"  # a lone surrogate: valid JSON ("\ud800"), not valid Unicode


def _tool(**function: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": {}, **function}}]


CHAT_CASES = [
    ({"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
        "messages[0].content[0].text",
    ),
    ({"messages": [{"role": "user", "content": "hi", "name": BAD}]}, "messages[0].name"),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x": "' + BAD + '"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    (  # valid text that decodes to a lone surrogate once the proxy parses the arguments
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "function": {"name": "f", "arguments": '{"x": "\\ud800"}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
            ]
        },
        "messages[1].tool_calls[0].function.arguments.x",
    ),
    ({"tools": _tool(description=BAD)}, "tools[0].function.description"),
    (
        {"tools": _tool(parameters={"properties": {BAD: {"type": "string"}}})},
        "tools[0].function.parameters.properties",
    ),
    ({"stop": ["fine", BAD]}, "stop[1]"),
    ({"user": BAD}, "user"),
    ({"metadata": {"k": BAD}}, "metadata.k"),  # an OpenAI field we ignore, still checked
]


@pytest.mark.parametrize("over, param", CHAT_CASES)
def test_lone_surrogates_in_chat_are_400s(
    proxy: LiveProxy, over: dict[str, Any], param: str
) -> None:
    session = proxy.new_session()
    err = _error(
        _post(proxy, "/v1/chat/completions", _chat(proxy, **over), session["api_key"]), 400
    )
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert "surrogate" in err["message"]
    assert proxy.trajectory(session["session_id"])["completions"] == []


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": BAD, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": BAD, "max_tokens": 2}, "stop"),
        ("/rl/sessions", {"metadata": {"note": BAD}}, "metadata.note"),
        ("/rl/sessions", {"metadata": {BAD: 1}}, "metadata"),
        ("/rl/sessions", {"group_id": BAD}, "group_id"),
        ("/rl/sessions", {"data_id": "nul\x00"}, "data_id"),  # NUL: no text column takes it
        ("/rl/sessions", {"group_id": "g" * 201}, "group_id"),  # the column holds 200
        ("/admin/weights", {"version": 99, "path": BAD}, "path"),
        ("/admin/weights", {"version": 99, "path": "/tmp/x\x00"}, "path"),
    ],
)
def test_bad_strings_elsewhere_are_400s(proxy: LiveProxy, path: str, body: Any, param: str) -> None:
    if path == "/v1/completions":
        body = {"model": proxy.model_name, **body}
    err = _error(_post(proxy, path, body, proxy.admin_token), 400)
    assert err["param"] == param, err


def test_nul_and_astral_text_is_served_and_recorded(proxy: LiveProxy) -> None:
    session = proxy.new_session(group_id="g" * 200, metadata={"note": "nul\x00 🦀"})
    text = "nul\x00 \U0010ffff 𝔘𝔫𝔦 " + "é" * 300
    r = _post(
        proxy,
        "/v1/chat/completions",
        _chat(proxy, messages=[{"role": "user", "content": text, "name": "ann\x00"}], stop="\x00"),
        session["api_key"],
    )
    assert r.status_code == 200, r.text
    trajectory = proxy.trajectory(session["session_id"])
    assert trajectory["metadata"] == {"note": "nul\x00 🦀"}
    assert trajectory["completions"][0]["request_messages"][0]["content"] == text


@pytest.mark.parametrize(
    "path, over, param",
    [
        ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {"stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"n": "2"}, "n"),
        ("/v1/chat/completions", {"temperature": "0.5"}, "temperature"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"prompt": [True, False]}, "prompt"),
        ("/v1/completions", {"max_tokens": 2.0}, "max_tokens"),
        ("/rl/sessions/{sid}/reward", {"reward": True}, "reward"),
        ("/admin/weights", {"version": "7", "path": "/tmp"}, "version"),
    ],
)
def test_loose_types_are_not_coerced(
    proxy: LiveProxy, path: str, over: dict[str, Any], param: str
) -> None:
    session = proxy.new_session()
    if path.startswith("/v1/"):
        base: dict[str, Any] = {"model": proxy.model_name, "max_tokens": 2}
        base |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {}
        base |= {"prompt": "hi"} if path == "/v1/completions" else {}
        body = base | over
    else:
        body = over
    err = _error(_post(proxy, path.format(sid=session["session_id"]), body, proxy.admin_token), 400)
    assert err["param"] == param, err


def test_floats_may_be_written_as_ints(proxy: LiveProxy) -> None:
    r = _post(
        proxy, "/v1/chat/completions", _chat(proxy, temperature=1, top_p=1), proxy.admin_token
    )
    assert r.status_code == 200, r.text


def test_session_ids_longer_than_their_column_are_400s(proxy: LiveProxy) -> None:
    key, _ = _production_key(proxy)
    err = _error(
        _post(proxy, "/v1/chat/completions", _chat(proxy), key, {"X-Session-Id": "x" * 201}), 400
    )
    assert err["param"] == "x-session-id"
    for path, body in [
        ("/v1/completions", {"model": proxy.model_name, "prompt": "hi"}),
        ("/v1/responses", {"model": proxy.model_name, "input": "hi"}),
    ]:
        err = _error(_post(proxy, path, body, key, {"X-Session-Id": "x" * 201}), 400)
        assert err["param"] == "x-session-id", path
    err = _error(_post(proxy, "/v1/chat/completions", _chat(proxy, user="u" * 201), key), 400)
    assert err["param"] == "user"
    r = _post(proxy, "/v1/chat/completions", _chat(proxy), key, {"X-Session-Id": "x" * 200})
    assert r.status_code == 200, r.text


def test_closed_production_sessions_take_no_more_turns(proxy: LiveProxy) -> None:
    key, _ = _production_key(proxy)
    conversation = {"X-Session-Id": "conversation-1"}
    first = _post(proxy, "/v1/chat/completions", _chat(proxy), key, conversation)
    assert first.status_code == 200, first.text
    session_id = first.headers["X-Proxima-Session-Id"]
    auth = {"Authorization": f"Bearer {key}"}
    for status in ("finished",):
        r = httpx.post(
            f"{proxy.url}/rl/sessions/{session_id}/finish", json={"status": status}, headers=auth
        )
        assert r.status_code == 200, r.text
    err = _error(_post(proxy, "/v1/chat/completions", _chat(proxy), key, conversation), 409)
    assert err["code"] == "session_closed"
    err = _error(
        _post(
            proxy, "/v1/completions", {"model": proxy.model_name, "prompt": "hi"}, key, conversation
        ),
        409,
    )
    assert err["code"] == "session_closed"
    assert len(proxy.trajectory(session_id)["completions"]) == 1
    # A new conversation id opens a new session.
    other = _post(
        proxy, "/v1/chat/completions", _chat(proxy), key, {"X-Session-Id": "conversation-2"}
    )
    assert other.status_code == 200 and other.headers["X-Proxima-Session-Id"] != session_id


def test_failed_production_session_is_closed_too(proxy: LiveProxy) -> None:
    key, _ = _production_key(proxy)
    first = _post(proxy, "/v1/chat/completions", _chat(proxy, user="alice"), key)
    session_id = first.headers["X-Proxima-Session-Id"]
    r = httpx.post(
        f"{proxy.url}/rl/sessions/{session_id}/finish",
        json={"status": "failed"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200, r.text
    err = _error(_post(proxy, "/v1/chat/completions", _chat(proxy, user="alice"), key), 409)
    assert err["code"] == "session_closed"


def test_stored_lone_surrogates_stay_readable(proxy: LiveProxy) -> None:
    """Strings recorded before input was checked must not make a session unreadable."""
    key = new_key(SESSION_KEY_PREFIX)

    async def record(store: Store) -> str:
        session = await store.create_session(api_key_hash=hash_key(key), metadata={"n": BAD})
        await store.record_completion(
            completion=completion(
                session.id, request_messages=[{"role": "user", "content": "x", "name": BAD}]
            )
        )
        return session.id

    session_id = _in_store(proxy, record)
    r = httpx.get(f"{proxy.url}/rl/sessions/{session_id}", headers=proxy.admin_headers())
    assert r.status_code == 200, r.text
    body = json.loads(r.content)
    assert body["metadata"] == {"n": BAD}
    assert body["completions"][0]["request_messages"][0]["name"] == BAD


def test_chunked_body_over_the_limit_is_413(proxy: LiveProxy) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(2 * BODY_LIMIT // 1024):
            yield b"a" * 1024
        yield b'"}]}'

    r = httpx.post(
        proxy.base_url + "/chat/completions",
        content=chunks(),  # no Content-Length: Transfer-Encoding: chunked
        headers={
            "Authorization": f"Bearer {proxy.admin_token}",
            "Content-Type": "application/json",
        },
        timeout=60,
    )
    err = _error(r, 413)
    assert "limit" in err["message"]


def test_revoked_production_key_stops_within_the_cache_time(proxy: LiveProxy) -> None:
    key, key_id = _production_key(proxy)
    assert _post(proxy, "/v1/chat/completions", _chat(proxy), key).status_code == 200
    _in_store(proxy, lambda s: s.revoke_api_key(key_id=key_id))
    time.sleep(KEY_CACHE_SECONDS + 0.2)
    _error(_post(proxy, "/v1/chat/completions", _chat(proxy), key), 401)


def test_a_new_session_is_known_without_a_store_read(proxy: LiveProxy) -> None:
    """Creating a session caches its key: the first turn reads nothing to authenticate.

    Shown by changing the stored key hash behind the proxy's back: the first turn is
    served from the cache; once the cache time has passed, the key is looked up and refused.
    """
    session = proxy.new_session()
    db = sqlite3.connect(proxy.db_url.removeprefix("sqlite:///"))
    db.execute(
        "UPDATE sessions SET api_key_hash = ? WHERE id = ?",
        (hash_key("sk-someone-else"), session["session_id"]),
    )
    db.commit()
    db.close()
    assert _post(proxy, "/v1/chat/completions", _chat(proxy), session["api_key"]).status_code == 200
    time.sleep(KEY_CACHE_SECONDS + 0.2)
    _error(_post(proxy, "/v1/chat/completions", _chat(proxy), session["api_key"]), 401)


def test_private_observability_hides_docs_and_guards_metrics(proxy: LiveProxy) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(proxy.url + path).status_code == 404, path
    _error(httpx.get(proxy.url + "/metrics"), 401)
    session = proxy.new_session()
    _error(
        httpx.get(
            proxy.url + "/metrics", headers={"Authorization": f"Bearer {session['api_key']}"}
        ),
        403,
    )
    r = httpx.get(proxy.url + "/metrics", headers=proxy.admin_headers())
    assert r.status_code == 200 and "proxima_" in r.text
    assert httpx.get(proxy.url + "/health").status_code == 200  # probes need no token


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses", {"input": BAD, "max_output_tokens": 16}),
        ("/v1/responses", {"input": "hi", "instructions": BAD, "max_output_tokens": 16}),
        ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": BAD}]}),
        (
            "/v1/messages",
            {"max_tokens": 2, "system": BAD, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
def test_lone_surrogates_in_the_other_apis_are_400s(
    proxy: LiveProxy, path: str, body: dict[str, Any]
) -> None:
    session = proxy.new_session()
    r = _post(proxy, path, {"model": proxy.model_name, **body}, session["api_key"])
    assert r.status_code == 400, r.text
    assert "surrogate" in r.text
    assert proxy.trajectory(session["session_id"])["completions"] == []


# ------------------------------------------------ issue 19: the API surfaces, hardened

RECURSIVE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
"""A schema no output satisfies: its only rule refers to itself."""
DEAD_END = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/a"}},
    "required": ["a"],
    "additionalProperties": False,
    "$defs": RECURSIVE["$defs"],
}
"""Satisfiable for a few tokens (``{"a": ``), then no token is allowed."""


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _forced_tool(parameters: Any, name: str = "f") -> dict[str, Any]:
    return {
        "tools": [{"type": "function", "function": {"name": name, "parameters": parameters}}],
        "tool_choice": {"type": "function", "function": {"name": name}},
    }


class _Neighbour:
    """An unconstrained chat streaming on the engine until told to stop."""

    def __init__(self, proxy: LiveProxy, key: str) -> None:
        self.proxy, self.key = proxy, key
        self.chunks = 0
        self.finish_reason: str | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = _chat(self.proxy, max_tokens=2000, stream=True, ignore_eos=True, temperature=1.0)
        with httpx.stream(
            "POST",
            self.proxy.base_url + "/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=120,
        ) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                    self.chunks += 1
                if self.stop.is_set():
                    return  # closing the stream aborts it

    def wait_for_more(self, than: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks <= than and self.finish_reason is None:
            assert time.monotonic() < deadline, "the neighbour stopped streaming"
            time.sleep(0.01)


def _interruptions(proxy: LiveProxy) -> float:
    """The proxy's count of generations interrupted and resumed (an aborted backend row)."""
    text = httpx.get(proxy.url + "/metrics", headers=proxy.admin_headers()).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("proxima_generation_interruptions_total")
    )


@pytest.mark.parametrize(
    "over, param",
    [
        ({"response_format": _schema_format(RECURSIVE)}, "response_format"),
        ({"response_format": _schema_format(DEAD_END)}, "response_format"),
        (_forced_tool(RECURSIVE), "tool_choice"),
        (_forced_tool(DEAD_END), "tool_choice"),
    ],
)
def test_unsatisfiable_schemas_fail_their_request_alone(
    proxy: LiveProxy, over: dict[str, Any], param: str
) -> None:
    """Issue 19, 2.1: the grammar error used to kill the engine's worker thread (at prefill)
    or abort every running request (at a decode step). Now: a 400 for that request alone;
    a neighbour decoding meanwhile is not interrupted, and the engine serves on."""
    session = proxy.new_session()
    interrupted = _interruptions(proxy)
    neighbour = _Neighbour(proxy, session["api_key"])
    try:
        neighbour.wait_for_more(than=0)  # decoding when the bad request is admitted
        r = _post(
            proxy,
            "/v1/chat/completions",
            _chat(proxy, max_tokens=200, temperature=1.0, **over),
            session["api_key"],
        )
        err = _error(r, 400)
        assert err["param"] == param, err
        assert "grammar" in err["message"] or "schema" in err["message"], err
        assert neighbour.finish_reason is None  # the two overlapped
        neighbour.wait_for_more(than=neighbour.chunks)  # and it streams on
        assert _interruptions(proxy) == interrupted
    finally:
        neighbour.stop.set()
        neighbour.thread.join(60)
    ok = _post(proxy, "/v1/chat/completions", _chat(proxy), session["api_key"])
    assert ok.status_code == 200, ok.text  # the worker lives on
    assert httpx.get(proxy.url + "/health").status_code == 200


@pytest.mark.parametrize("bad", [None, "abc", [], 2.7, -1, True, 2**64])
@pytest.mark.parametrize("keyword", ["minLength", "maxLength"])
def test_string_lengths_must_be_non_negative_integers(
    proxy: LiveProxy, keyword: str, bad: Any
) -> None:
    """Issue 19, 2.2: these were a 500 or a reset connection."""
    schema = {"type": "object", "properties": {"s": {"type": "string", keyword: bad}}}
    for over, param in (
        ({"response_format": _schema_format(schema)}, "response_format"),
        (_forced_tool(schema), "tool_choice"),
    ):
        r = _post(proxy, "/v1/chat/completions", _chat(proxy, **over), proxy.admin_token)
        err = _error(r, 400)
        assert err["param"] == param and keyword in err["message"], err


def _nested(depth: int) -> bytes:
    return b'{"model": "m", "x": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/rl/sessions"]
)
def test_deeply_nested_json_is_a_400(proxy: LiveProxy, path: str) -> None:
    """Issue 19, 2.3: a body nested 3000 deep was a 500 (RecursionError)."""
    r = httpx.post(
        proxy.url + path,
        content=_nested(3000),
        headers={
            "Authorization": f"Bearer {proxy.admin_token}",
            "Content-Type": "application/json",
        },
        timeout=60,
    )
    err = _error(r, 400)
    if path.startswith("/v1/"):
        assert "nest" in err["message"], err


def test_schema_bounds_are_400s(proxy: LiveProxy) -> None:
    """Issue 19, 2.4: a 400-deep schema compiled for seconds on the event loop; a huge enum
    for a minute. Past the bounds each is a 400 naming the parameter, answered at once."""
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(400):
        deep = {"type": "array", "items": deep}
    wide = {"enum": [f"v{i}" for i in range(6000)]}  # under the body limit, over the enum bound
    for schema, words in ((deep, "deep"), (wide, "enum")):
        for over, param in (
            ({"response_format": _schema_format(schema)}, "response_format"),
            (_forced_tool(schema), "tool_choice"),
        ):
            r = _post(proxy, "/v1/chat/completions", _chat(proxy, **over), proxy.admin_token)
            err = _error(r, 400)
            assert err["param"] == param and words in err["message"], err
    within = {"type": "object", "properties": {"e": {"enum": ["a", "b"]}}, "required": ["e"]}
    r = _post(
        proxy,
        "/v1/chat/completions",
        _chat(proxy, max_tokens=40, response_format=_schema_format(within)),
        proxy.admin_token,
    )
    assert r.status_code == 200, r.text


def test_a_lone_surrogate_in_previous_response_id_is_a_400(proxy: LiveProxy) -> None:
    """Issue 19, 2.5: the id was echoed into the 404's message, which could not be encoded."""
    session = proxy.new_session()
    body = {"model": proxy.model_name, "input": "hi", "previous_response_id": BAD}
    err = _error(_post(proxy, "/v1/responses", body, session["api_key"]), 400)
    assert err["param"] == "previous_response_id" and "surrogate" in err["message"]


@pytest.mark.parametrize(
    "path, over, param",
    [
        ("/v1/chat/completions", {"seed": 2**64}, "seed"),
        ("/v1/chat/completions", {"seed": 2**63}, "seed"),
        ("/v1/chat/completions", {"seed": -(2**63) - 1}, "seed"),
        ("/v1/chat/completions", {"top_k": 2**64}, "top_k"),
        ("/v1/chat/completions", {"n": 2**64}, "n"),
        ("/v1/chat/completions", {"max_tokens": 2**64}, "max_tokens"),
        ("/v1/chat/completions", {"top_logprobs": 2**64, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"logit_bias": {str(2**64): 1}}, "logit_bias"),
        ("/v1/completions", {"seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": [2**64]}, "prompt"),
        ("/v1/completions", {"logprobs": 2**64}, "logprobs"),
        ("/v1/responses", {"top_logprobs": 2**64}, "top_logprobs"),
    ],
)
def test_integers_past_64_bits_are_400s(
    proxy: LiveProxy, path: str, over: dict[str, Any], param: str
) -> None:
    """Issue 19, 2.6: ``seed: 2**64`` was a 500 (orjson cannot write it to the backend)."""
    if path == "/v1/chat/completions":
        body = _chat(proxy, **over)
    elif path == "/v1/completions":
        body = {"model": proxy.model_name, "prompt": "hi", "max_tokens": 2, **over}
    else:
        body = {"model": proxy.model_name, "input": "hi", "max_output_tokens": 4, **over}
    err = _error(_post(proxy, path, body, proxy.admin_token), 400)
    assert err["param"] == param, err


def test_the_largest_seed_is_served(proxy: LiveProxy) -> None:
    for seed in (2**63 - 1, -(2**63)):
        r = _post(proxy, "/v1/chat/completions", _chat(proxy, seed=seed), proxy.admin_token)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "tools, param",
    [
        (_tool(name="f</tool_call>"), "tools[0].function.name"),
        (_tool(name="a b"), "tools[0].function.name"),
        (_tool(name='f"'), "tools[0].function.name"),
        (_tool(name="x" * 65), "tools[0].function.name"),
        (_tool(name=""), "tools[0].function.name"),
        (_tool(name="f") + _tool(name="f"), "tools[1].function.name"),
    ],
)
def test_tool_names_are_checked(proxy: LiveProxy, tools: list[Any], param: str) -> None:
    """Issue 19, 2.8: a name holding ``</tool_call>`` made a forced call that finished but
    did not parse. Names follow OpenAI's ``^[a-zA-Z0-9_-]{1,64}$``, and are unique."""
    session = proxy.new_session()
    body = _chat(proxy, tools=tools, tool_choice="required")
    err = _error(_post(proxy, "/v1/chat/completions", body, session["api_key"]), 400)
    assert err["param"] == param, err
    responses_tools = [{"type": "function", **t["function"]} for t in tools]
    body = {"model": proxy.model_name, "input": "hi", "tools": responses_tools}
    err = _error(_post(proxy, "/v1/responses", body, session["api_key"]), 400)
    assert err["param"] == param.replace(".function", ""), err
    assert proxy.trajectory(session["session_id"])["completions"] == []


def test_previous_response_id_with_a_production_key(proxy: LiveProxy) -> None:
    """Issue 19, 2.9: without X-Session-Id every lookup was a 404 and created an empty
    production session. Now the lookup creates nothing, and finds the key's own responses."""
    key, _ = _production_key(proxy)
    other, _ = _production_key(proxy)

    async def sessions_of_key(store: Store) -> int:
        return await store.count_sessions(kind=SessionKind.PRODUCTION)

    first = _post(proxy, "/v1/responses", {"model": proxy.model_name, "input": "hi"}, key)
    assert first.status_code == 200, first.text
    response_id = first.json()["id"]
    before = _in_store(proxy, sessions_of_key)
    for headers in ({}, {"X-Session-Id": "never-used"}):
        err = _error(
            _post(
                proxy,
                "/v1/responses",
                {"model": proxy.model_name, "input": "again", "previous_response_id": "resp_x"},
                key,
                headers,
            ),
            404,
        )
        assert err["param"] == "previous_response_id"
    assert _in_store(proxy, sessions_of_key) == before  # lookups created nothing
    follow = _post(
        proxy,
        "/v1/responses",
        {"model": proxy.model_name, "input": "again", "previous_response_id": response_id},
        key,
    )
    assert follow.status_code == 200, follow.text
    session_id = first.headers["X-Proxima-Session-Id"]
    assert follow.headers["X-Proxima-Session-Id"] == session_id  # the same conversation
    turns = proxy.trajectory(session_id)["completions"]
    assert [t["id"] for t in turns][0] == response_id and len(turns) == 2
    # Another key's response is not found.
    err = _error(
        _post(
            proxy,
            "/v1/responses",
            {"model": proxy.model_name, "input": "x", "previous_response_id": response_id},
            other,
        ),
        404,
    )
    assert err["param"] == "previous_response_id"


def test_tool_names_as_long_as_each_api_allows_are_served(proxy: LiveProxy) -> None:
    """Anthropic allows 128 characters (Claude Code's MCP tools use them), OpenAI 64."""
    session = proxy.new_session()
    name = "mcp__server__" + "t" * 100
    tools = [{"name": name, "input_schema": {"type": "object", "properties": {}}}]
    body = {"model": proxy.model_name, "max_tokens": 2, "tools": tools}
    body["messages"] = [{"role": "user", "content": "hi"}]
    r = _post(proxy, "/v1/messages", body, session["api_key"])
    assert r.status_code == 200, r.text
    r = _post(
        proxy, "/v1/chat/completions", _chat(proxy, tools=_tool(name="t" * 64)), session["api_key"]
    )
    assert r.status_code == 200, r.text
