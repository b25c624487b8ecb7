"""Bad input gets its status and OpenAI's error envelope; never a 500."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest
from openai import OpenAI
from proxima.proxy.testing.live import LiveProxy


def _envelope(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def _chat(
    proxy: LiveProxy, key: str | None, body: Any = None, content: bytes | None = None
) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if content is not None:
        return httpx.post(
            proxy.base_url + "/chat/completions", content=content, headers=headers, timeout=60
        )
    return httpx.post(proxy.base_url + "/chat/completions", json=body, headers=headers, timeout=60)


@pytest.fixture()
def key(live_proxy: LiveProxy) -> str:
    return live_proxy.new_session()["api_key"]


def _body(proxy: LiveProxy, **over: Any) -> dict[str, Any]:
    return {
        "model": proxy.model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **over,
    }


def test_malformed_json(live_proxy: LiveProxy, key: str) -> None:
    err = _envelope(_chat(live_proxy, key, content=b'{"model": "x", "messages": ['), 400)
    assert err["type"] == "invalid_request_error"
    assert "JSON" in err["message"]


def test_unknown_model(live_proxy: LiveProxy, key: str) -> None:
    err = _envelope(_chat(live_proxy, key, _body(live_proxy, model="gpt-17")), 404)
    assert (err["code"], err["param"]) == ("model_not_found", "model")


@pytest.mark.parametrize(
    ("over", "param"),
    [
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": "lots"}, "max_tokens"),
        ({"temperature": 7}, "temperature"),
        ({"n": 1000}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
        ({"messages": [{"role": "tool", "content": "x"}]}, None),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"logit_bias": {"1": -101}}, "logit_bias"),
    ],
)
def test_invalid_parameters(
    live_proxy: LiveProxy, key: str, over: dict[str, Any], param: str | None
) -> None:
    err = _envelope(_chat(live_proxy, key, _body(live_proxy, **over)), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"].startswith(param)
    assert "pydantic" not in err["message"].lower()


def test_prompt_longer_than_context(live_proxy: LiveProxy, key: str) -> None:
    body = _body(live_proxy, messages=[{"role": "user", "content": "x" * 5000}])
    err = _envelope(_chat(live_proxy, key, body), 400)
    assert err["code"] == "context_length_exceeded"
    err = _envelope(_chat(live_proxy, key, _body(live_proxy, max_tokens=4000)), 400)
    assert err["code"] == "context_length_exceeded"


def test_missing_and_invalid_keys(live_proxy: LiveProxy) -> None:
    assert (
        _envelope(_chat(live_proxy, None, _body(live_proxy)), 401)["type"] == "authentication_error"
    )
    assert (
        _envelope(_chat(live_proxy, "sk-wrong", _body(live_proxy)), 401)["code"]
        == "invalid_api_key"
    )
    # The SDK surfaces it as its own exception type.
    client = OpenAI(base_url=live_proxy.base_url, api_key="sk-wrong")
    with pytest.raises(Exception) as info:
        client.models.list()
    assert getattr(info.value, "status_code", None) == 401


def test_reward_twice_and_foreign_keys(live_proxy: LiveProxy) -> None:
    a, b = live_proxy.new_session(), live_proxy.new_session()
    url = f"{live_proxy.url}/rl/sessions/{a['session_id']}"
    auth_a = {"Authorization": f"Bearer {a['api_key']}"}
    auth_b = {"Authorization": f"Bearer {b['api_key']}"}
    assert httpx.post(url + "/reward", json={"reward": 1.0}, headers=auth_a).status_code == 200
    err = _envelope(httpx.post(url + "/reward", json={"reward": 0.5}, headers=auth_a), 409)
    assert err["code"] == "reward_already_set"
    # Session b's key grants nothing in session a.
    _envelope(httpx.post(url + "/reward", json={"reward": 1.0}, headers=auth_b), 403)
    _envelope(httpx.get(url, headers=auth_b), 403)
    _envelope(httpx.post(url + "/finish", headers=auth_b), 403)
    _envelope(httpx.post(url + "/reward", json={"reward": "high"}, headers=auth_a), 400)
    _envelope(
        httpx.post(url + "/reward", json={"reward": 1.0, "completion_id": "nope"}, headers=auth_a),
        404,
    )


def test_finished_session_cannot_generate(live_proxy: LiveProxy) -> None:
    s = live_proxy.new_session()
    auth = {"Authorization": f"Bearer {s['api_key']}"}
    assert (
        httpx.post(
            f"{live_proxy.url}/rl/sessions/{s['session_id']}/finish", headers=auth
        ).status_code
        == 200
    )
    assert (
        _envelope(_chat(live_proxy, s["api_key"], _body(live_proxy)), 409)["code"]
        == "session_closed"
    )


def test_admin_routes_need_the_admin_token(live_proxy: LiveProxy, key: str) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    _envelope(httpx.post(live_proxy.url + "/rl/sessions", json={}, headers=auth), 403)
    _envelope(httpx.post(live_proxy.url + "/rl/sessions", json={}), 401)
    _envelope(
        httpx.post(
            live_proxy.url + "/admin/weights", json={"version": 9, "path": "/x"}, headers=auth
        ),
        403,
    )
    _envelope(httpx.post(live_proxy.url + "/admin/weights", json={"version": 9, "path": "/x"}), 401)
    admin = live_proxy.admin_headers()
    err = _envelope(
        httpx.post(
            live_proxy.url + "/admin/weights",
            json={"version": 9, "path": "/nonexistent"},
            headers=admin,
        ),
        400,
    )
    assert err["param"] == "path"


def test_unknown_route_and_method(live_proxy: LiveProxy, key: str) -> None:
    _envelope(httpx.get(live_proxy.url + "/v1/nothing-here"), 404)
    _envelope(
        httpx.get(
            live_proxy.base_url + "/chat/completions", headers={"Authorization": f"Bearer {key}"}
        ),
        405,
    )


def test_production_key_is_served_without_a_session(live_proxy: LiveProxy) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxima.cli",
            "keys",
            "create",
            "--name",
            "prod",
            "--no-record",
            "--db",
            live_proxy.db_url,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    key = next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("key: "))
    resp = _chat(live_proxy, key, _body(live_proxy))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    assert (
        OpenAI(base_url=live_proxy.base_url, api_key=key).models.list().data[0].id
        == live_proxy.model_name
    )
