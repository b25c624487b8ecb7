"""Bad requests to /v1/responses and /v1/messages: each API's own error envelope, never a 500.

``/v1/responses`` answers in OpenAI's ``{"error": {...}}``; ``/v1/messages``
in Anthropic's ``{"type": "error", "error": {"type", "message"}}``, which the
Anthropic SDK turns into its typed exceptions. Keys are accepted as
``x-api-key`` as well as ``Authorization: Bearer``, session and production
keys alike.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from proxima.proxy.api.error_handlers import install_error_handlers
from proxima.proxy.testing.live import LiveProxy

from tests.production.procs import create_production_key


def _openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


def _post(
    proxy: LiveProxy, path: str, key: str | None, body: Any, **headers: str
) -> httpx.Response:
    if key is not None:
        headers.setdefault("Authorization", f"Bearer {key}")
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
        return httpx.post(proxy.url + path, content=body, headers=headers, timeout=60)
    return httpx.post(proxy.url + path, json=body, headers=headers, timeout=60)


@pytest.fixture()
def session(live_proxy: LiveProxy) -> dict[str, Any]:
    return live_proxy.new_session()


# ------------------------------------------------------------------------ Responses


def _response_body(proxy: LiveProxy, **over: Any) -> dict[str, Any]:
    return {"model": proxy.model_name, "input": "hi", "max_output_tokens": 4, **over}


@pytest.mark.parametrize(
    ("over", "status", "param"),
    [
        ({"model": "gpt-17"}, 404, "model"),
        ({"tools": [{"type": "file_search"}]}, 400, "tools[0].type"),
        ({"tools": [{"type": "computer_use_preview", "display_width": 1}]}, 400, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, 400, None),
        ({"input": None}, 400, "input"),
        ({"temperature": 3}, 400, "temperature"),
        ({"max_output_tokens": 10**6}, 400, None),
        ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
    ],
)
def test_responses_errors_use_openais_envelope(
    live_proxy: LiveProxy, session: dict[str, Any], over: dict[str, Any], status: int, param: Any
) -> None:
    resp = _post(
        live_proxy, "/v1/responses", session["api_key"], _response_body(live_proxy, **over)
    )
    err = _openai_error(resp, status)
    if param is not None:
        assert err["param"] == param


def test_responses_auth_json_and_sdk_errors(live_proxy: LiveProxy, session: dict[str, Any]) -> None:
    body = _response_body(live_proxy)
    assert _openai_error(_post(live_proxy, "/v1/responses", None, body), 401)["type"] == (
        "authentication_error"
    )
    err = _openai_error(_post(live_proxy, "/v1/responses", session["api_key"], b'{"input": '), 400)
    assert "JSON" in err["message"]
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model=live_proxy.model_name, input="hi", tools=[{"type": "file_search"}]
        )
    assert "built-in tools" in info.value.message


def test_finished_session_is_a_conflict_on_both_apis(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session()
    httpx.post(
        f"{live_proxy.url}/rl/sessions/{s['session_id']}/finish",
        json={},
        headers=live_proxy.admin_headers(),
        timeout=30,
    ).raise_for_status()
    resp = _post(live_proxy, "/v1/responses", s["api_key"], _response_body(live_proxy))
    assert _openai_error(resp, 409)["code"] == "session_closed"
    resp = _post(live_proxy, "/v1/messages", s["api_key"], _message_body(live_proxy))
    _anthropic_error(resp, 409, "invalid_request_error")


# ------------------------------------------------------------------------- Messages


def _message_body(proxy: LiveProxy, **over: Any) -> dict[str, Any]:
    return {
        "model": proxy.model_name,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        **over,
    }


@pytest.mark.parametrize(
    ("over", "status", "kind"),
    [
        ({"model": "claude-17"}, 404, "not_found_error"),
        ({"max_tokens": None}, 400, "invalid_request_error"),
        ({"max_tokens": 10**6}, 400, "invalid_request_error"),
        ({"temperature": 1.5}, 400, "invalid_request_error"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "invalid_request_error",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
        ),
        ({"messages": []}, 400, "invalid_request_error"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error"),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error"),
    ],
)
def test_messages_errors_use_anthropics_envelope(
    live_proxy: LiveProxy, session: dict[str, Any], over: dict[str, Any], status: int, kind: str
) -> None:
    body = {k: v for k, v in _message_body(live_proxy, **over).items() if v is not None}
    resp = _post(live_proxy, "/v1/messages", None, body, **{"x-api-key": session["api_key"]})
    _anthropic_error(resp, status, kind)


def test_messages_auth_and_json_errors(live_proxy: LiveProxy, session: dict[str, Any]) -> None:
    body = _message_body(live_proxy)
    _anthropic_error(_post(live_proxy, "/v1/messages", None, body), 401, "authentication_error")
    resp = _post(live_proxy, "/v1/messages", None, body, **{"x-api-key": "sk-wrong"})
    _anthropic_error(resp, 401, "authentication_error")
    resp = _post(live_proxy, "/v1/messages", session["api_key"], b'{"model": ')
    assert "JSON" in _anthropic_error(resp, 400, "invalid_request_error")


def test_anthropic_sdk_raises_its_typed_errors(
    live_proxy: LiveProxy, session: dict[str, Any]
) -> None:
    root = session["base_url"].removesuffix("/v1")
    client = anthropic.Anthropic(base_url=root, api_key=session["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-17", max_tokens=4, messages=messages)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=live_proxy.model_name, max_tokens=20_000, messages=messages)
    stranger = anthropic.Anthropic(base_url=root, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model=live_proxy.model_name, max_tokens=4, messages=messages)


def test_x_api_key_serves_session_and_production_keys(
    live_proxy: LiveProxy, session: dict[str, Any]
) -> None:
    production = create_production_key(live_proxy.db_url, "anthropic-client")
    for key in (session["api_key"], production):
        resp = _post(
            live_proxy, "/v1/messages", None, _message_body(live_proxy), **{"x-api-key": key}
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["type"] == "message"
        resp = _post(
            live_proxy, "/v1/responses", None, _response_body(live_proxy), **{"x-api-key": key}
        )
        assert resp.status_code == 200 and resp.json()["object"] == "response", resp.text


def test_too_large_bodies_get_each_apis_envelope(
    live_proxy: LiveProxy, session: dict[str, Any]
) -> None:
    huge = b'{"input": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    resp = _post(live_proxy, "/v1/messages", session["api_key"], huge)
    _anthropic_error(resp, 413, "request_too_large")
    resp = _post(live_proxy, "/v1/responses", session["api_key"], huge)
    assert _openai_error(resp, 413)["type"] == "invalid_request_error"


# ------------------------------------------ issue 19: every Messages error in its envelope


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "kind"),
    [
        (
            "POST",
            "/v1/messages",
            b'{"model": "m", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}",
            400,
            "invalid_request_error",
        ),
        ("GET", "/v1/messages", None, 405, "invalid_request_error"),
        ("POST", "/v1/messages/batches", b"{}", 404, "not_found_error"),
        ("POST", "/v1/messages", b"\xff\xfe not utf-8", 400, "invalid_request_error"),
    ],
)
def test_errors_outside_the_messages_routes_use_anthropics_envelope(
    live_proxy: LiveProxy,
    session: dict[str, Any],
    method: str,
    path: str,
    body: bytes | None,
    status: int,
    kind: str,
) -> None:
    """Issue 19, 2.3 and 2.10: errors raised before a Messages route runs (the router's 404
    and 405, a body too deep to parse: a 500) came in OpenAI's envelope."""
    resp = httpx.request(
        method,
        live_proxy.url + path,
        content=body,
        headers={"x-api-key": session["api_key"], "Content-Type": "application/json"},
        timeout=60,
    )
    _anthropic_error(resp, status, kind)


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"top_k": 2**64}, "top_k"),
        ({"tools": [{"name": "f</tool_call>", "input_schema": {}}]}, "tools[0].name"),
        ({"tools": [{"name": "x" * 129, "input_schema": {}}]}, "tools[0].name"),
        (
            {"tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]},
            "tools[1].name",
        ),
    ],
)
def test_bad_integers_and_tool_names_on_messages(
    live_proxy: LiveProxy, session: dict[str, Any], over: dict[str, Any], words: str
) -> None:
    """Issue 19, 2.6 and 2.8: ``top_k: 2**64`` was a 500 in OpenAI's envelope; tool names
    are Anthropic's (``^[a-zA-Z0-9_-]{1,128}$``) and unique."""
    resp = _post(live_proxy, "/v1/messages", session["api_key"], _message_body(live_proxy, **over))
    assert words in _anthropic_error(resp, 400, "invalid_request_error")


def test_a_bug_on_the_messages_routes_is_a_500_in_anthropics_envelope() -> None:
    """Issue 19, 2.10: an unexpected exception (a bug) under ``/v1/messages`` is answered in
    Anthropic's envelope, by the app's own error handlers (the surface's envelope)."""
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(prefix="/v1")

    @router.post("/messages/count_tokens")
    async def broken() -> None:
        raise RuntimeError("a bug")

    app.include_router(router)

    @app.post("/v1/chat/completions")
    async def broken_openai() -> None:
        raise RuntimeError("a bug")

    client = TestClient(app, raise_server_exceptions=False)
    resp = client.post("/v1/messages/count_tokens")
    assert resp.status_code == 500
    assert resp.json() == {
        "type": "error",
        "error": {
            "type": "api_error",
            "message": "The server had an error while processing your request.",
        },
    }
    resp = client.post("/v1/chat/completions")
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "api_error"
